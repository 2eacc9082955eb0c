"""A launcher's release (no fence) leaves no incarnation current until the name joins again
(round 14 #1): only a join hands out a fence, whatever moves rows after it (expiry, a new epoch,
a restore, a restart, a place taken). Driven on the store directly (real SQLite on disk)."""

from __future__ import annotations

import sqlite3

import pytest

from adapt_clock import Clock
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.shards import Fenced, QuotaExceeded, ShardStore

A = "a" * 64   # an owner's token digest


@pytest.fixture
def store(tmp_path):
    clock = Clock()
    s = ShardStore(tmp_path / "s.db", clock=clock)
    s.clock = clock
    s.create_dataset(DatasetConfig("d", 64, 8, lease_s=10, num_epochs=None), A)
    yield s
    s.close()


def _refused(store, worker, fence, match="without a fence"):
    """Every call of `worker` at `fence` is Fenced (lease, ack, its own release)."""
    with pytest.raises(Fenced, match=match):
        store.lease("d", worker, fence, token_sha256=A)
    with pytest.raises(Fenced, match=match):
        store.ack("d", worker, fence, 0, 0, 1, token_sha256=A)
    with pytest.raises(Fenced, match=match):
        store.release("d", worker, fence, token_sha256=A)


def test_a_name_that_never_joined_gets_no_row_and_no_fence(tmp_path, store):
    """Before: the release stored a row at fence 1 and a lease with it was served."""
    assert store.release("d", "ghost", None, error="pod gone", token_sha256=A).released == []
    with pytest.raises(Fenced, match="has not joined"):
        store.lease("d", "ghost", 1, token_sha256=A)
    with sqlite3.connect(tmp_path / "s.db") as c:
        assert c.execute("SELECT COUNT(*) FROM workers WHERE worker='ghost'").fetchone() == (0,)
    assert store.join("d", "ghost", A).fence == 1   # (its first incarnation, as if never released)


def test_a_release_of_an_unknown_name_at_the_worker_limit_is_no_429(tmp_path):
    """Before: it made a row like a join, so a launcher's release of a pod that died before
    joining was refused QuotaExceeded at max_workers_per_dataset."""
    s = ShardStore(tmp_path / "s.db", max_workers_per_dataset=1)
    try:
        s.create_dataset(DatasetConfig("d", 16, 4), A)
        s.join("d", "a", A)
        assert s.release("d", "ghost", None, token_sha256=A).released == []
        with pytest.raises(QuotaExceeded):
            s.join("d", "b", A)   # (a's place is still a's: it never left)
    finally:
        s.close()


def test_a_released_known_name_is_fenced_off_at_every_fence_until_it_joins(store):
    """Before: the release moved the row to fence 2, and a lease with 2 (never handed out)
    was served; a second release moved it to 3."""
    f = store.join("d", "w", A).fence
    held = store.lease("d", "w", f, count=2, token_sha256=A).leases
    released = store.release("d", "w", None, error="pod gone", token_sha256=A).released
    assert sorted(released) == sorted((x.epoch, x.shard) for x in held)
    for fence in (f, f + 1):
        _refused(store, "w", fence)
    assert store.release("d", "w", None, token_sha256=A).released == []   # (again: no fence used)
    _refused(store, "w", f + 1)
    back = store.join("d", "w", A).fence
    assert back == f + 2   # above the burnt fence
    _refused(store, "w", f + 1, match="stale")
    assert store.lease("d", "w", back, token_sha256=A).status == "ok"


def test_fenced_off_stays_so_across_expiry_a_new_epoch_a_restore_and_a_restart(tmp_path, store):
    """Nothing but a join moves a fenced-off name back to a current incarnation."""
    f = store.join("d", "w", A).fence
    store.lease("d", "w", f, count=8, token_sha256=A)   # all of epoch 0
    store.release("d", "w", None, limit=1, token_sha256=A)   # (a step; the rest held)
    _refused(store, "w", f + 1)
    other = store.join("d", "o", A).fence
    store.clock.now += 100   # w's 7 leases expire in o's call, which opens epoch 1
    reply = store.lease("d", "o", other, count=8, token_sha256=A)
    assert {x.epoch for x in reply.leases} == {0}
    for x in reply.leases:
        store.ack("d", "o", other, x.epoch, x.shard, 8, token_sha256=A)
    assert store.lease("d", "o", other, token_sha256=A).leases[0].epoch == 1
    _refused(store, "w", f + 1)
    store.restore(store.snapshot("d"), A)
    _refused(store, "w", f + 1)
    store.close()
    again = ShardStore(tmp_path / "s.db")
    try:
        _refused(again, "w", f + 1)
        assert again.join("d", "w", A).fence == f + 2
    finally:
        again.close()


def test_a_fenced_off_name_gives_its_place_and_its_fences_stay_off(tmp_path):
    """A launcher-released name holding nothing gives its place; the new name's fences start
    above the burnt one, and the old name, back, above them too."""
    s = ShardStore(tmp_path / "s.db", max_workers_per_dataset=1)
    try:
        s.create_dataset(DatasetConfig("d", 16, 4), A)
        f = s.join("d", "a", A).fence
        s.release("d", "a", None, token_sha256=A)
        assert s.join("d", "b", A).fence == f + 2   # a's place, above its burnt f + 1
        with pytest.raises(Fenced, match="has not joined"):
            s.lease("d", "a", f + 1, token_sha256=A)
    finally:
        s.close()


def test_a_fence_ahead_of_the_current_one_is_named_so(store):
    """Before: 'fence 99 is stale: incarnation 1 of it joined since; this one must stop'."""
    f = store.join("d", "w", A).fence
    with pytest.raises(Fenced, match=f"fence 99 was never handed out.*is fence {f}"):
        store.lease("d", "w", 99, token_sha256=A)
    with pytest.raises(Fenced, match="never handed out"):
        store.ack("d", "w", 99, 0, 0, 1, token_sha256=A)
    store.join("d", "w", A)
    with pytest.raises(Fenced, match="stale"):
        store.lease("d", "w", f, token_sha256=A)
