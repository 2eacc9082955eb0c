"""The durable shard state machine, driven directly (SQLite on disk, a controllable clock)."""

from __future__ import annotations

import collections
import hashlib
import sqlite3

import pytest

from adapt_clock import Clock
from stragglers.adapt.dataset import DatasetConfig, epoch_permutation
from stragglers.adapt.replies import Acked, Created, FailedShard, Lease, Restored
from stragglers.adapt.shards import (DONE, FAILED, Conflict, Fenced, Forbidden, LeaseLost,
                                     NotFound, ShardStore)
from stragglers.errors import InputError


@pytest.fixture
def store(tmp_path):
    clock = Clock()
    s = ShardStore(tmp_path / "shards.db", clock=clock)
    s.clock = clock
    yield s
    s.close()


def one(store, name, worker, fence, **kw):
    reply = store.lease(name, worker, fence, **kw)
    assert reply.status == "ok", reply
    return reply.leases[0]


def drain(store, name, worker="w", counter=None):
    counter = counter if counter is not None else collections.Counter()
    fence = store.join(name, worker).fence
    while True:
        r = store.lease(name, worker, fence)
        if r.status != "ok":
            return r, counter
        lease = r.leases[0]
        counter.update((lease.epoch, i) for i in lease.indices)
        store.ack(name, worker, fence, lease.epoch, lease.shard, lease.size)


def dump(path):
    with sqlite3.connect(path) as c:
        return {t: c.execute(f"SELECT * FROM {t} ORDER BY 1, 2, 3").fetchall()
                for t in ("datasets", "shards", "workers")}


def test_every_sample_once_per_epoch_with_deterministic_shuffles(store, tmp_path):
    store.create_dataset(DatasetConfig("d", 103, 10, seed=7, num_epochs=3))
    reply, counter = drain(store, "d")
    assert reply.status == "finished"
    for epoch in range(3):
        assert sorted(i for (e, i), n in counter.items() if e == epoch and n == 1) == list(range(103))
    assert set(counter.values()) == {1}
    assert (epoch_permutation(103, 7, 1) == epoch_permutation(103, 7, 1)).all()
    assert (epoch_permutation(103, 7, 1) != epoch_permutation(103, 7, 2)).any()
    other = ShardStore(tmp_path / "again.db")
    other.create_dataset(DatasetConfig("d", 103, 10, seed=7, num_epochs=3))
    first = one(other, "d", "x", other.join("d", "x").fence)
    assert first.indices == epoch_permutation(103, 7, 0)[:10].tolist()


def test_partial_ack_then_requeue_resumes_at_the_offset_at_the_front(store):
    store.create_dataset(DatasetConfig("d", 40, 10, lease_s=5))
    fa = store.join("d", "a").fence
    a = one(store, "d", "a", fa)
    store.ack("d", "a", fa, 0, a.shard, 4)
    store.release("d", "a", fa)
    again = one(store, "d", "b", store.join("d", "b").fence)
    assert (again.shard, again.offset) == (a.shard, 4)
    assert again.indices == a.indices[4:]


def test_expired_lease_goes_back_and_the_late_ack_is_refused(store):
    store.create_dataset(DatasetConfig("d", 20, 10, lease_s=5))
    fs, ff = store.join("d", "slow").fence, store.join("d", "fast").fence
    a = one(store, "d", "slow", fs)
    store.clock.now += 6
    b = one(store, "d", "fast", ff)
    assert b.shard == a.shard  # the expired shard is first in line
    with pytest.raises(LeaseLost):
        store.ack("d", "slow", fs, 0, a.shard, 10)
    assert store.status("d").epochs["0"]["DOING"] == 1


def test_acks_renew_the_lease(store):
    store.create_dataset(DatasetConfig("d", 20, 10, lease_s=5))
    f = store.join("d", "w").fence
    a = one(store, "d", "w", f)
    for k in range(1, 5):
        store.clock.now += 4
        store.ack("d", "w", f, 0, a.shard, k)
    assert one(store, "d", "other", store.join("d", "other").fence).shard != a.shard


