"""Hostile cases of a tenth round (issue 34) on the shard service: places of the data set
quotas given back (DELETE /datasets/{name})."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.errors import Forbidden, QuotaExceeded
from stragglers.adapt.service import EmbeddedServer, ServiceConfig, token_digest
from stragglers.adapt.shards import ShardStore

OWNER, OTHER = "owner-token-0123456789", "other-token-0123456789"


def rows(db, key: str) -> int:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT COUNT(*) FROM shards WHERE dataset=?", (key,)).fetchone()[0]


def test_a_deleted_data_set_gives_its_places_back_and_its_name_starts_afresh(tmp_path):
    # (fails before: no deletion; max_datasets places were held for good)
    db, mine, theirs = tmp_path / "s.db", token_digest(OWNER), token_digest(OTHER)
    store = ShardStore(db, max_datasets=2, max_datasets_per_token=1)
    try:
        store.create_dataset(DatasetConfig("d", 8, 1), mine)
        f = store.join("d", "w", token_sha256=mine).fence
        lease = store.lease("d", "w", f, count=1, token_sha256=mine).leases[0]
        store.ack("d", "w", f, lease.epoch, lease.shard, 1, token_sha256=mine)
        try:
            store.create_dataset(DatasetConfig("e", 8, 1), mine)
            raise AssertionError("a second data set of the token was created past its quota")
        except QuotaExceeded:
            pass
        try:
            store.delete_dataset("d", theirs)
            raise AssertionError("a stranger deleted the data set")
        except Forbidden:
            pass
        assert store.delete_dataset("d", mine).deleted == "d"
        store.create_dataset(DatasetConfig("e", 8, 1), mine)      # the token's place is back
        store.create_dataset(DatasetConfig("d", 8, 2), theirs)    # the name, for another owner
        # the new 'd' starts with none of the old one's rows (its ack, its 8 rows)
        assert store.status("d").epochs["0"] == {"TODO": 4, "DOING": 0, "DONE": 0, "FAILED": 0}
        while store.collect_garbage():
            pass
        assert rows(db, "d") == 0   # the old rows are deleted; the new ones have a key of theirs
        assert store.status("d").epochs["0"] == {"TODO": 4, "DOING": 0, "DONE": 0, "FAILED": 0}
    finally:
        store.close()


@pytest.mark.slow
def test_an_owner_deletes_a_data_set_over_http_and_strangers_cannot(tmp_path):
    # (fails before: DELETE /datasets/{name} was 405, and with max_datasets=1 every later
    # creation 429 for good)
    server = EmbeddedServer(tmp_path / "s.db", config=ServiceConfig(max_datasets=1)).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            owner, other = ({"Authorization": f"Bearer {t}"} for t in (OWNER, OTHER))
            spec = {"name": "d", "num_samples": 4, "shard_size": 4}
            assert c.post("/datasets", json=spec, headers=owner).status_code == 200
            full = c.post("/datasets", json={**spec, "name": "e"}, headers=owner)
            assert full.status_code == 429 and "error" in full.json()
            for headers, status in (({}, 401), (other, 403)):
                r = c.delete("/datasets/d", headers=headers)
                assert r.status_code == status and "error" in r.json(), r.text
            r = c.delete("/datasets/nope", headers=owner)
            assert r.status_code == 404 and "error" in r.json()
            r = c.delete("/datasets/d", headers=owner)
            assert r.status_code == 200 and r.json()["deleted"] == "d", r.text
            assert c.get("/datasets/d/status").status_code == 404
            assert c.post("/datasets", json={**spec, "name": "e"},
                          headers=owner).status_code == 200
    finally:
        server.stop()
