"""A shard row whose state (or another checked column) is NULL, in the service's real SQLite
file, quarantines its data set (503 Quarantined): a NULL made VALID_SHARD_SQL's `IN` and `!=`
terms NULL, not false, so `NOT (...)` did not select the row and GET /status was a 500 every
time (SQL's three-valued logic)."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from stragglers.adapt.service import EmbeddedServer

OWNER = "owner-token-0123456789"


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    srv = EmbeddedServer(tmp_path_factory.mktemp("nullstate") / "shards.db").start()
    yield srv
    srv.stop()


def leased(http: httpx.Client, name: str) -> None:
    """Data set `name` of 10 shards of 10, its shard 0/0 leased by worker w."""
    assert http.post("/datasets", json={"name": name, "num_samples": 100,
                                        "shard_size": 10}).status_code == 200
    fence = http.post(f"/datasets/{name}/join", json={"worker": "w"}).json()["fence"]
    assert http.post(f"/datasets/{name}/lease",
                     json={"worker": "w", "fence": fence}).status_code == 200


# before: status 500 (InternalError) every time, and the snapshot exported the row (200)
@pytest.mark.parametrize("read", ["status", "snapshot"])
def test_a_null_shard_state_quarantines_its_data_set(service, read):
    name = f"null-state-{read}"
    http = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {OWNER}"},
                        timeout=30)
    with http:
        leased(http, name)
        leased(http, f"{name}-good")
        with sqlite3.connect(service.db) as c:
            assert c.execute("UPDATE shards SET state=NULL WHERE dataset=? AND shard=0",
                             (name,)).rowcount == 1
        for _ in range(2):   # the same answer each time
            r = http.get(f"/datasets/{name}/{read}")
            assert r.status_code == 503, r.text[:300]
            assert r.json()["kind"] == "Quarantined", r.text[:300]
            assert f"'{name}'" in r.json()["error"] and "state=None" in r.json()["error"], \
                r.text[:300]
        assert http.get(f"/datasets/{name}-good/{read}").status_code == 200
        assert http.get("/health").status_code == 200