def test_bounded_retries_end_in_a_report_not_a_drop(store):
    store.create_dataset(DatasetConfig("d", 20, 10, lease_s=1, max_retries=2))
    poison = one(store, "d", "w0", store.join("d", "w0").fence).shard
    for attempt in range(1, 3):
        store.release("d", f"w{attempt - 1}", error="segfault")  # a launcher saw it die
        assert one(store, "d", f"w{attempt}", store.join("d", f"w{attempt}").fence).shard == poison
    store.release("d", "w2", error="segfault")
    status = store.status("d")
    assert status.epochs["0"][FAILED] == 1
    assert status.failed == [FailedShard(0, poison, 10, 3, "segfault")]
    reply, counter = drain(store, "d")
    assert reply.status == "finished" and reply.failed[0].shard == poison
    assert reply.failed_total == 1
    store.retry_failed("d")
    reply, counter = drain(store, "d", counter=counter)
    assert len(counter) == 20 and reply.failed == []


def test_snapshot_restore_puts_doing_shards_first_with_their_offsets(store):
    store.create_dataset(DatasetConfig("d", 50, 10, num_epochs=2))
    fa, fb, fc = (store.join("d", w).fence for w in "abc")
    done = one(store, "d", "a", fa)
    store.ack("d", "a", fa, 0, done.shard, 10)
    doing = one(store, "d", "b", fb)
    store.ack("d", "b", fb, 0, doing.shard, 3)
    snap = store.snapshot("d")
    # Progress after the snapshot is forgotten on restore (the model is rolled back too).
    later = one(store, "d", "c", fc)
    store.ack("d", "c", fc, 0, later.shard, 10)
    store.restore(snap)
    fx = store.join("d", "x").fence
    first, second = one(store, "d", "x", fx), one(store, "d", "x", fx)
    assert (first.shard, first.offset) == (doing.shard, 3)
    assert second.shard == later.shard and second.offset == 0
    assert store.status("d").epochs["0"][DONE] == 1


def test_a_retried_lease_request_returns_the_same_shards(store):
    store.create_dataset(DatasetConfig("d", 100, 10))
    f = store.join("d", "w").fence
    first = store.lease("d", "w", f, count=3, request_id="r1").leases
    again = store.lease("d", "w", f, count=3, request_id="r1").leases
    assert [x.shard for x in again] == [x.shard for x in first]
    assert again == first
    new = store.lease("d", "w", f, count=1, request_id="r2").leases
    assert new[0].shard not in {x.shard for x in first}
    assert store.status("d").epochs["0"]["DOING"] == 4


def test_a_retry_after_the_lease_was_lost_leases_nothing_new(store):
    # The lost shard comes back with no indices and held: false; no other shard is leased
    # (it would be an orphan nobody trains, later FAILED with a retry burned for nothing).
    store.create_dataset(DatasetConfig("d", 100, 10, lease_s=5))
    f = store.join("d", "w").fence
    first = store.lease("d", "w", f, request_id="r1").leases[0]
    store.clock.now += 6
    store.lease("d", "w2", store.join("d", "w2").fence)  # expires it, re-leases it to w2
    again = store.lease("d", "w", f, request_id="r1")
    assert again.status == "ok" and again.leases == [
        Lease(0, first.shard, 0, [], 10, held=False)]
    assert store.status("d").epochs["0"]["DOING"] == 1


def test_an_older_request_id_or_one_whose_shard_was_acked_leases_nothing_new(store):
    store.create_dataset(DatasetConfig("d", 100, 10, max_retries=0))
    f = store.join("d", "w").fence
    replies = [store.lease("d", "w", f, request_id=f"r{i}") for i in range(5)]
    shards = [r.leases[0].shard for r in replies]
    store.ack("d", "w", f, 0, shards[0], 10)
    store.ack("d", "w", f, 0, shards[1], 4)
    # r0: acked (DONE) -> offset 10, nothing left; r1: held, from its acked offset; r2: as before
    r0 = store.lease("d", "w", f, request_id="r0").leases
    r1 = store.lease("d", "w", f, request_id="r1").leases
    r2 = store.lease("d", "w", f, request_id="r2")
    assert r0 == [Lease(0, shards[0], 10, [], 10, held=False)]
    assert r1[0].offset == 4 and r1[0].indices == replies[1].leases[0].indices[4:]
    assert r2 == replies[2]
    status = store.status("d")
    assert status.epochs["0"]["DOING"] == 4 and status.epochs["0"]["DONE"] == 1
    assert status.failed == []
    # the history is bounded per incarnation: a new one (join) starts without it
    g = store.join("d", "w").fence
    fresh = store.lease("d", "w", g, request_id="r0").leases
    assert fresh[0].indices


