"""Issue 34's leftovers of the worker places: a worker whose lease expired gives its place back
as one that released does, and a name's fences never restart (a restart with a higher
max_workers_per_dataset gave new names fence 1 again: a deleted name's old holder was current).

The store runs on a clock of its own: expiry is an interleaving, not a wait.
"""

from __future__ import annotations

import pytest

from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.errors import Fenced, QuotaExceeded
from stragglers.adapt.service import token_digest
from stragglers.adapt.shards import ShardStore

A = token_digest("a-issue34-token-0123456789")


def test_a_worker_whose_lease_expired_gives_its_place_to_a_new_name(tmp_path):
    """max_workers_per_dataset 1: `a` leases and is never heard of again. Once its lease has
    expired (requeued by the next call), a new name joins in its place (it was 429 for good:
    only a release freed a place); `a`'s incarnation is fenced off, and `a` back gets a fence
    above it."""
    now = [1000.0]
    store = ShardStore(tmp_path / "s.db", clock=lambda: now[0], max_workers_per_dataset=1)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4, lease_s=10), A)
        a = store.join("d", "a", A).fence
        held = store.lease("d", "a", a, token_sha256=A).leases[0]
        with pytest.raises(QuotaExceeded):   # a holds a live lease: its place is kept
            store.join("d", "b", A)
        now[0] += 11
        store.expire("d")
        assert store.status("d").epochs["0"]["DOING"] == 0
        b = store.join("d", "b", A).fence
        assert store.lease("d", "b", b, token_sha256=A).leases[0].shard == held.shard
        with pytest.raises(Fenced, match="has not joined"):
            store.ack("d", "a", a, held.epoch, held.shard, 1, token_sha256=A)
        store.release("d", "b", b, failure=False, token_sha256=A)
        assert store.join("d", "a", A).fence > a
    finally:
        store.close()


def test_a_worker_that_acks_after_one_lease_expired_keeps_its_place(tmp_path):
    """One of `a`'s two shards expires while it acks the other: an ack is a live worker's, so
    `a` keeps its place once it holds nothing (a new name is still 429)."""
    now = [1000.0]
    store = ShardStore(tmp_path / "s.db", clock=lambda: now[0], max_workers_per_dataset=1)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4, lease_s=10), A)
        a = store.join("d", "a", A).fence
        first, _ = store.lease("d", "a", a, count=2, token_sha256=A).leases
        now[0] += 6
        store.ack("d", "a", a, first.epoch, first.shard, 1, token_sha256=A)
        now[0] += 6
        store.expire("d")   # the other shard: expired, a marked as gone
        store.ack("d", "a", a, first.epoch, first.shard, 4, token_sha256=A)   # DONE: holds none
        with pytest.raises(QuotaExceeded):
            store.join("d", "b", A)
    finally:
        store.close()


def test_a_worker_whose_lease_expired_and_that_polls_keeps_its_place(tmp_path):
    """`a`'s lease expires in `x`'s call and `x` takes the shard; `a`, slow but alive, asks
    again and is told "wait": a call of its own is a live worker's, so its place is kept (a
    new name 429) and `a` goes on (its incarnation was deleted for a new name, then Fenced)."""
    now = [1000.0]
    store = ShardStore(tmp_path / "s.db", clock=lambda: now[0], max_workers_per_dataset=2)
    try:
        store.create_dataset(DatasetConfig("d", 4, 4, lease_s=10), A)
        a, x = store.join("d", "a", A).fence, store.join("d", "x", A).fence
        store.lease("d", "a", a, token_sha256=A)
        now[0] += 11
        assert store.lease("d", "x", x, token_sha256=A).status == "ok"   # a's shard, expired
        assert store.lease("d", "a", a, token_sha256=A).status == "wait"
        with pytest.raises(QuotaExceeded):
            store.join("d", "b", A)
        assert store.lease("d", "a", a, token_sha256=A).status == "wait"
    finally:
        store.close()


def test_fences_never_restart_when_the_limit_is_raised(tmp_path):
    """max_workers_per_dataset 1: `a` releases, `b` takes its place. After a restart with a
    limit of 4, `a` joins as a new name: its fence is above its old one (it was 1 again, the
    old incarnation's: a hung holder of it was current again)."""
    db = tmp_path / "s.db"
    store = ShardStore(db, max_workers_per_dataset=1)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        a = store.join("d", "a", A).fence
        store.release("d", "a", a, failure=False, token_sha256=A)
        store.join("d", "b", A)
    finally:
        store.close()
    store = ShardStore(db, max_workers_per_dataset=4)
    try:
        again = store.join("d", "a", A).fence
        assert again > a
        with pytest.raises(Fenced, match="stale"):
            store.lease("d", "a", a, token_sha256=A)
        assert store.join("d", "c", A).fence > a   # (every new name: above every deleted one)
    finally:
        store.close()


def test_a_schema_4_file_keeps_its_fences_above_every_row_it_holds(tmp_path):
    """A file of schema 4 (no fence floors: which names gave their place is not known) opens
    with its floor at the highest fence its rows hold: a new name starts above it."""
    import sqlite3

    db = tmp_path / "s.db"
    store = ShardStore(db)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        for _ in range(3):
            top = store.join("d", "a", A).fence
    finally:
        store.close()
    with sqlite3.connect(db) as c:
        c.executescript("DROP TABLE fence_floors; PRAGMA user_version=4;")
    store = ShardStore(db)
    try:
        assert store.join("d", "b", A).fence == top + 1
    finally:
        store.close()
