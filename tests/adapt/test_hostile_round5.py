"""Hostile cases of a fifth round: stored rows edited behind the service's back, lax numbers in
paths, chunked bodies, and HTTP shapes against a real service on loopback."""

from __future__ import annotations

import sqlite3

import pytest

from adapt_clock import Clock
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.shards import ShardStore


@pytest.mark.parametrize("deadline", ["1e300", "9e999", "NULL", "'soon'", "x'00'", "1e6"])
def test_a_lease_ending_past_a_full_lease_from_now_is_cut_to_one(tmp_path, deadline):
    # (fails before: a DOING row whose lease_until lay past now + lease_s — an edited or
    # damaged row, or a wall clock stepped back (1e6 with the clock at 1,000) — was never
    # expired: NULL, text and blobs never compare below a time, and its shard was never leased
    # again)
    clock = Clock()
    store = ShardStore(tmp_path / "s.db", clock=clock)
    try:
        store.create_dataset(DatasetConfig("d", 20, 10, lease_s=5))
        held = store.lease("d", "w", store.join("d", "w").fence).leases[0]
        with sqlite3.connect(tmp_path / "s.db") as other:   # another process edits the row
            other.execute(f"UPDATE shards SET lease_until={deadline} WHERE state='DOING'")
        fence = store.join("d", "v").fence
        first = store.lease("d", "v", fence).leases[0]
        assert first.shard != held.shard   # a full lease from now: the holder may still work
        clock.now += 6
        store.ack("d", "v", fence, first.epoch, first.shard, 10)
        again = store.lease("d", "v", fence)
        assert [(x.epoch, x.shard) for x in again.leases] == [(held.epoch, held.shard)]
        assert [(f.epoch, f.shard) for f in again.failed] == []   # one retry used, not failed
        assert store.status("d").epochs["0"]["DOING"] == 1
    finally:
        store.close()


def test_a_damaged_deadline_is_cut_after_a_restart_too(tmp_path):
    # (fails before: the restart grace kept MAX(lease_until, now + lease_s), a far-future one)
    clock = Clock()
    store = ShardStore(tmp_path / "s.db", clock=clock)
    store.create_dataset(DatasetConfig("d", 20, 10, lease_s=5))
    held = store.lease("d", "w", store.join("d", "w").fence).leases[0]
    store.close()
    with sqlite3.connect(tmp_path / "s.db") as other:
        other.execute("UPDATE shards SET lease_until=1e300 WHERE state='DOING'")
    store = ShardStore(tmp_path / "s.db", clock=clock)
    try:
        fence = store.join("d", "v").fence
        first = store.lease("d", "v", fence).leases[0]
        clock.now += 6
        store.ack("d", "v", fence, first.epoch, first.shard, 10)
        again = store.lease("d", "v", fence)
        assert [(x.epoch, x.shard) for x in again.leases] == [(held.epoch, held.shard)]
    finally:
        store.close()


@pytest.mark.slow
def test_a_data_set_without_an_end_finishes_at_the_last_epoch_its_checks_take(tmp_path):
    # (fails before: a data set of num_epochs=None created epoch MAX_EPOCHS, and every later
    # call on it was refused: its stored row (epochs_created > MAX_EPOCHS) read as damaged)
    from stragglers.adapt.dataset import MAX_EPOCHS
    store = ShardStore(tmp_path / "s.db")
    try:
        store.create_dataset(DatasetConfig("inf", 1, 1, num_epochs=None))
        fence = store.join("inf", "w").fence
        first = store.lease("inf", "w", fence).leases[0]
        store.ack("inf", "w", fence, first.epoch, first.shard, 1)
        with sqlite3.connect(tmp_path / "s.db") as other:   # epochs 1 .. MAX_EPOCHS - 1, done
            other.execute("WITH RECURSIVE e(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM e WHERE"
                          " x < ?) INSERT INTO shards SELECT 'inf', x, 0, 0, 1, 'DONE', 'w', 1,"
                          " NULL, 1, 0, 2 * x + 1, NULL FROM e", (MAX_EPOCHS - 1,))
            other.execute("UPDATE datasets SET epochs_created=?, materialized=1",
                          (MAX_EPOCHS,))
        assert store.lease("inf", "w", fence).status == "finished"
        assert store.status("inf").epochs_created == MAX_EPOCHS
    finally:
        store.close()


