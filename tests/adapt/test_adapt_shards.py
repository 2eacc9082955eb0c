"""The durable shard state machine, driven directly (SQLite on disk, a controllable clock)."""

from __future__ import annotations

import collections

import pytest

from stragglers.adapt.shards import (DONE, FAILED, DatasetConfig, LeaseLost, ShardStore,
                                     epoch_permutation)
from stragglers.errors import InputError


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture
def store(tmp_path):
    clock = Clock()
    s = ShardStore(tmp_path / "shards.db", clock=clock)
    s.clock = clock
    yield s
    s.close()


def drain(store, name, worker="w", counter=None):
    counter = counter if counter is not None else collections.Counter()
    while True:
        r = store.lease(name, worker)
        if r["status"] != "ok":
            return r, counter
        lease = r["lease"]
        counter.update((lease["epoch"], i) for i in lease["indices"])
        store.ack(name, worker, lease["epoch"], lease["shard"], lease["size"])


def test_every_sample_once_per_epoch_with_deterministic_shuffles(store, tmp_path):
    store.create_dataset(DatasetConfig("d", 103, 10, seed=7, num_epochs=3))
    reply, counter = drain(store, "d")
    assert reply["status"] == "finished"
    for epoch in range(3):
        assert sorted(i for (e, i), n in counter.items() if e == epoch and n == 1) == list(range(103))
    assert set(counter.values()) == {1}
    assert (epoch_permutation(103, 7, 1) == epoch_permutation(103, 7, 1)).all()
    assert (epoch_permutation(103, 7, 1) != epoch_permutation(103, 7, 2)).any()
    # The second epoch starts only once the first one's TODO is empty.
    other = ShardStore(tmp_path / "again.db")
    other.create_dataset(DatasetConfig("d", 103, 10, seed=7, num_epochs=3))
    first = other.lease("d", "x")["lease"]
    assert first["indices"] == epoch_permutation(103, 7, 0)[:10].tolist()


def test_partial_ack_then_requeue_resumes_at_the_offset_at_the_front(store):
    store.create_dataset(DatasetConfig("d", 40, 10, lease_s=5))
    a = store.lease("d", "a")["lease"]
    store.ack("d", "a", 0, a["shard"], 4)
    store.release("d", "a")
    again = store.lease("d", "b")["lease"]
    assert (again["shard"], again["offset"]) == (a["shard"], 4)
    assert again["indices"] == a["indices"][4:]


def test_expired_lease_goes_back_and_the_late_ack_is_refused(store):
    store.create_dataset(DatasetConfig("d", 20, 10, lease_s=5))
    a = store.lease("d", "slow")["lease"]
    store.clock.now += 6
    b = store.lease("d", "fast")["lease"]
    assert b["shard"] == a["shard"]  # the expired shard is first in line
    with pytest.raises(LeaseLost):
        store.ack("d", "slow", 0, a["shard"], 10)
    status = store.status("d")
    assert status["epochs"]["0"]["DOING"] == 1


def test_acks_renew_the_lease(store):
    store.create_dataset(DatasetConfig("d", 20, 10, lease_s=5))
    a = store.lease("d", "w")["lease"]
    for k in range(1, 5):
        store.clock.now += 4
        store.ack("d", "w", 0, a["shard"], k)
    assert store.lease("d", "other")["lease"]["shard"] != a["shard"]


def test_bounded_retries_end_in_a_report_not_a_drop(store):
    store.create_dataset(DatasetConfig("d", 20, 10, lease_s=1, max_retries=2))
    poison = store.lease("d", "w0")["lease"]["shard"]
    for attempt in range(1, 3):
        store.release("d", f"w{attempt - 1}", error="segfault")
        assert store.lease("d", f"w{attempt}")["lease"]["shard"] == poison
    store.release("d", "w2", error="segfault")
    status = store.status("d")
    assert status["epochs"]["0"][FAILED] == 1
    assert status["failed"] == [{"epoch": 0, "shard": poison, "samples": 10, "retries": 3,
                                 "error": "segfault"}]
    reply, counter = drain(store, "d")
    assert reply["status"] == "finished" and reply["failed"][0]["shard"] == poison
    store.retry_failed("d")
    reply, counter = drain(store, "d", counter=counter)
    assert len(counter) == 20 and reply["failed"] == []


def test_snapshot_restore_puts_doing_shards_first_with_their_offsets(store):
    store.create_dataset(DatasetConfig("d", 50, 10, num_epochs=2))
    done = store.lease("d", "a")["lease"]
    store.ack("d", "a", 0, done["shard"], 10)
    doing = store.lease("d", "b")["lease"]
    store.ack("d", "b", 0, doing["shard"], 3)
    snap = store.snapshot("d")
    # Progress after the snapshot is forgotten on restore (the model is rolled back too).
    later = store.lease("d", "c")["lease"]
    store.ack("d", "c", 0, later["shard"], 10)
    store.restore(snap)
    first = store.lease("d", "x")["lease"]
    assert (first["shard"], first["offset"]) == (doing["shard"], 3)
    second = store.lease("d", "y")["lease"]
    assert second["shard"] == later["shard"] and second["offset"] == 0
    st = store.status("d")["epochs"]["0"]
    assert st[DONE] == 1


def test_config_errors_name_the_field(store):
    with pytest.raises(InputError, match="shard_size"):
        store.create_dataset(DatasetConfig("d", 10, 0))
    store.create_dataset(DatasetConfig("d", 10, 5))
    with pytest.raises(InputError, match="different config"):
        store.create_dataset(DatasetConfig("d", 11, 5))
    with pytest.raises(InputError, match="no data set"):
        store.lease("nope", "w")
    with pytest.raises(InputError, match="consumed"):
        a = store.lease("d", "w")["lease"]
        store.ack("d", "w", 0, a["shard"], 99)


def test_state_survives_reopening_the_file(tmp_path):
    s = ShardStore(tmp_path / "x.db")
    s.create_dataset(DatasetConfig("d", 30, 10))
    a = s.lease("d", "w")["lease"]
    s.ack("d", "w", 0, a["shard"], 10)
    s.close()
    s2 = ShardStore(tmp_path / "x.db")
    assert s2.status("d")["epochs"]["0"][DONE] == 1


def test_not_a_database_is_an_input_error(tmp_path):
    bad = tmp_path / "bad.db"
    bad.write_text("hello, this is not sqlite" * 100)
    with pytest.raises(InputError, match="SQLite"):
        ShardStore(bad)