def test_a_new_incarnation_fences_off_its_predecessor(store):
    store.create_dataset(DatasetConfig("d", 40, 10))
    old = store.join("d", "A").fence
    held = one(store, "d", "A", old)
    new = store.join("d", "A")
    assert new.released == [(0, held.shard)] and new.fence == old + 1
    again = one(store, "d", "A", new.fence)
    assert again.shard == held.shard  # same worker name, same shard, new fence
    with pytest.raises(Fenced):
        store.ack("d", "A", old, 0, held.shard, 10)
    with pytest.raises(Fenced):
        store.lease("d", "A", old)
    with pytest.raises(Fenced):
        store.lease("d", "never-joined", 1)
    assert store.ack("d", "A", new.fence, 0, held.shard, 10).state == DONE


def test_ack_after_done_is_idempotent(store):
    store.create_dataset(DatasetConfig("d", 20, 10))
    f = store.join("d", "w").fence
    a = one(store, "d", "w", f)
    assert store.ack("d", "w", f, 0, a.shard, 10) == Acked(DONE, 10)
    assert store.ack("d", "w", f, 0, a.shard, 10) == Acked(DONE, 10)
    assert store.ack("d", "w", f, 0, a.shard, 4) == Acked(DONE, 10)
    g = store.join("d", "other").fence
    with pytest.raises(LeaseLost):
        store.ack("d", "other", g, 0, a.shard, 10)


def test_a_failing_lease_commits_nothing(store, tmp_path):
    store.create_dataset(DatasetConfig("d", 20, 10))
    f = store.join("d", "w").fence
    before = dump(tmp_path / "shards.db")

    def broken(*args):
        raise RuntimeError("injected failure while computing the indices")

    store._indices = broken
    with pytest.raises(RuntimeError):
        store.lease("d", "w", f, request_id="r")
    assert dump(tmp_path / "shards.db") == before
    # The same inside a group commit: the failing call is rolled back alone.
    results = store.run_batch([lambda: store.lease("d", "w", f), lambda: store.status("d")])
    assert results[0][0] is False and results[1][0] is True
    assert dump(tmp_path / "shards.db") == before


def test_leases_held_while_no_service_ran_get_a_grace_period(tmp_path):
    clock = Clock()
    s = ShardStore(tmp_path / "x.db", clock=clock)
    s.create_dataset(DatasetConfig("d", 40, 10, lease_s=5))
    f = s.join("d", "w").fence
    a = one(s, "d", "w", f)
    s.close()
    clock.now += 60  # an outage 12x the lease
    s2 = ShardStore(tmp_path / "x.db", clock=clock)
    b = one(s2, "d", "v", s2.join("d", "v").fence)
    assert b.shard != a.shard  # not expired: its holder could not renew meanwhile
    assert s2.ack("d", "w", f, 0, a.shard, 10).state == DONE
    clock.now += 6  # but a lease not renewed after the restart expires as usual
    assert s2.status("d").epochs["0"]["DOING"] == 0


