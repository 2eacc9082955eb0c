"""Restores written beside the old rows a chunk at a time (other jobs' calls run between the
chunks), switched to in one small transaction, the replaced rows deleted afterwards; a restore
that never finishes changes nothing."""

from __future__ import annotations

import sqlite3
import threading

import httpx
import pytest

from conftest import eventually
from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig, validate_snapshot
from stragglers.adapt.errors import Conflict
from stragglers.adapt.replies import Restored, to_builtins
from stragglers.adapt.restores import RESTORE_CHUNK, prepare_restore
from stragglers.adapt.service import EmbeddedServer
from stragglers.adapt.shards import ShardStore

OWNER = "owner-token-0123456789"
N_SHARDS = 40 * RESTORE_CHUNK


def staged_rows(db) -> int:
    """Shard rows stored under a restore's own key (written, not yet switched to)."""
    with sqlite3.connect(db) as c:
        return c.execute("SELECT COUNT(*) FROM shards WHERE dataset LIKE 'big/%' AND"
                         " dataset NOT IN (SELECT rows_key FROM datasets WHERE"
                         " rows_key IS NOT NULL)").fetchone()[0]


def rows_of_big(db) -> int:
    """Shard rows of data set 'big' under any key (its own, staged or replaced)."""
    with sqlite3.connect(db) as c:
        return c.execute("SELECT COUNT(*) FROM shards WHERE dataset='big' OR"
                         " dataset LIKE 'big/%'").fetchone()[0]


def live_rows_of_big(db) -> int:
    """Shard rows of 'big' that are not being deleted: the ones it reads and any staged (the
    rows an earlier restore replaced go in paced steps, whenever the commit thread has time)."""
    with sqlite3.connect(db) as c:
        return c.execute(
            "SELECT COUNT(*) FROM shards WHERE dataset IN (SELECT COALESCE(rows_key, name) FROM"
            " datasets WHERE name='big') OR dataset IN (SELECT rows_key FROM row_sets WHERE"
            " dataset='big' AND state != 'garbage')").fetchone()[0]


@pytest.fixture
def big(tmp_path):
    """A service with data set 'big' (N_SHARDS shards, one epoch) and its snapshot."""
    srv = EmbeddedServer(tmp_path / "s.db").start()
    owner = ShardClient(srv.url, "big", "w", token=OWNER)
    owner.create_dataset(DatasetConfig("big", N_SHARDS, 1, num_epochs=1))
    owner.join()
    owner.lease()
    snap = owner.snapshot()
    yield srv, owner, snap
    srv.stop()


@pytest.mark.slow
def test_a_restore_is_written_in_chunks_other_calls_between(big, tmp_path):
    srv, owner, snap = big
    db = tmp_path / "s.db"
    other = ShardClient(srv.url, "small", "w", token="other-token-0123456789")
    other.create_dataset(DatasetConfig("small", 10**6, 64))
    other.join()
    reply: list[Restored] = []
    t = threading.Thread(target=lambda: reply.append(owner.restore(snap)))
    t.start()
    seen, leases = set(), 0
    while t.is_alive():
        seen.add(staged_rows(db))
        other.lease()
        leases += 1
    t.join()
    assert reply == [Restored(N_SHARDS, 1)]
    # rows were committed a chunk at a time (one transaction showed none, then all of them)
    assert any(0 < n < N_SHARDS for n in seen), sorted(seen)[:10]
    assert all(n % RESTORE_CHUNK == 0 for n in seen), sorted(seen)[:10]
    assert leases >= 2
    # the replaced rows are deleted after the switch, and the state is the snapshot's
    eventually(lambda: rows_of_big(db) == N_SHARDS, what="the replaced rows deleted")
    after = owner.snapshot()
    assert after.epochs_created == snap.epochs_created and after.dataset == snap.dataset
    assert len(after.shards) == N_SHARDS
    assert owner.status().epochs["0"]["DOING"] == 0   # the held shard went back to TODO


