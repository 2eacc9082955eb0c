"""The stored lease history is bounded per data set, in rows and in reply bytes, whatever
the workers' counts; a replay of a request whose reply was forgotten leases nothing."""

from __future__ import annotations

import sqlite3

import pytest

from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.errors import Conflict
from stragglers.adapt.history import HISTORY_REPLY_BYTES
from stragglers.adapt.shards import ShardStore


def held(db) -> int:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT COUNT(*) FROM shards WHERE state='DOING'").fetchone()[0]


def test_a_workers_big_replies_are_kept_up_to_a_byte_budget(tmp_path):
    # 256 requests of 256 shards each were all kept (~1.5 MB per worker, ~1.6 GB for 1,024
    # workers of one data set); fails before: every reply kept
    store = ShardStore(tmp_path / "s.db")
    store.create_dataset(DatasetConfig("d", 1 << 16, 1, num_epochs=None))
    fence = store.join("d", "w").fence
    replies = [store.lease("d", "w", fence, 256, f"r{i}") for i in range(40)]
    with sqlite3.connect(tmp_path / "s.db") as c:
        size = c.execute("SELECT SUM(length(reply)) FROM lease_requests").fetchone()[0]
        rows = c.execute("SELECT COUNT(*) FROM lease_requests").fetchone()[0]
    assert size <= HISTORY_REPLY_BYTES + 8192, size
    assert rows == 40   # the ids are all kept
    # the last request is replayed as it was; an old one is refused and leases nothing
    again = store.lease("d", "w", fence, 256, "r39")
    assert [x.shard for x in again.leases] == [x.shard for x in replies[39].leases]
    before = held(tmp_path / "s.db")
    with pytest.raises(Conflict, match="too old"):
        store.lease("d", "w", fence, 256, "r0")
    assert held(tmp_path / "s.db") == before
    store.close()


@pytest.mark.slow
def test_the_rows_of_many_workers_are_shared_out(tmp_path):
    # each worker kept its last 256 requests, whatever the number of workers (fails before:
    # 64 workers x 20 requests all kept)
    store = ShardStore(tmp_path / "s.db")
    store.history_rows = 256          # (shared by 64 workers: the floor of 8 each)
    store.create_dataset(DatasetConfig("d", 1 << 16, 1, num_epochs=None))
    fences = {f"w{i}": store.join("d", f"w{i}").fence for i in range(64)}
    for worker, fence in fences.items():
        for j in range(20):
            store.lease("d", worker, fence, 1, f"r{j}")
    with sqlite3.connect(tmp_path / "s.db") as c:
        rows = c.execute("SELECT COUNT(*) FROM lease_requests").fetchone()[0]
    assert rows == 64 * 8, rows
    # the newest are the ones kept: replayed, they lease nothing new
    before = held(tmp_path / "s.db")
    assert store.lease("d", "w3", fences["w3"], 1, "r19").leases[0].held
    assert held(tmp_path / "s.db") == before
    store.close()