def test_a_wall_clock_stepped_forward_expires_no_lease(tmp_path):
    # (fails before: lease deadlines are wall-clock times and only a gap in the monotonic
    # heartbeat granted a grace period: a clock stepped an hour ahead expired every lease at
    # the next call, a retry of each used up with no worker failing)
    import asyncio

    from stragglers.adapt.service import GroupCommitter
    clock = Clock()
    store = ShardStore(tmp_path / "s.db", clock=clock)
    commit = GroupCommitter(store, stall_s=2.0)
    try:
        store.create_dataset(DatasetConfig("d", 20, 10, lease_s=5))
        held = store.lease("d", "w", store.join("d", "w").fence).leases[0]
        fence = store.join("d", "v").fence
        clock.now += 3600

        async def lease():   # through the writer, as the service calls it
            return await commit.run(lambda: store.lease("d", "v", fence))
        reply = asyncio.run(lease())
        assert [x.shard for x in reply.leases] != [held.shard]
        assert reply.failed == [] and store.status("d").epochs["0"]["DOING"] == 2
    finally:
        commit.close()
        store.close()


UNGUARDED = """
import os, sys
from pathlib import Path
from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.service import EmbeddedServer
runs = Path(sys.argv[1])
runs.write_text(runs.read_text() + "run\\n" if runs.exists() else "run\\n")
srv = EmbeddedServer(Path(sys.argv[2])).start()
c = ShardClient(srv.url, "d", "w", token="owner-token-0123456789", retry_s=0)
c.create_dataset(DatasetConfig("d", 40, 10))
try:
    print("restored", c.restore(c.snapshot()))
except Exception as exc:
    print("refused", type(exc).__name__, exc)
srv.stop()
"""