def test_config_errors_name_the_field_and_recreate_must_match(store):
    with pytest.raises(InputError, match="shard_size"):
        store.create_dataset(DatasetConfig("d", 10, 0))
    with pytest.raises(InputError, match="shard_size"):
        store.create_dataset(DatasetConfig("d", 1_000_000, 1))  # 10^6 shards per epoch
    with pytest.raises(InputError, match="lease_s"):
        store.create_dataset(DatasetConfig("d", 10, 5, lease_s=float("nan")))
    with pytest.raises(InputError, match="num_samples"):
        store.create_dataset(DatasetConfig("d", "10", 5))
    store.create_dataset(DatasetConfig("d", 10, 5))
    assert store.create_dataset(DatasetConfig("d", 10, 5)) == Created(False)
    with pytest.raises(Conflict, match="lease_s"):
        store.create_dataset(DatasetConfig("d", 10, 5, lease_s=0.05))
    with pytest.raises(NotFound):
        store.lease("nope", "w", 1)
    f = store.join("d", "w").fence
    a = one(store, "d", "w", f)
    with pytest.raises(InputError, match="consumed"):
        store.ack("d", "w", f, 0, a.shard, 99)


def test_a_data_set_belongs_to_the_token_that_created_it(store):
    owner, intruder = hashlib.sha256(b"a" * 32).hexdigest(), hashlib.sha256(b"b" * 32).hexdigest()
    store.create_dataset(DatasetConfig("d", 10, 5), owner)
    with pytest.raises(Forbidden):
        store.create_dataset(DatasetConfig("d", 10, 5), intruder)
    with pytest.raises(Forbidden):
        store.release("d", "w", token_sha256=intruder)
    with pytest.raises(Forbidden):
        store.restore(store.snapshot("d"), intruder)
    f = store.join("d", "w", owner).fence
    assert store.lease("d", "w", f, token_sha256=owner).status == "ok"


@pytest.mark.parametrize("mutate, field", [
    (lambda s: s["shards"].pop(), "shards"),
    (lambda s: s["shards"].__setitem__(1, list(s["shards"][0])), "shards[1]"),
    (lambda s: s["shards"][0].__setitem__(2, "BOGUS"), "shards[0].state"),
    (lambda s: s["shards"][0].__setitem__(3, 11), "shards[0].consumed"),
    (lambda s: s["shards"][0].__setitem__(3, -1), "shards[0].consumed"),
    (lambda s: s["shards"][0].__setitem__(2, "DONE"), "shards[0].consumed"),
    (lambda s: s["shards"][0].__setitem__(3, True), "shards[0].consumed"),
    (lambda s: s["shards"][0].__setitem__(6, "x" * 5000), "shards[0].error"),
    (lambda s: s.__setitem__("epochs_created", 5), "epochs_created"),
    (lambda s: s["dataset"].__setitem__("lease_s", 0.001), "lease_s"),
    (lambda s: s.pop("shards"), None),
])
def test_an_inconsistent_snapshot_is_refused_and_changes_nothing(store, tmp_path, mutate, field):
    store.create_dataset(DatasetConfig("d", 40, 10, num_epochs=2))
    f = store.join("d", "w").fence
    a = one(store, "d", "w", f)
    store.ack("d", "w", f, 0, a.shard, 3)
    snap = store.snapshot("d")
    before = dump(tmp_path / "shards.db")
    mutate(snap)
    with pytest.raises(InputError) as err:
        store.restore(snap)
    assert err.value.field == field
    assert dump(tmp_path / "shards.db") == before


def test_state_survives_reopening_the_file(tmp_path):
    s = ShardStore(tmp_path / "x.db")
    s.create_dataset(DatasetConfig("d", 30, 10))
    f = s.join("d", "w").fence
    a = one(s, "d", "w", f)
    s.ack("d", "w", f, 0, a.shard, 10)
    s.close()
    assert ShardStore(tmp_path / "x.db").status("d").epochs["0"][DONE] == 1


