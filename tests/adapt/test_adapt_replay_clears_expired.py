"""A worker whose lease expired and that retries its timed-out lease call (the same request id:
a replay) is alive, as after any lease call: it keeps its place of max_workers_per_dataset (the
replay kept the EXPIRED mark, a new name took the place and the worker was fenced off).

The store runs on a clock of its own: expiry is an interleaving, not a wait.
"""

from __future__ import annotations

import pytest

from adapt_jobs import two_workers
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.errors import QuotaExceeded
from stragglers.adapt.service import token_digest

T = token_digest("replay-clears-expired-token-0123456789")


def test_a_replayed_lease_of_a_worker_whose_lease_expired_keeps_its_place(tmp_path):
    """max_workers_per_dataset 2: `a`'s lease expires (requeued by `b`'s call); `a` retries
    its call with the same request id: the replay answers its shard as no longer held, and
    a new name `c` is 429 (a's place kept), `a` leases on with its fence."""
    with two_workers(tmp_path / "s.db", DatasetConfig("ds", 64, 8, lease_s=5.0), T) as (
            store, now, a, b):
        first = store.lease("ds", "a", a, request_id="r1", token_sha256=T).leases[0]
        now[0] += 10   # a's lease expires: b's call requeues it and marks a as gone
        assert store.lease("ds", "b", b, request_id="b1", token_sha256=T).leases[0].shard \
            == first.shard
        replay = store.lease("ds", "a", a, request_id="r1", token_sha256=T)
        assert [(x.shard, x.held) for x in replay.leases] == [(first.shard, False)]
        with pytest.raises(QuotaExceeded, match="max_workers_per_dataset=2"):
            store.join("ds", "c", T)
        nxt = store.lease("ds", "a", a, request_id="r2", token_sha256=T)
        assert nxt.status == "ok" and nxt.leases[0].shard != first.shard
