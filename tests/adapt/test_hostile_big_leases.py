"""A lease of 4 shards of 65,536 samples, asked again and again (a replayed request id costs the
caller nothing): its 262,144 indices are made JSON off the commit thread, a chunk at a time by
numpy, never made Python ints all at once on the thread every other job's leases wait for."""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from stragglers.adapt.dataset import epoch_permutation
from stragglers.adapt.permutations import Permutations
from stragglers.adapt.replies import INDEX_CHUNK
from stragglers.adapt.shards import INLINE_INDICES
from stragglers.adapt.service import EmbeddedServer

TOKEN = "big-lease-token-0123456789"
LISTS: list[tuple[str, int]] = []   # (thread, length) of each tolist of a kept permutation
ENCODED: list[tuple[str, int]] = []   # (thread, length) of each part made JSON by numpy


class Recorded(np.ndarray):
    """A permutation that records who makes a list or JSON of it, and how much at once."""

    def tolist(self):
        LISTS.append((threading.current_thread().name, len(self)))
        return super().tolist()

    def astype(self, *a, **kw):
        ENCODED.append((threading.current_thread().name, len(self)))
        return super().astype(*a, **kw)


class RecordedPermutations(Permutations):
    def _keep(self, key, perm):
        super()._keep(key, perm.view(Recorded))


@pytest.mark.slow
def test_a_big_lease_replayed_is_listed_off_the_commit_thread_in_chunks(tmp_path):
    srv = EmbeddedServer(tmp_path / "s.db").start()
    try:
        assert srv.app is not None
        store = srv.app.state.store
        store.permutations = RecordedPermutations()
        h = {"Authorization": f"Bearer {TOKEN}"}
        r = httpx.post(f"{srv.url}/datasets", headers=h, json={
            "name": "big", "num_samples": 1 << 18, "shard_size": 1 << 16, "lease_s": 600})
        assert r.status_code == 200, r.text
        fence = httpx.post(f"{srv.url}/datasets/big/join", headers=h,
                           json={"worker": "w"}).json()["fence"]
        body = {"worker": "w", "fence": fence, "count": 4, "request_id": "again"}
        LISTS.clear()
        ENCODED.clear()
        first = httpx.post(f"{srv.url}/datasets/big/lease", headers=h, json=body, timeout=120)
        assert ENCODED, "the lease was not read from the kept permutation"
        assert not [x for x in ENCODED if x[0] == "group-commit"], ENCODED[:5]
        assert max(n for _, n in ENCODED) <= INDEX_CHUNK
        ENCODED.clear()
        replies = [httpx.post(f"{srv.url}/datasets/big/lease", headers=h, json=body,
                              timeout=120).json() for _ in range(3)]
        perm = epoch_permutation(1 << 18, 0, 0)
        for reply in [first.json(), *replies]:
            assert len(reply["leases"]) == 4
            for lease in reply["leases"]:
                lo = lease["shard"] << 16
                assert lease["indices"] == perm[lo:lo + (1 << 16)].tolist()
        assert not [x for x in LISTS if x[1] > INLINE_INDICES], LISTS[:5]
        # the replays sent the JSON written for the first (each took ~21 ms of CPU to write
        # again: five clients replaying in a loop used ~0.6 of the service's cores)
        assert ENCODED == [] and store.permutations.encoded == 4
    finally:
        srv.stop()


