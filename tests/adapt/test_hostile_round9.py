"""Hostile cases of a ninth round (issue 34) on the shard service: the one-service claim, a
stopped service's file, restores refused for space."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import fill
from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig, validate_snapshot
from stragglers.adapt.replies import to_builtins
from stragglers.adapt.restores import RESTORE_CHUNK, prepare_restore
from stragglers.adapt.service import EmbeddedServer, token_digest
from stragglers.adapt.shards import ShardStore
from stragglers.adapt.space import Reserve

OWNER = "owner-token-0123456789"


def serve(tmp: Path, db: Path) -> subprocess.Popen:
    """`stragglers adapt serve --db DB --port 0` in a subprocess (stdout and stderr together)."""
    return subprocess.Popen([sys.executable, "-m", "stragglers.cli", "adapt", "serve", "--db",
                             str(db), "--port", "0"], cwd=tmp, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_a_second_service_through_a_hard_link_is_refused_in_one_line(tmp_path):
    # (fails before: the lock was a file named after the path's realpath, and a hard link to
    # the database reached another lock name: two services on one SQLite file)
    db, link = tmp_path / "s.db", tmp_path / "link.db"
    first, second = serve(tmp_path, db), None
    try:
        assert first.stdout is not None
        assert b"http://127.0.0.1:" in first.stdout.readline()   # serving: it holds the file
        os.link(db, link)
        second = serve(tmp_path, link)
        assert second.stdout is not None
        said = second.stdout.readline().decode()   # a start says its URL first and serves on
        assert "http://" not in said, f"a second service started: {said}"
        out, _ = second.communicate(timeout=120)
        lines = (said + out.decode()).strip().splitlines()
        assert second.returncode == 2, lines
        assert len(lines) == 1 and str(link) in lines[0], lines
        assert "another shard service serves this file" in lines[0]
        assert f"pid {first.pid}" in lines[0]
        assert first.poll() is None
    finally:
        if first.poll() is None:
            first.terminate()
        first.communicate(timeout=60)
        if second is not None and second.poll() is None:
            second.kill()
            second.communicate(timeout=60)
    wal = tmp_path / "s.db-wal"   # (SIGTERM: the log folded into the file, removed)
    assert not wal.exists() or wal.stat().st_size == 0
    third = serve(tmp_path, link)   # the first gone, the file is free again
    try:
        assert third.stdout is not None
        assert b"http://127.0.0.1:" in third.stdout.readline()
    finally:
        third.terminate()
        third.communicate(timeout=60)


@pytest.mark.slow
def test_a_stopped_service_leaves_its_file_whole_without_a_log(tmp_path):
    # (fails before: stop() never closed the store: every commit stayed in the -wal file beside
    # a 4 KiB database, and the file alone, copied or opened read-only, held none of them)
    db = tmp_path / "s.db"
    srv = EmbeddedServer(db).start()
    try:
        owner = ShardClient(srv.url, "d", "w", token=OWNER)
        owner.create_dataset(DatasetConfig("d", 1000, 10))
        owner.join()
        acked = []
        for _ in range(3):
            x = owner.lease().leases[0]
            owner.ack(x.epoch, x.shard, x.size)
            acked.append(x.shard)
    finally:
        srv.stop()
    wal = Path(f"{db}-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    # immutable: the file alone is read, no log and no lock (as a copy of it, or a read-only
    # medium, would be)
    with contextlib.closing(sqlite3.connect(f"file:{db}?immutable=1", uri=True)) as c:
        done = [r[0] for r in c.execute("SELECT shard FROM shards WHERE state='DONE'"
                                        " ORDER BY shard")]
    assert done == sorted(acked)
    srv = EmbeddedServer(db).start()   # and it serves again from it
    try:
        assert ShardClient(srv.url, "d", "w", token=OWNER).status().epochs["0"]["DONE"] == 3
    finally:
        srv.stop()


def staged(db: Path) -> int:
    """Shard rows under a key no data set reads (a restore's, written and not switched to)."""
    with contextlib.closing(sqlite3.connect(db)) as c:
        return c.execute("SELECT COUNT(*) FROM shards WHERE dataset NOT IN (SELECT"
                         " COALESCE(rows_key, name) FROM datasets)").fetchone()[0]


def leave_free(disk: Path, nbytes: int) -> None:
    """Fill the file system of `disk` but for about `nbytes`."""
    st = os.statvfs(disk)
    with open(disk / "filler", "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - nbytes))


@pytest.mark.slow
def test_a_restore_refused_for_space_leaves_nothing_staged(small_disk):
    # (fails before: the restore's first chunks were written, the next refused 507, and its
    # rows stayed staged: marking them took a write, deleting them more, on the full disk)
    db = small_disk / "s.db"
    srv = EmbeddedServer(db).start()
    try:
        owner = ShardClient(srv.url, "big", "w", token=OWNER)
        owner.create_dataset(DatasetConfig("big", 20_000, 1, num_epochs=1))
        owner.join()
        owner.lease()
        before = owner.snapshot()
        leave_free(small_disk, 400_000)   # room for a chunk or two of its 20,000 rows
        r = httpx.post(f"{srv.url}/datasets/big/restore", json=to_builtins(before),
                       headers={"Authorization": f"Bearer {OWNER}"}, timeout=120)
        assert r.status_code == 507 and r.json()["kind"] == "DiskFull", r.text
        assert staged(db) == 0
        assert not [p for p in small_disk.iterdir() if "-reserve-" in p.name]
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert owner.snapshot() == before
    finally:
        srv.stop()
    srv = EmbeddedServer(db).start()   # restartable on the full disk, the state as it was
    try:
        assert ShardClient(srv.url, "big", "w", token=OWNER).snapshot() == before
    finally:
        srv.stop()


def test_a_restore_cut_by_a_disk_filled_meanwhile_takes_its_rows_back(small_disk):
    # the disk filled by someone else between two chunks: the reserve taken before the first
    # is given back, and the deletion of the rows written fits in it
    db = small_disk / "s.db"
    store = ShardStore(db)
    try:
        store.create_dataset(DatasetConfig("big", 3 * RESTORE_CHUNK, 1))
        before = store.snapshot("big")
        prepared = prepare_restore(validate_snapshot(before))
        reserve = store.restore_reserve(prepared)
        key = store.restore_begin(prepared)
        store.restore_rows(key, prepared.chunk(0))
        assert staged(db) == RESTORE_CHUNK
        fill(small_disk)
        with pytest.raises(sqlite3.Error):
            store.restore_rows(key, prepared.chunk(1))
        reserve.release()
        store.restore_abort(key)
        while store.collect_garbage(key):
            pass
        assert staged(db) == 0
        assert store.snapshot("big") == before
    finally:
        store.close()
    store = ShardStore(db)   # opens again on the full disk
    try:
        assert store.snapshot("big") == before
    finally:
        store.close()


def test_a_restore_with_room_leaves_no_reserve(small_disk):
    db = small_disk / "s.db"
    store = ShardStore(db)
    try:
        store.create_dataset(DatasetConfig("big", 2 * RESTORE_CHUNK, 1))
        before = store.snapshot("big")
        assert store.restore(before).restored == 2 * RESTORE_CHUNK
        assert store.snapshot("big") == before
        assert not [p for p in small_disk.iterdir() if "-reserve-" in p.name]
    finally:
        store.close()


def test_a_worker_holds_a_bounded_number_of_shards(tmp_path):
    # (fails before: a worker leased without bound, 262,144 shards, and its release or next
    # join requeued them all in one transaction: every other job's calls waited seconds)
    store = ShardStore(tmp_path / "s.db", max_held_per_worker=8)
    try:
        store.create_dataset(DatasetConfig("d", 100, 1, lease_s=600))
        f = store.join("d", "w").fence
        assert len(store.lease("d", "w", f, count=5).leases) == 5
        assert len(store.lease("d", "w", f, count=5).leases) == 3
        full = store.lease("d", "w", f, count=5)
        assert full.status == "wait" and not full.leases
        g = store.join("d", "v").fence   # another worker is not held back
        assert len(store.lease("d", "v", g, count=5).leases) == 5
        x = store.lease("d", "w", f, count=1, request_id="r")   # (a replay answers as before)
        assert x.status == "wait"
        held = store.status("d").epochs["0"]["DOING"]
        store.release("d", "w", f)
        assert store.status("d").epochs["0"]["DOING"] == held - 8
        assert len(store.lease("d", "w", f, count=5).leases) == 5
    finally:
        store.close()


def doing(db: Path) -> int:
    """DOING shard rows in the file (not through the store: its reads requeue what expired)."""
    with contextlib.closing(sqlite3.connect(db)) as c:
        return c.execute("SELECT COUNT(*) FROM shards WHERE state='DOING'").fetchone()[0]


def test_expired_leases_are_requeued_a_bounded_number_a_call(tmp_path):
    # (fails before: every expired lease of a data set was requeued by the next call, in one
    # transaction: 262,144 held and let expire held every other job's calls for seconds)
    from stragglers.adapt.requeues import EXPIRE_CHUNK

    now, db = [1000.0], tmp_path / "s.db"
    store = ShardStore(db, clock=lambda: now[0])
    try:
        n = EXPIRE_CHUNK + EXPIRE_CHUNK // 2
        store.create_dataset(DatasetConfig("d", n, 1, num_epochs=1, lease_s=10))
        for w in range(-(-n // 256)):
            f = store.join("d", f"w{w}").fence
            store.lease("d", f"w{w}", f, count=256)
        assert doing(db) == n
        now[0] += 20
        store.expire("d")
        assert doing(db) == n - EXPIRE_CHUNK
        store.expire("d")   # the next call takes the rest
        assert doing(db) == 0
        counts = store.status("d")
        assert counts.epochs["0"]["TODO"] == n and counts.failed_total == 0
    finally:
        store.close()


@pytest.mark.slow
def test_retry_failed_requeues_in_steps_and_all(tmp_path):
    # (fails before: every FAILED shard was requeued in one call on the commit thread)
    from stragglers.adapt.requeues import RETRY_CHUNK

    now, db = [1000.0], tmp_path / "s.db"
    n = RETRY_CHUNK + 10
    store = ShardStore(db, clock=lambda: now[0])
    try:   # n FAILED shards (no retries, their leases expired)
        store.create_dataset(DatasetConfig("d", n, 1, num_epochs=1, lease_s=10, max_retries=0),
                             token_digest(OWNER))
        for w in range(-(-n // 256)):
            f = store.join("d", f"w{w}", token_digest(OWNER)).fence
            store.lease("d", f"w{w}", f, count=256, token_sha256=token_digest(OWNER))
        now[0] += 20
        while store.status("d").epochs["0"]["DOING"]:
            pass
        assert store.status("d").failed_total == n
    finally:
        store.close()
    srv = EmbeddedServer(db).start()
    try:
        calls = srv.app.state.commit.calls
        r = httpx.post(f"{srv.url}/datasets/d/retry-failed", json={}, timeout=120,
                       headers={"Authorization": f"Bearer {OWNER}"})
        assert r.status_code == 200, r.text
        assert sorted(map(tuple, r.json()["requeued"])) == [(0, s) for s in range(n)]
        assert srv.app.state.commit.calls - calls >= 2   # (steps: other calls between them)
        status = ShardClient(srv.url, "d", "w0", token=OWNER).status()
        assert status.epochs["0"]["TODO"] == n and status.failed_total == 0
    finally:
        srv.stop()


def test_a_reserve_left_by_a_killed_restore_is_removed_at_the_next_start(tmp_path):
    # (a service killed -9 while it restored left its reserve: space held until removed)
    db = tmp_path / "s.db"
    left = tmp_path / f"{Reserve.prefix(str(db))}4242-7f00"
    left.write_bytes(b"\0" * 4096)
    # another database's: not this one's to remove
    other = tmp_path / f"{Reserve.prefix(str(tmp_path / 't.db'))}4242-7f00"
    other.write_bytes(b"")
    srv = EmbeddedServer(db).start()
    try:
        assert not left.exists() and other.exists()
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_service_stopped_on_a_full_disk_loses_nothing_acknowledged(small_disk):
    # the log cannot be folded into the file then (the file cannot grow): it stays, and the
    # next start reads every acknowledged call from it
    db = small_disk / "s.db"
    srv = EmbeddedServer(db).start()
    try:
        owner = ShardClient(srv.url, "d", "w", token=OWNER)
        owner.create_dataset(DatasetConfig("d", 1000, 10))
        owner.join()
        acked = []
        for _ in range(5):
            x = owner.lease(count=4).leases
            for lease in x:
                owner.ack(lease.epoch, lease.shard, lease.size)
            acked += [lease.shard for lease in x]
        fill(small_disk)
    finally:
        srv.stop()
    (small_disk / "filler").unlink()
    srv = EmbeddedServer(db).start()
    try:
        assert ShardClient(srv.url, "d", "w", token=OWNER).status().epochs["0"]["DONE"] == \
            len(acked)
    finally:
        srv.stop()


def test_a_restarts_grace_writes_no_held_lease(tmp_path):
    # (fails before: the first call on a data set after a restart, or after a pause of the
    # service, wrote every held lease's deadline in one UPDATE: up to 1,024 workers x 1,024
    # rows, every other job's calls waiting for it)
    now, db = [1000.0], tmp_path / "s.db"
    store = ShardStore(db, clock=lambda: now[0])
    store.create_dataset(DatasetConfig("d", 4096, 2, num_epochs=1, lease_s=10))
    held = {}
    for w in range(4):
        f = store.join("d", f"w{w}").fence
        held[f"w{w}"] = (f, store.lease("d", f"w{w}", f, count=256).leases)
    store.close()
    now[0] += 3600   # an outage of an hour
    store = ShardStore(db, clock=lambda: now[0])
    try:
        before = store._conn.total_changes
        store.expire("d")                # the first call: grace, nothing of it written
        assert store._conn.total_changes - before < 16
        f = store.join("d", "v").fence
        assert doing(db) == 1024
        now[0] += 5                      # within the grace every lease is honoured
        w0, (f0, leases) = "w0", held["w0"]
        assert store.ack("d", w0, f0, 0, leases[0].shard, 1).state == "DOING"
        assert len(store.lease("d", "v", f, count=256).leases) == 256
        assert doing(db) == 1024 + 256
        now[0] += 6                      # past it, what was not renewed expires
        from stragglers.adapt.requeues import EXPIRE_CHUNK
        for _ in range(-(-1023 // EXPIRE_CHUNK)):   # (EXPIRE_CHUNK a call)
            store.expire("d")
        assert doing(db) == 1 + 256      # the lease acked in the grace, and v's
    finally:
        store.close()


def test_a_restore_beside_a_database_of_a_long_name_is_served(tmp_path):
    # (fails before: the reserve was named `<db>-reserve-<pid>-<id>`, past NAME_MAX for a
    # database name of 230 characters (its -wal still fits): every restore answered 500)
    db = tmp_path / ("s" * 227 + ".db")
    store = ShardStore(db)
    try:
        store.create_dataset(DatasetConfig("d", 100, 10))
        before = store.snapshot("d")
        assert store.restore(before).restored == 10
        assert store.snapshot("d") == before
    finally:
        store.close()
