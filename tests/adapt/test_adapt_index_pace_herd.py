"""A token's big leases asked all at once: the index pace checks and reserves in one step, so
the herd past the bound is refused 429 before its leases are committed (checked before the
commit and charged after it, every one of a herd passed before any was charged: 7 of 12
admitted, replies waiting up to 7.5 s against a 1 s bound)."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from stragglers.adapt.errors import RateLimited
from stragglers.adapt.service import EmbeddedServer, ServiceConfig, _IndexPace

HERD = {"Authorization": "Bearer index-pace-herd-token-0123456789"}
REFUSED = {"Authorization": "Bearer index-pace-refused-token-01234567"}
SHARD = 8192   # over INLINE_INDICES: every lease's indices are paced
N = 12


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    # one shard's indices a second, a reply waiting at most 1 s: one second's burst and one
    # second's wait are two shards' worth (each test its own token: its own pace)
    cfg = ServiceConfig().replace(lease_indices_per_token_s=float(SHARD),
                                  contended_max_turn_wait_s=1.0)
    server = EmbeddedServer(tmp_path_factory.mktemp("pace") / "s.db", config=cfg).start()
    try:
        yield server.url
    finally:
        server.stop()


def _dataset(url: str, headers: dict, workers: int) -> dict[str, int]:
    name = headers["Authorization"][-8:]
    r = httpx.post(f"{url}/datasets", headers=headers, json={
        "name": name, "num_samples": N * SHARD, "shard_size": SHARD, "lease_s": 600})
    assert r.status_code == 200, r.text
    return {f"w{i}": httpx.post(f"{url}/datasets/{name}/join", headers=headers,
                                json={"worker": f"w{i}"}).json()["fence"]
            for i in range(workers)}


def test_a_herd_of_big_leases_is_refused_past_the_bound_not_queued(url):
    """12 workers of one token lease a shard each at once: at most the burst and the bound's
    worth (2 shards; one more for each second the herd's requests spread over, in which the
    pace gives one back) are admitted, the rest 429 with a Retry-After."""
    fences = _dataset(url, HERD, N)
    name = HERD["Authorization"][-8:]
    go, out, sent, answered = threading.Barrier(N), {}, [], []

    def lease(worker: str) -> None:
        with httpx.Client(timeout=30) as client:
            go.wait(timeout=30)
            sent.append(time.monotonic())
            out[worker] = client.post(f"{url}/datasets/{name}/lease", headers=HERD,
                                      json={"worker": worker, "fence": fences[worker],
                                            "count": 1, "request_id": "r-" + worker})
            answered.append(time.monotonic())

    threads = [threading.Thread(target=lease, args=(w,)) for w in fences]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    codes = sorted(r.status_code for r in out.values())
    admitted = codes.count(200)
    assert codes.count(429) == N - admitted, codes
    # the pace gives one shard back a second: every decision lies between the first request
    # sent and the last answer, so past the burst and the bound (2 shards) at most one more
    # a second of that span (a loaded machine spreads the herd; all 12 were admitted before)
    spread = max(answered) - min(sent)
    assert 1 <= admitted <= 2 + int(spread), (codes, spread)
    for r in out.values():
        if r.status_code == 429:
            assert "lease_indices_per_token_s" in r.json()["error"]
            assert int(r.headers["retry-after"]) >= 1
        else:
            assert len(r.json()["leases"][0]["indices"]) == SHARD


def test_leases_refused_after_admit_give_their_reservation_back(url):
    """Leases refused by their commit (a stale fence: 409) reserved the pace first and give it
    all back: three of them (3 s reserved if kept: the next would wait 3 s) leave the token's
    next lease admitted."""
    fence = _dataset(url, REFUSED, 1)["w0"]
    name = REFUSED["Authorization"][-8:]
    for _ in range(3):
        r = httpx.post(f"{url}/datasets/{name}/lease", headers=REFUSED,
                       json={"worker": "w0", "fence": fence + 1, "count": 1})
        assert r.status_code == 409, r.text
    r = httpx.post(f"{url}/datasets/{name}/lease", headers=REFUSED,
                   json={"worker": "w0", "fence": fence, "count": 1})
    assert r.status_code == 200, r.text


def test_the_pace_refunds_what_a_reply_does_not_send():
    """A reservation refunded in full (an error) or down to what the reply sends: the next
    lease sees only what was sent, and the reply sleeps only for its own part."""
    now, slept = [100.0], []

    async def sleep(s):
        slept.append(s)

    pace = _IndexPace(1000.0, 1.0, clock=lambda: now[0], sleep=sleep)

    async def calls():
        first = pace.admit("a", 1000)     # the burst's worth
        second = pace.admit("a", 1000)    # waits 1 s: at the bound
        with pytest.raises(RateLimited) as refused:
            pace.admit("a", 1000)         # would wait 2 s
        assert refused.value.retry_after_s == pytest.approx(1.0)
        pace.refund(second)               # (its lease failed)
        third = pace.admit("a", 1000)     # in its place
        await pace.wait(first, 1000)
        await pace.wait(third, 250)       # sent a quarter: 0.25 s past the burst
        assert slept == pytest.approx([0.25])
        held = pace.admit("a", 500)       # what was sent: 0.25 s ahead; 0.75 s with this
        await pace.wait(held, 0)          # nothing paced in its reply: all back, no sleep
        assert slept == pytest.approx([0.25])
        pace.admit("b", 5000)             # another token: its own pace; alone, never refused
        pace.admit("a", 750)              # 1 s ahead with it (kept, the refund's 500: 1.5 s)
        with pytest.raises(RateLimited):
            pace.admit("a", 1)

    asyncio.run(calls())


def test_a_reply_paced_past_its_lease_s_arrives_with_its_lease_live(tmp_path):
    """A lease of 5 shards at a pace of two a second waits 1.5 s for the pace after its
    commit; its data set's lease_s is 1 s. Its shards are leased for lease_s after that wait: a
    peer's call on its arrival requeues none, and its acks are 200 (they were leased for
    lease_s from the commit: expired on arrival, requeued to another worker, acks 409)."""
    cfg = ServiceConfig().replace(lease_indices_per_token_s=float(2 * SHARD),
                                  contended_max_turn_wait_s=10.0)
    server = EmbeddedServer(tmp_path / "s.db", config=cfg).start()
    url, headers = server.url, {"Authorization": "Bearer index-pace-lease-live-0123456789"}
    try:
        r = httpx.post(f"{url}/datasets", headers=headers, json={
            "name": "live", "num_samples": 6 * SHARD, "shard_size": SHARD, "lease_s": 1.0})
        assert r.status_code == 200, r.text
        fence = httpx.post(f"{url}/datasets/live/join", headers=headers,
                           json={"worker": "a"}).json()["fence"]
        leased = httpx.post(f"{url}/datasets/live/lease", headers=headers, timeout=30,
                            json={"worker": "a", "fence": fence, "count": 5})
        assert leased.status_code == 200, leased.text
        status = httpx.get(f"{url}/datasets/live/status", headers=headers).json()
        assert status["epochs"]["0"]["DOING"] == 5, status   # (none expired, none requeued)
        for lease in leased.json()["leases"]:
            r = httpx.post(f"{url}/datasets/live/ack", headers=headers, json={
                "worker": "a", "fence": fence, "epoch": lease["epoch"],
                "shard": lease["shard"], "consumed": 1})
            assert r.status_code == 200, r.text
    finally:
        server.stop()