def test_a_replayed_lease_writes_nothing_until_half_its_lease_is_spent(tmp_path):
    # A replay renewed its shards each time: a loop of replays was a loop of durable writes
    # (an fsync each) in the commits every other job's leases wait for.
    import sqlite3

    from stragglers.adapt.dataset import DatasetConfig
    from stragglers.adapt.shards import ShardStore

    now = [1000.0]
    store = ShardStore(tmp_path / "s.db", clock=lambda: now[0])
    store.create_dataset(DatasetConfig("d", 100, 10, lease_s=60.0))
    fence = store.join("d", "w").fence
    first = store.lease("d", "w", fence, 2, "again")

    def until() -> list:
        with sqlite3.connect(tmp_path / "s.db") as c:
            return c.execute("SELECT lease_until FROM shards WHERE state='DOING'"
                             " ORDER BY shard").fetchall()

    held = until()
    now[0] += 29.0   # less than half of lease_s
    for _ in range(3):
        again = store.lease("d", "w", fence, 2, "again")
        assert [x.shard for x in again.leases] == [x.shard for x in first.leases]
    assert until() == held, "a replay within half its lease wrote"
    now[0] += 2.0    # past half: the replay renews, as before
    store.lease("d", "w", fence, 2, "again")
    assert until() == [(now[0] + 60.0,)] * 2
    store.close()


def test_the_kept_json_of_leased_ranges_is_bounded_in_bytes():
    """Permutations.json keeps the JSON of the ranges it wrote, the least recently used
    dropped past max_json_bytes (a range bigger than the bound is written, never kept)."""
    from stragglers.adapt.permutations import Pending
    from stragglers.adapt.replies import indices_json

    perms = Permutations(max_json_bytes=4000)
    a, b, c = (Pending((4096, 0, 0), i * 500, i * 500 + 500) for i in range(3))
    one = perms.json(a, indices_json)
    assert bytes(one) == bytes(indices_json(epoch_permutation(4096, 0, 0)[:500]))
    assert 2000 < len(one) < 2500
    perms.json(b, indices_json)            # 2 kept: one is dropped
    assert perms.json(b, indices_json) is not None and perms.encoded == 2
    perms.json(a, indices_json)            # a was dropped: written again
    assert perms.encoded == 3
    perms.json(a, indices_json)
    assert perms.encoded == 3              # kept
    whole = Pending((4096, 0, 0), 0, 4096)
    perms.json(whole, indices_json)
    perms.json(whole, indices_json)
    assert perms.encoded == 5              # over the bound: never kept
    perms.json(c, indices_json)
    assert perms.encoded == 6


def test_big_lease_replies_wait_for_their_tokens_pace_of_indices():
    """A token's big lease replies past one second's worth of lease_indices_per_token_s wait
    (before their JSON is written), in turn; another token's do not wait for them. A token
    paid for more than max_wait_s ahead is refused 429 before its lease is committed."""
    import asyncio

    from stragglers.adapt.errors import RateLimited
    from stragglers.adapt.service import _IndexPace

    now, slept = [100.0], []

    async def sleep(s):
        slept.append(s)

    pace = _IndexPace(1000.0, 1.5, clock=lambda: now[0], sleep=sleep)

    async def reply(key, n):   # (a lease reserves what it may send, its reply then waits)
        await pace.wait(pace.admit(key, n), n)

    async def calls():
        await reply("a", 600)     # within the burst (one second's worth)
        await reply("a", 400)
        assert slept == []
        await reply("a", 500)     # past it: half a second
        await reply("b", 1000)    # another token: its own burst
        await reply("a", 500)     # behind a's first wait
        assert slept == pytest.approx([0.5, 1.0])
        held = pace.admit("a", 500)   # paid for 1.5 s ahead with it: at the bound, admitted
        with pytest.raises(RateLimited) as refused:
            pace.admit("a", 1000)     # 2.5 s ahead: refused before anything is leased
        assert refused.value.retry_after_s == pytest.approx(1.0)
        pace.admit("b", 1000)
        pace.admit("c", 1 << 20)      # a token with nothing paid for past its burst: admitted
        await pace.wait(held, 500)
        slept.clear()
        now[0] += 2.0
        pace.admit("a", 0)
        now[0] += 10.0                # paid up long since: one second's worth again, no more
        await reply("a", 1000)
        await reply("a", 1)
        assert slept == pytest.approx([0.001])

    asyncio.run(calls())
