"""The index pace of big lease replies (lease_indices_per_token_s) waits before the lease is
committed: a paced reply carries a lease of lease_s from its commit (it waited after the
commit, so a reply paced past lease_s arrived with its lease expired, its shards handed to
another worker and its acks 409), a wait past half the data set's lease_s is 429, and a lease
reserves what its reply can send at most (count x shard_size reserved up to 64x that).

A real service on loopback whose store and index pace share one clock of the test's: the
pace's sleeps move it, nothing else does (expiry is an interleaving, not a wait).
"""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from stragglers.adapt import service
from stragglers.adapt.service import EmbeddedServer, ServiceConfig
from stragglers.adapt.shards import ShardStore

SHARD = 8192   # over INLINE_INDICES: every shard of a reply is paced
PER_S = 4.0 * SHARD   # four shards' indices a second (one second's worth at once)
NOW = [1000.0]
SLEPT: list[float] = []


async def _advance(seconds: float) -> None:
    """The pace's sleep: the shared clock moves on by it, at once."""
    SLEPT.append(seconds)
    NOW[0] += seconds


class _Pace(service._IndexPace):
    """The service's index pace on the test's clock."""

    def __init__(self, per_s: float, max_wait_s: float):
        super().__init__(per_s, max_wait_s, clock=lambda: NOW[0], sleep=_advance)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # stall_s: the clock's moves (and its standing still) are no pause of the service
    cfg = ServiceConfig().replace(lease_indices_per_token_s=PER_S, stall_s=600.0)
    server = EmbeddedServer(tmp_path_factory.mktemp("pace") / "s.db", config=cfg)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(service, "_IndexPace", _Pace)
        mp.setattr(service, "open_store", lambda db, config: ShardStore(
            db, durable=False, clock=lambda: NOW[0]))
        server.start()
    try:
        yield server
    finally:
        server.stop()


def _headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}-pace-live-lease-0123456789"}


def _create(url: str, h: dict, name: str, shard_size: int = SHARD, lease_s: float = 600.0,
            num_samples: int = 64 * SHARD, **more) -> None:
    r = httpx.post(f"{url}/datasets", headers=h, json={
        "name": name, "num_samples": num_samples, "shard_size": shard_size,
        "lease_s": lease_s, **more})
    assert r.status_code == 200, r.text


def _join(url: str, h: dict, name: str, worker: str) -> int:
    r = httpx.post(f"{url}/datasets/{name}/join", headers=h, json={"worker": worker})
    assert r.status_code == 200, r.text
    return r.json()["fence"]


def _lease(url: str, h: dict, name: str, worker: str, fence: int, count: int) -> httpx.Response:
    return httpx.post(f"{url}/datasets/{name}/lease", headers=h, timeout=30,
                      json={"worker": worker, "fence": fence, "count": count})


def test_a_reply_paced_past_its_lease_s_carries_a_live_lease(server):
    """lease_s 2: `a`'s 16 shards (4 s of pace, 1 s at once) wait 3 s, then `b`'s lease of
    one waits 0.25 s: b gets a shard of its own and a acks all 16 (b took one of a's and a's
    acks were 409 LeaseLost). A lease whose reply would wait 2 s, past half the lease, is 429
    with a Retry-After, nothing leased (admitted before: the bound was 8 s whatever lease_s)."""
    url, h = server.url, _headers("live")
    _create(url, h, "live", lease_s=2.0)
    fa, fb = _join(url, h, "live", "a"), _join(url, h, "live", "b")
    SLEPT.clear()
    ra = _lease(url, h, "live", "a", fa, 16)
    assert ra.status_code == 200, ra.text
    mine = {x["shard"] for x in ra.json()["leases"]}
    assert len(mine) == 16 and SLEPT == pytest.approx([3.0])
    rb = _lease(url, h, "live", "b", fb, 1)
    assert rb.status_code == 200, rb.text
    assert rb.json()["leases"][0]["shard"] not in mine
    assert SLEPT == pytest.approx([3.0, 0.25])
    for x in ra.json()["leases"]:
        ack = httpx.post(f"{url}/datasets/live/ack", headers=h, json={
            "worker": "a", "fence": fa, "epoch": x["epoch"], "shard": x["shard"],
            "consumed": 1})
        assert ack.status_code == 200, ack.text
    refused = _lease(url, h, "live", "b", fb, 8)
    assert refused.status_code == 429, refused.text
    assert refused.json()["kind"] == "RateLimited" and int(refused.headers["retry-after"]) >= 1
    assert "would wait 2 s, at most 1 s" in refused.json()["error"]
    status = httpx.get(f"{url}/datasets/live/status", headers=h).json()
    assert status["epochs"]["0"]["DOING"] == 17
    assert SLEPT == pytest.approx([3.0, 0.25])


def test_a_lease_reserves_what_its_reply_can_send_at_most(server):
    """count=256 of 65,536-sample shards reserves the 4 shards (8 s of pace) a reply sends at
    most, not 256 (512 s: 429 once any of the token's pace was spent, here a quarter of a
    second); a data set whose stored shard size is unknown (a damaged row) the same, and its
    lease, refused by its commit (503), gives it all back."""
    url, h = server.url, _headers("cap")
    big = 1 << 16
    _create(url, h, "cap-small")
    _create(url, h, "cap-big", shard_size=big, num_samples=2 * big, num_epochs=1)
    _create(url, h, "cap-damaged", shard_size=big, num_samples=2 * big)
    fences = {name: _join(url, h, name, "w") for name in ("cap-small", "cap-big", "cap-damaged")}
    con = sqlite3.connect(server.db)
    try:
        with con:
            con.execute("UPDATE datasets SET shard_size='x' WHERE name='cap-damaged'")
    finally:
        con.close()
    SLEPT.clear()
    r = _lease(url, h, "cap-small", "w", fences["cap-small"], 1)   # 0.25 s of the burst
    assert r.status_code == 200 and SLEPT == [], r.text
    r = _lease(url, h, "cap-damaged", "w", fences["cap-damaged"], 256)
    assert r.status_code == 503 and r.json()["kind"] == "Quarantined", r.text
    r = _lease(url, h, "cap-big", "w", fences["cap-big"], 256)
    assert r.status_code == 200, r.text
    assert [len(x["indices"]) for x in r.json()["leases"]] == [big, big]
    # (paid for 8.25 s past the burst's start: 7.25 s from now)
    assert SLEPT == pytest.approx([7.25])
