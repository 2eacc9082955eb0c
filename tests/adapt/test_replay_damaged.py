"""A damaged stored lease reply (the service's own SQLite file edited by hand) quarantines its
data set (503 Quarantined) when its request id is replayed: never a 500, never an offset handed
out as it was stored; the other data sets and the service go on."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from stragglers.adapt.service import EmbeddedServer

OWNER = "owner-token-0123456789"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    srv = EmbeddedServer(tmp_path_factory.mktemp("replay") / "shards.db").start()
    yield srv
    srv.stop()


def leased_then_given_back(http: httpx.Client, name: str) -> int:
    """Data set `name` of 10 shards of 10; worker w leased shard 0/0 (request id r1) and gave
    it back, so a replay of r1 answers with the stored offset (the shard is no longer held)."""
    assert http.post("/datasets", json={"name": name, "num_samples": 100,
                                        "shard_size": 10}).status_code == 200
    fence = http.post(f"/datasets/{name}/join", json={"worker": "w"}).json()["fence"]
    lease = http.post(f"/datasets/{name}/lease", json={"worker": "w", "fence": fence,
                                                       "request_id": "r1"}).json()
    assert [(x["epoch"], x["shard"]) for x in lease["leases"]] == [(0, 0)]
    assert http.post(f"/datasets/{name}/release", json={"worker": "w", "fence": fence,
                                                        "failure": False}).status_code == 200
    return fence


# each was a 500 (InternalError) on every replay of r1 but -77, handed out as the offset
@pytest.mark.parametrize("name,reply,problem", [
    ("inf", "[[1e400,0,0]]", "outside the data set"),                  # int(inf): OverflowError
    ("huge", "[[99999999999999999999,0,0]]", "outside the data set"),  # SQLite: int too large
    ("deep", "[" * 100_000, "not JSON"),                                # RecursionError
    ("negative", "[[0,0,-77]]", "offset -77"),                          # returned unchecked
    ("past", "[[0,0,11]]", "offset 11"),                                # past the shard's 10
    ("shard", "[[0,-1,0]]", "outside the data set"),
    ("float", "[[0,0,0.5]]", "offset 0.5"),
    ("short", "[[0,0]]", "not [epoch, shard, offset]"),
])
def test_a_damaged_stored_reply_quarantines_its_data_set(service, name, reply, problem):
    http = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {OWNER}"},
                        timeout=30)
    with http:
        fence = leased_then_given_back(http, name)
        good = leased_then_given_back(http, f"{name}-good")
        with sqlite3.connect(service.db) as c:
            assert c.execute("UPDATE lease_requests SET reply=? WHERE dataset=?",
                             (reply, name)).rowcount == 1
        body = {"worker": "w", "fence": fence, "request_id": "r1"}
        for _ in range(2):   # the same answer each time, nothing changed by the first
            r = http.post(f"/datasets/{name}/lease", json=body)
            assert r.status_code == 503, r.text[:300]
            assert r.json()["kind"] == "Quarantined", r.text[:300]
            assert f"'{name}'" in r.json()["error"] and problem in r.json()["error"], r.text[:300]
        # the undamaged twin replays as before: shard 0/0 given back, its offset 0, not held
        r = http.post(f"/datasets/{name}-good/lease", json={**body, "fence": good})
        assert r.status_code == 200, r.text[:300]
        assert [(x["epoch"], x["shard"], x["offset"], x["held"]) for x in r.json()["leases"]] \
            == [(0, 0, 0, False)]
        assert http.get("/health").status_code == 200