def test_not_a_database_is_an_input_error(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_text("hello, this is not sqlite" * 100)
    with pytest.raises(InputError, match="SQLite"):
        ShardStore(bad)


def test_an_interrupted_batch_leaves_the_store_usable(store, tmp_path):
    store.create_dataset(DatasetConfig("d", 20, 10))
    before = dump(tmp_path / "shards.db")

    def interrupted():
        store.join("d", "w")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.run_batch([interrupted])
    assert dump(tmp_path / "shards.db") == before
    assert store.join("d", "w").fence == 1  # the connection is out of the aborted transaction


def test_expiry_and_failed_report_see_writes_of_another_connection(tmp_path):
    # The store keeps a lower bound of the earliest lease deadline and the FAILED report in
    # memory; a write by another process (here a second connection whose clock runs behind)
    # must not hide an expired lease or a FAILED shard from the first one.
    a_clock, b_clock = Clock(), Clock()
    a = ShardStore(tmp_path / "s.db", clock=a_clock)
    a.create_dataset(DatasetConfig("d", 40, 10, lease_s=10.0, max_retries=0))
    fa = a.join("d", "wa").fence
    mine = one(a, "d", "wa", fa)  # bound: a's deadline 1010
    b_clock.now = 900.0
    b = ShardStore(tmp_path / "s.db", clock=b_clock)
    fb = b.join("d", "wb").fence
    # deadline 910, under a's bound (b's first call grants a's lease its restart grace in b's
    # memory only: a's deadline stays 1010)
    lost = one(b, "d", "wb", fb)
    assert mine.shard != lost.shard
    a_clock.now = 950.0  # b's lease has expired; a's bound (1010) would hide it
    reply = a.lease("d", "wa", fa)
    assert [[f.epoch, f.shard] for f in reply.failed] == [[lost.epoch, lost.shard]]
    assert reply.failed_total == 1
    # The FAILED shard is requeued by b; a's next lease reply no longer lists it.
    assert b.retry_failed("d").requeued == [(lost.epoch, lost.shard)]
    assert a.lease("d", "wa", fa).failed_total == 0
    a.close()
    b.close()


def test_rolled_back_call_in_a_batch_leaves_no_stale_state(store):
    store.create_dataset(DatasetConfig("d", 30, 10, lease_s=10.0, max_retries=0))
    fence = store.join("d", "w").fence
    first = one(store, "d", "w", fence)
    store.clock.now += 11.0  # the lease has expired

    def expire_then_fail():  # one store call that expires the lease, then fails
        with store._tx() as c:
            cfg, _, front = store._config(c, "d")
            store._expire(c, cfg, front, store.clock.now)
            raise RuntimeError("boom")

    results = store.run_batch([expire_then_fail, lambda: store.lease("d", "w", fence)])
    assert not results[0][0] and results[1][0]
    # The failing call was rolled back, the lease call after it expired the shard itself.
    assert results[1][1].failed == [FailedShard(0, first.shard, 10, 1, "lease of w expired")]
    assert store.status("d").epochs["0"]["FAILED"] == 1


def test_a_big_epoch_is_written_in_chunks_as_its_queue_reaches_them(store, tmp_path):
    # Creating 65,536 shard rows in one transaction held the commit thread (every other job)
    # for seconds: an epoch's rows are written EPOCH_CHUNK at a time. Status, snapshot,
    # restore and the order of the queue are those of a fully written epoch.
    from stragglers.adapt.shards import EPOCH_CHUNK

    store.max_held_per_worker = 1 << 20   # (one worker holds the whole epoch here)

    def rows():
        with sqlite3.connect(tmp_path / "shards.db") as c:
            return c.execute("SELECT COUNT(*) FROM shards").fetchone()[0]

    store.create_dataset(DatasetConfig("big", 1 << 26, 1024))
    assert rows() == EPOCH_CHUNK
    assert store.status("big").epochs["0"]["TODO"] == 65_536
    n = 3 * EPOCH_CHUNK + 5
    store.create_dataset(DatasetConfig("d", n, 1, num_epochs=2))
    assert len(store.snapshot("d")["shards"]) == n
    f = store.join("d", "w").fence
    first = store.lease("d", "w", f, count=256).leases
    store.ack("d", "w", f, 0, first[0].shard, 1)
    with pytest.raises(LeaseLost):   # a shard not written yet is TODO: not held
        store.ack("d", "w", f, 0, n - 1, 1)
    snap = store.snapshot("d")
    seen = collections.Counter(x.indices[0] for x in first)
    order = [x.shard for x in first]
    while True:
        reply = store.lease("d", "w", f, count=256)
        if reply.status != "ok":
            break
        for x in reply.leases:
            order.append(x.shard)
            seen.update(x.indices)
        if len(order) >= n:
            break
    assert order[:n] == list(range(n)) and sorted(seen) == list(range(n))
    assert store.status("d").epochs["0"]["TODO"] == 0
    # a snapshot taken while only part of the epoch was written restores in full
    assert store.restore(snap) == Restored(n, 255)
    again = store.snapshot("d")["shards"]
    assert [r[:4] for r in again[1:]] == [[0, s, "TODO", 0] for s in range(1, n)]
    assert sorted(r[5] for r in again[1:256]) == [r[5] for r in again[1:256]] < [again[256][5]]


@pytest.mark.parametrize("version", [2, 3])
def test_an_older_schema_file_is_upgraded_in_place(tmp_path, version):
    from stragglers.adapt.schema import SCHEMA_VERSION

    db = tmp_path / "old.db"
    s = ShardStore(db)
    s.create_dataset(DatasetConfig("d", 100, 10))
    f = s.join("d", "w").fence
    held = s.lease("d", "w", f, request_id="r1").leases[0]
    s.close()
    with sqlite3.connect(db) as c:   # back to the schema-3 layout (no rows keys, no creator)
        c.executescript("DROP TABLE row_sets; DROP INDEX datasets_creator;"
                        " ALTER TABLE datasets DROP COLUMN rows_key;"
                        " ALTER TABLE datasets DROP COLUMN creator; PRAGMA user_version=3;")
        if version == 2:
            c.executescript("DROP TABLE lease_requests; ALTER TABLE workers DROP COLUMN seq;"
                            " UPDATE datasets SET materialized=NULL;"
                            " ALTER TABLE datasets DROP COLUMN materialized;"
                            " PRAGMA user_version=2;")
    s = ShardStore(db)
    try:
        assert s.status("d").epochs["0"]["DOING"] == 1
        assert s.ack("d", "w", f, 0, held.shard, 10).state == DONE
        assert s.lease("d", "w", f, request_id="r2").status == "ok"
        assert s.restore(s.snapshot("d")).restored == 10   # the new columns are used
    finally:
        s.close()
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


def test_a_lease_reply_holds_a_bounded_number_of_indices(store):
    from stragglers.adapt.shards import MAX_INDICES_PER_REPLY

    store.create_dataset(DatasetConfig("d", 1 << 22, 65_536))
    f = store.join("d", "w").fence
    leases = store.lease("d", "w", f, count=256).leases
    assert len(leases) == MAX_INDICES_PER_REPLY // 65_536
    assert sum(len(x.indices) for x in leases) <= MAX_INDICES_PER_REPLY


def test_an_upgrade_that_fails_half_way_changes_nothing_and_runs_again(tmp_path):
    """A schema-3 file whose upgrade fails after its first steps (here a view in the way of
    the fence floors; a kill -9 or a full disk alike) is left as it was: once the obstacle
    is gone it is upgraded and served, its acked progress kept (the steps were committed one
    by one: every later start failed on 'duplicate column name: rows_key')."""
    from stragglers.errors import InputError

    db = tmp_path / "old.db"
    s = ShardStore(db)
    s.create_dataset(DatasetConfig("d", 100, 10))
    f = s.join("d", "w").fence
    held = s.lease("d", "w", f).leases[0]
    s.ack("d", "w", f, 0, held.shard, 4)
    s.close()
    with sqlite3.connect(db) as c:   # schema 3, and an object named like a table of schema 5
        c.executescript("DROP TABLE row_sets; DROP INDEX datasets_creator; DROP TABLE"
                        " fence_floors; ALTER TABLE datasets DROP COLUMN rows_key;"
                        " ALTER TABLE datasets DROP COLUMN creator; PRAGMA user_version=3;"
                        " CREATE VIEW fence_floors AS SELECT 'x' AS dataset, 1 AS floor;")
    with pytest.raises(InputError, match="fence_floors"):
        ShardStore(db)
    with sqlite3.connect(db) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == 3
        c.execute("DROP VIEW fence_floors")
    s = ShardStore(db)
    try:
        assert s.ack("d", "w", f, 0, held.shard, 10).state == DONE   # (from its offset 4)
    finally:
        s.close()
