"""A restore keeps the data set's lease request ids (issue 34, round 10): one replayed after it
answers its shards as they now stand, never new ones."""

from __future__ import annotations

import pytest

from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.errors import Conflict
from stragglers.adapt.shards import ShardStore


@pytest.fixture
def store(tmp_path):
    s = ShardStore(tmp_path / "s.db", durable=False)
    yield s
    s.close()


def test_an_id_replayed_after_a_restore_answers_its_old_shards_not_held(store):
    # (fails before: the restore dropped the history, so "r1" was a new request: shards 2, 3)
    store.create_dataset(DatasetConfig("d", 8, 2))
    f = store.join("d", "w").fence
    first = store.lease("d", "w", f, count=2, request_id="r1")
    assert [x.shard for x in first.leases] == [0, 1]
    store.ack("d", "w", f, 0, 0, 1)
    store.restore(store.snapshot("d"))   # (0 and 1 back to TODO, 0 from its offset 1)
    again = store.lease("d", "w", f, count=2, request_id="r1")
    assert [(x.shard, x.offset, x.indices, x.held) for x in again.leases] == \
        [(0, 0, [], False), (1, 0, [], False)]
    assert store.status("d").epochs["0"]["TODO"] == 4   # nothing leased by the replay
    # a new id leases the queue's head: the restored shards, 0 from its acked offset
    new = store.lease("d", "w", f, count=2, request_id="r2")
    assert [(x.shard, x.offset) for x in new.leases] == [(0, 1), (1, 0)]


def test_an_id_naming_an_epoch_the_snapshot_lacks_is_refused_after_a_restore(store):
    # (a reply naming epoch 1 of a snapshot of epoch 0 alone: kept as it was, the replay read
    # a shard row that does not exist and quarantined the data set, 503 on every call)
    store.create_dataset(DatasetConfig("d", 4, 2, num_epochs=3))
    f = store.join("d", "w").fence
    snap = store.snapshot("d")
    for shard in (0, 1):
        store.lease("d", "w", f, count=1, request_id=f"e0-{shard}")
        store.ack("d", "w", f, 0, shard, 2)
    ahead = store.lease("d", "w", f, count=1, request_id="e1")
    assert (ahead.leases[0].epoch, ahead.leases[0].shard) == (1, 0)
    store.restore(snap)
    with pytest.raises(Conflict, match="no longer kept"):
        store.lease("d", "w", f, count=1, request_id="e1")
    replay = store.lease("d", "w", f, count=1, request_id="e0-1")   # (epoch 0: kept)
    assert [(x.epoch, x.shard, x.held) for x in replay.leases] == [(0, 1, False)]
    assert store.status("d").epochs["0"]["TODO"] == 2   # nothing leased, nothing quarantined


def test_the_switch_reads_only_the_replies_of_requests_made_since_they_were_read(store):
    """The kept replies a restore drops are read before its switch (off the commit thread in
    the service: json_tree over a 1,024-worker history, ~12.5 MB, held the switch 0.32 s);
    the switch itself reads only the rows of workers that asked since (`a` leased again, `c`
    joined), and every reply naming an epoch past the snapshot is dropped, read before or
    after: b's (read before), a's second and c's (leased since); a's first (epoch 0) kept."""
    from stragglers.adapt.dataset import validate_snapshot
    from stragglers.adapt.restores import prepare_restore

    store.create_dataset(DatasetConfig("d", 4, 2, num_epochs=4))
    a, b = store.join("d", "a").fence, store.join("d", "b").fence
    snap = store.snapshot("d")   # (epoch 0 alone)
    for shard in (0, 1):
        store.lease("d", "a", a, request_id=f"a{shard}")
        store.ack("d", "a", a, 0, shard, 2)
    assert store.lease("d", "b", b, request_id="b1").leases[0].epoch == 1
    prepared = prepare_restore(validate_snapshot(snap))
    key = store.restore_begin(prepared)
    for i in range(len(prepared.chunks)):
        store.restore_rows(key, prepared.chunk(i))
    stale = store.stale_replies(prepared)
    assert [k[0] for k in stale.keys] == ["b"]
    assert store.lease("d", "a", a, request_id="a2").leases[0].epoch == 1   # (since)
    c = store.join("d", "c").fence
    assert store.lease("d", "c", c, request_id="c1").leases[0].epoch == 2
    read: list[str] = []
    store._conn.set_trace_callback(read.append)
    try:
        store.restore_finish(prepared, key, stale=stale)
    finally:
        store._conn.set_trace_callback(None)
    scanned = [s for s in read if "json_tree" in s]
    assert len(scanned) == 2 and all("worker='a'" in s.replace(" ", "") or
                                     "worker='c'" in s.replace(" ", "") for s in scanned), read
    for worker, fence, rid in (("b", b, "b1"), ("a", a, "a2"), ("c", c, "c1")):
        with pytest.raises(Conflict, match="no longer kept"):
            store.lease("d", worker, fence, request_id=rid)
    replay = store.lease("d", "a", a, request_id="a1")   # (epoch 0: kept)
    assert [(x.epoch, x.shard, x.held) for x in replay.leases] == [(0, 1, False)]