@pytest.mark.slow
def test_a_restore_is_prepared_outside_the_serving_process(big, monkeypatch):
    """Parsing and preparing a 655,360-row snapshot is seconds of Python: on a thread of the
    service it held the GIL that the event loop and the commit thread need (every other job's
    lease + ack ~5x slower). Here the serving process's own prepare_restore is made to fail: the
    restore must not call it, and each commit step unpacks at most one chunk of rows."""
    srv, owner, snap = big

    def in_serving_process(checked):
        raise AssertionError("a restore prepared in the serving process")

    monkeypatch.setattr(prepare_restore, "__code__", in_serving_process.__code__)
    steps: list[int] = []
    real = ShardStore.restore_rows

    def restore_rows(self, key, rows):
        steps.append(len(rows))
        return real(self, key, rows)

    monkeypatch.setattr(ShardStore, "restore_rows", restore_rows)
    assert owner.restore(snap) == Restored(N_SHARDS, 1)
    assert steps and max(steps) <= RESTORE_CHUNK and sum(steps) == N_SHARDS
    assert owner.status().epochs["0"]["DOING"] == 0   # the held shard went back to TODO
    # its refusals still come back as the service's 4xx (built again from the child's values)
    plain = to_builtins(snap)
    bad = {**plain, "dataset": {**plain["dataset"], "name": "other"}}
    r = httpx.post(f"{srv.url}/datasets/big/restore", json=bad,
                   headers={"Authorization": f"Bearer {OWNER}"}, timeout=60)
    assert r.status_code == 400 and "dataset.name" in r.json()["error"], r.text


@pytest.mark.slow
def test_one_restore_per_token_at_once(big, tmp_path):
    srv, owner, snap = big
    db = tmp_path / "s.db"
    t = threading.Thread(target=owner.restore, args=(snap,))
    t.start()
    try:
        eventually(lambda: staged_rows(db) > 0, what="the first restore under way")
        r = httpx.post(f"{srv.url}/datasets/big/restore", json=to_builtins(snap),
                       headers={"Authorization": f"Bearer {OWNER}"}, timeout=60)
        assert r.status_code == 503 and r.json()["kind"] == "Busy", r.text
        assert "restore is under way" in r.json()["error"]
    finally:
        t.join()
    assert httpx.get(f"{srv.url}/health").status_code == 200


def test_a_restore_cut_short_changes_nothing_and_its_rows_are_deleted(tmp_path):
    db = tmp_path / "s.db"
    store = ShardStore(db)
    store.create_dataset(DatasetConfig("big", 3 * RESTORE_CHUNK, 1))
    f = store.join("big", "w").fence
    store.lease("big", "w", f)
    before = store.snapshot("big")
    prepared = prepare_restore(validate_snapshot(before))
    key = store.restore_begin(prepared)
    store.restore_rows(key, prepared.chunk(0))
    store.close()   # the service stopped half-way
    store = ShardStore(db)
    try:
        assert store.snapshot("big") == before
        with pytest.raises(Conflict, match="interrupted"):
            store.restore_finish(prepared, key)
        assert store.has_garbage()
        while store.collect_garbage():
            pass
        assert rows_of_big(db) == 1024   # the epoch's rows written so far, nothing staged
        assert store.snapshot("big") == before
        assert store.lease("big", "w", f).status == "ok"
    finally:
        store.close()


def test_live_rows_named_garbage_are_never_deleted(tmp_path):
    db = tmp_path / "s.db"
    store = ShardStore(db)
    store.create_dataset(DatasetConfig("big", 100, 10))
    with sqlite3.connect(db) as c:   # an edited file names the data set's own rows garbage
        c.execute("INSERT INTO row_sets VALUES ('big', 'big', 'garbage')")
    try:
        while store.collect_garbage():
            pass
        assert rows_of_big(db) == 10
        assert store.status("big").epochs["0"]["TODO"] == 10
    finally:
        store.close()


@pytest.mark.slow
def test_a_restore_whose_preparing_process_died_is_503_and_the_next_is_served(big, tmp_path):
    # The child that prepares restores killed (as the kernel's OOM killer would): the restore
    # is answered 503 Busy, changes nothing, and the pool is rebuilt for the next one (a dead
    # pool used to answer every later restore 500).
    import os
    import signal

    srv, owner, snap = big
    db = tmp_path / "s.db"
    assert owner.restore(snap) == Restored(N_SHARDS, 1)   # the pool's child is started
    children = srv.app.state.parser.pids()
    assert children
    for pid in children:
        os.kill(pid, signal.SIGKILL)
    before, status = live_rows_of_big(db), owner.status()
    assert before >= N_SHARDS   # (the rows it reads are counted)
    r = httpx.post(f"{srv.url}/datasets/big/restore", json=to_builtins(snap),
                   headers={"Authorization": f"Bearer {OWNER}"}, timeout=60)
    assert r.status_code == 503 and r.json()["kind"] == "Busy", r.text
    assert "died or could not start" in r.json()["error"]
    assert live_rows_of_big(db) == before and owner.status() == status
    assert owner.restore(snap) == Restored(N_SHARDS, 1)   # a new child prepares it
    assert httpx.get(f"{srv.url}/health").status_code == 200
