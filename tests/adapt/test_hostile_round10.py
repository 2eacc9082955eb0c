"""Hostile cases of a tenth round (issue 34) on the shard service: places of the data set
quotas given back (DELETE /datasets/{name})."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.errors import Forbidden, QuotaExceeded
from stragglers.adapt.service import EmbeddedServer, ServiceConfig, token_digest
from stragglers.adapt.shards import ShardStore
from stragglers.errors import InputError

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
        client = ShardClient(server.url, "e", "w", token=OWNER)   # the client's call
        assert client.delete_dataset().deleted == "e"
        assert ShardClient(server.url, "f", "w", token=OWNER).create_dataset(
            DatasetConfig("f", 4, 4)).created
    finally:
        server.stop()


def train(store: ShardStore, name: str, epochs: int) -> None:
    """Lease and ack every shard of `epochs` epochs, and one shard of the next."""
    f = store.join(name, "w").fence
    while True:
        for lease in store.lease(name, "w", f, count=4).leases:
            if lease.epoch >= epochs:
                return
            store.ack(name, "w", f, lease.epoch, lease.shard, lease.size)


def test_a_snapshot_folds_the_epochs_done_and_is_restored_whole(tmp_path):
    # (fails before: the snapshot listed every row of every epoch done, so a long training's
    # own snapshot grew ~30 bytes a shard an epoch past max_restore_bytes: 413 on resuming)
    store = ShardStore(tmp_path / "s.db")
    try:
        store.create_dataset(DatasetConfig("d", 64, 1, num_epochs=10))
        train(store, "d", 3)   # epochs 0-2 done, epoch 3 begun (a shard held)
        before = store.snapshot("d")
        assert before["folded_epochs"] == 3 and before["epochs_created"] >= 4
        assert len(before["shards"]) == (before["epochs_created"] - 3) * 64
        status = store.status("d").epochs
        assert store.restore(dict(before)).restored == before["epochs_created"] * 64
        after = store.status("d").epochs
        assert {e: after[e] for e in ("0", "1", "2")} == {e: status[e] for e in ("0", "1", "2")}
        again = store.snapshot("d")   # (the held shard is TODO again, first in the queue)
        assert again["folded_epochs"] == 3 and len(again["shards"]) == len(before["shards"])
        # a FAILED shard of a folded epoch is listed, and restored FAILED
        failed = [0, 5, "FAILED", 0, 4, 7, "x"]
        store.restore({**before, "shards": [failed, *before["shards"]]})
        assert store.status("d").epochs["0"]["FAILED"] == 1
        assert store.status("d").epochs["0"]["DONE"] == 63
    finally:
        store.close()


def test_older_snapshots_listing_every_row_are_still_restored(tmp_path):
    store = ShardStore(tmp_path / "s.db")
    try:
        store.create_dataset(DatasetConfig("d", 8, 1, num_epochs=4))
        train(store, "d", 2)
        folded = store.snapshot("d")
        rows = [[e, s, "DONE", 1, 0, 0, None] for e in range(2) for s in range(8)]
        full = {k: v for k, v in folded.items() if k != "folded_epochs"}
        full["shards"] = rows + folded["shards"]
        assert store.restore(full).restored == folded["epochs_created"] * 8
        assert store.snapshot("d")["folded_epochs"] == 2
        bad = {**folded, "shards": folded["shards"][1:]}   # a shard of a live epoch missing
        try:
            store.restore(bad)
            raise AssertionError("a snapshot missing a live epoch's shard was restored")
        except InputError as exc:
            assert "shards" in str(exc)
    finally:
        store.close()


def test_a_few_bytes_of_folded_epochs_cannot_ask_for_billions_of_rows(tmp_path):
    store = ShardStore(tmp_path / "s.db")
    try:
        store.create_dataset(DatasetConfig("d", 65_536, 1, num_epochs=None))
        snap = store.snapshot("d")
        last = [[(1 << 20) - 1, *r[1:]] for r in snap["shards"]]   # the last epoch, listed
        big = {**snap, "epochs_created": 1 << 20, "folded_epochs": (1 << 20) - 1, "shards": last}
        try:
            store.restore(big)
            raise AssertionError("a restore of 2^36 rows was taken")
        except InputError as exc:
            assert exc.field == "epochs_created"
    finally:
        store.close()