@pytest.mark.slow
def test_a_restore_in_an_embedding_script_without_a_main_guard(tmp_path):
    # (fails before: the restore's child process was multiprocessing's spawn, which runs the
    # parent's __main__ again: the user's training script, unguarded, ran a second time — its
    # own server, its own calls — and every restore was refused 503)
    import subprocess
    import sys
    script, runs = tmp_path / "train.py", tmp_path / "runs.txt"
    script.write_text(UNGUARDED)
    done = subprocess.run([sys.executable, str(script), str(runs), str(tmp_path / "s.db")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert "restored" in done.stdout, done.stdout + done.stderr[-2000:]
    assert runs.read_text() == "run\n"   # the script's top level ran once


def _snapshot(store, name):
    import dataclasses
    import json
    snap = store.snapshot(name)
    return json.loads(json.dumps(snap if isinstance(snap, dict) else dataclasses.asdict(snap)))


@pytest.mark.parametrize("state", ["TODO", "DOING", "FAILED"])
def test_a_restore_of_a_shard_with_nothing_left_that_is_not_done_is_refused(tmp_path, state):
    # (fails before: restored as TODO with all samples consumed, it was leased with no
    # indices, never acked, and retried until FAILED: a retry used up per lease_s, for nothing)
    from stragglers.errors import InputError
    store = ShardStore(tmp_path / "s.db")
    try:
        store.create_dataset(DatasetConfig("d", 20, 10, max_retries=2))
        snap = _snapshot(store, "d")
        snap["shards"][0][2:5] = [state, 10, 3 if state == "FAILED" else 0]
        before = _snapshot(store, "d")
        with pytest.raises(InputError, match="consumed"):
            store.restore(snap)
        assert _snapshot(store, "d") == before
    finally:
        store.close()


@pytest.mark.parametrize("state", ["TODO", "DOING", "DONE"])
def test_a_restore_of_a_shard_past_its_retries_that_is_not_failed_is_refused(tmp_path, state):
    # (fails before: a TODO shard at max_retries + 1 became FAILED with max_retries + 2 at its
    # next failure, a row the store then refused as damaged: the data set quarantined)
    from stragglers.errors import InputError
    store = ShardStore(tmp_path / "s.db")
    try:
        store.create_dataset(DatasetConfig("d", 20, 10, max_retries=2))
        snap = _snapshot(store, "d")
        snap["shards"][0][2:5] = [state, 10 if state == "DONE" else 0, 3]
        with pytest.raises(InputError, match="retries"):
            store.restore(snap)
    finally:
        store.close()


def test_stored_rows_past_their_retries_or_with_nothing_left_do_not_stop_the_data_set(tmp_path):
    # (fails before: an edited TODO row at max_retries + 1 was stored FAILED at max_retries + 2
    # after its lease expired, and the data set was quarantined; a TODO row with all consumed
    # was leased with no indices)
    clock = Clock()
    store = ShardStore(tmp_path / "s.db", clock=clock)
    try:
        store.create_dataset(DatasetConfig("d", 30, 10, lease_s=5, max_retries=2))
        fence = store.join("d", "w").fence
        store.status("d")   # epoch 0 written
        with sqlite3.connect(tmp_path / "s.db") as other:
            other.execute("UPDATE shards SET retries=3 WHERE shard=0")
            other.execute("UPDATE shards SET consumed=10 WHERE shard=1")
        reply = store.lease("d", "w", fence, count=2)
        assert [x.shard for x in reply.leases] == [0, 2]   # shard 1 had nothing left: DONE
        clock.now += 6
        store.lease("d", "w", fence)   # shard 0's lease expired: FAILED, at the bound
        status = store.status("d")
        assert status.epochs["0"]["DONE"] == 1 and status.epochs["0"]["FAILED"] == 1
        assert [f.retries for f in status.failed] == [3]
    finally:
        store.close()


@pytest.mark.parametrize("pos", [-(1 << 62), 1 << 62])
def test_a_restore_leaves_its_queue_positions_room_for_the_requeues_ahead(tmp_path, pos):
    # (fails before: a shard at queue_pos -2**62 passed, the restore put its DOING shard one
    # lower, and the data set's stored front was out of range: quarantined by its own restore)
    from stragglers.errors import InputError
    store = ShardStore(tmp_path / "s.db")
    try:
        store.create_dataset(DatasetConfig("d", 20, 10))
        fence = store.join("d", "w").fence
        store.lease("d", "w", fence)
        snap = _snapshot(store, "d")
        snap["shards"][1][5] = pos
        with pytest.raises(InputError, match="queue_pos"):
            store.restore(snap)
        assert store.lease("d", "w", fence).status == "ok"
    finally:
        store.close()


def test_a_wall_clock_stepped_back_holds_no_lease_longer_than_a_full_one(tmp_path):
    # (fails before: the kept bound of the next expiry lay an hour ahead of the stepped-back
    # clock, no lease was scanned until the clock caught up: a dead worker's shard held an hour)
    import asyncio

    from stragglers.adapt.service import GroupCommitter
    clock = Clock()
    store = ShardStore(tmp_path / "s.db", clock=clock)
    # (stall_s 10: the fake clock's 6 s below, with no time passing, is no forward step)
    commit = GroupCommitter(store, stall_s=10.0)
    try:
        store.create_dataset(DatasetConfig("d", 20, 10, lease_s=5))
        held = store.lease("d", "w", store.join("d", "w").fence).leases[0]   # dies
        fence = store.join("d", "v").fence
        clock.now -= 3600

        async def lease():   # through the writer, as the service calls it
            return await commit.run(lambda: store.lease("d", "v", fence))
        first = asyncio.run(lease()).leases[0]
        store.ack("d", "v", fence, first.epoch, first.shard, 10)
        clock.now += 6
        again = asyncio.run(lease())
        assert [(x.epoch, x.shard) for x in again.leases] == [(held.epoch, held.shard)]
    finally:
        commit.close()
        store.close()
