"""Places of the shard service's limits given back when what holds them ends, and never taken
by a request that is refused (round nine's F1, F4, F6, F6c: the class beyond their instances).

The store is driven with a clock of its own where the case is an interleaving; the service
runs on a thread of this process where the case is a route.
"""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from stragglers.adapt.control import ControlPlane
from stragglers.adapt.controller import ControlConfig
from stragglers.adapt.dataset import DatasetConfig, validate_snapshot
from stragglers.adapt.errors import Fenced, Forbidden, Quarantined, QuotaExceeded
from stragglers.adapt.restores import prepare_restore
from stragglers.adapt.service import SERVICE_TOKEN_HEADER, EmbeddedServer, token_digest
from stragglers.adapt.shards import ShardStore

A, B = token_digest("a-round47-token-0123456789"), token_digest("b-round47-token-0123456789")


def test_a_creation_refused_by_its_tokens_quota_reclaims_nothing(tmp_path):
    """At max_datasets with an unused data set of another token to reclaim, a creation past its
    own token's quota is refused 429 — and the unused one is neither deleted nor told to the
    service as reclaimed (its in-memory state was popped before the refusal, then the SQL
    rolled back: the service dropped a live data set's owner from its cache)."""
    now = [1000.0]
    store = ShardStore(tmp_path / "s.db", clock=lambda: now[0], max_datasets=2,
                       max_datasets_per_token=1, unused_dataset_s=60)
    try:
        store.create_dataset(DatasetConfig("b", 16, 4), B)
        now[0] += 1
        store.create_dataset(DatasetConfig("a", 16, 4), A)
        now[0] += 61
        with pytest.raises(QuotaExceeded, match="max_datasets_per_token"):
            store.create_dataset(DatasetConfig("c", 16, 4), A)
        assert store.reclaimed() == []
        assert store.status("b").epochs["0"]["TODO"] == 4
        # a creation that passes every limit still takes the unused one's place
        store.create_dataset(DatasetConfig("c", 16, 4), B)
        assert store.reclaimed() == ["b"]
    finally:
        store.close()


def test_a_restore_in_progress_keeps_its_data_set_until_it_ends(tmp_path):
    """A data set whose restore is being written is in use; once that restore is abandoned
    (its rows garbage), the data set, unused again, gives its place."""
    now = [1000.0]
    store = ShardStore(tmp_path / "s.db", clock=lambda: now[0], max_datasets=1,
                       unused_dataset_s=60)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        prepared = prepare_restore(validate_snapshot(store.snapshot("d")))
        now[0] += 61
        key = store.restore_begin(prepared, A, may_create=False)
        with pytest.raises(QuotaExceeded):
            store.create_dataset(DatasetConfig("e", 16, 4), B)
        assert store.reclaimed() == []
        store.restore_abort(key)
        store.create_dataset(DatasetConfig("e", 16, 4), B)
        assert store.reclaimed() == ["d"]
    finally:
        store.close()


def test_a_name_that_left_gives_its_place_and_never_gets_its_old_fence_back(tmp_path):
    """max_workers_per_dataset 2. Names that never released keep their places (a live worker
    holding nothing between leases is not 'gone'); a name that released gives its place to a
    new one once it holds nothing — a launcher's release (no fence) that gave back only part
    of its shards holds the rest until they are back. A name that lost its place and comes
    back gets a fence above every one it had: its old incarnations stay fenced off."""
    store = ShardStore(tmp_path / "s.db", max_workers_per_dataset=2)
    try:
        store.create_dataset(DatasetConfig("d", 64, 4), A)
        a = store.join("d", "a", A).fence
        assert store.join("d", "b", A).fence == 1
        with pytest.raises(QuotaExceeded, match="none of them released holding nothing"):
            store.join("d", "c", A)
        store.lease("d", "a", a, count=2, token_sha256=A)
        store.release("d", "a", None, error="pod gone", token_sha256=A, limit=1)
        with pytest.raises(QuotaExceeded):   # (one shard of a's still held)
            store.join("d", "c", A)
        store.give_back("d", "a", None, a + 1, True, "pod gone", token_sha256=A)
        c = store.join("d", "c", A).fence
        assert c == a + 2   # above a's incarnations (1, and 2 of the launcher's release)
        with pytest.raises(Fenced, match="has not joined"):
            store.lease("d", "a", a, token_sha256=A)
        store.release("d", "b", 1, failure=False, token_sha256=A)
        back = store.join("d", "a", A).fence   # a again, at the limit: b's place
        assert back > a + 1
        with pytest.raises(Fenced):
            store.lease("d", "a", a, token_sha256=A)
        assert store.lease("d", "a", back, token_sha256=A).status == "ok"
        # c released, then leased again: it has not left (its place is kept between shards)
        store.release("d", "c", c, failure=False, token_sha256=A)
        shard = store.lease("d", "c", c, token_sha256=A).leases[0]
        store.ack("d", "c", c, shard.epoch, shard.shard, 4, token_sha256=A)
        with pytest.raises(QuotaExceeded):
            store.join("d", "e", A)
    finally:
        store.close()


def test_a_quarantined_data_set_is_deleted_by_its_owner_or_the_service_token_only(tmp_path):
    """A damaged shard row: a stranger's DELETE 403, the owner's 200 (rows not read). A damaged
    owner column: no owner can be proven, the owner's DELETE 503 naming the service token,
    whose DELETE 200; every place given back (max_datasets 2: two creations 200 after)."""
    service = "service-round47-token-0123456789"
    owner = {"Authorization": "Bearer a-round47-token-0123456789",
             SERVICE_TOKEN_HEADER: service}
    stranger = {"Authorization": "Bearer b-round47-token-0123456789"}
    spec = {"num_samples": 16, "shard_size": 4}

    def serve():
        return EmbeddedServer(tmp_path / "s.db", service_token=service,
                              config=_config(max_datasets=2)).start()

    server = serve()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for name in ("d", "o"):
                r = c.post("/datasets", json={"name": name, **spec}, headers=owner)
                assert r.status_code == 200, r.text
    finally:
        server.stop()
    with sqlite3.connect(tmp_path / "s.db") as db:
        db.execute("UPDATE shards SET state = NULL WHERE dataset = 'd' AND shard = 1")
        db.execute("UPDATE datasets SET token_sha256 = 'x' WHERE name = 'o'")
    db.close()
    server = serve()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            assert c.get("/datasets/d/status").status_code == 503
            assert c.delete("/datasets/d", headers=stranger).status_code == 403
            r = c.delete("/datasets/d", headers={"Authorization": owner["Authorization"]})
            assert r.status_code == 200, r.text
            r = c.delete("/datasets/o", headers={"Authorization": owner["Authorization"]})
            assert r.status_code == 503 and "service token" in r.text, r.text
            assert c.delete("/datasets/o", headers=owner).status_code == 200
            for name in ("d", "o"):
                r = c.post("/datasets", json={"name": name, **spec}, headers=owner)
                assert r.status_code == 200, r.text
            assert c.get("/datasets/d/status").status_code == 200
    finally:
        server.stop()


def test_the_service_token_deletes_no_healthy_data_set_of_another_owner(tmp_path):
    """The operator's right covers only a quarantined data set: a healthy one stays its
    owner's (403)."""
    store = ShardStore(tmp_path / "s.db")
    try:
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        with pytest.raises(Forbidden):
            store.delete_dataset("d", B, operator=True)
        with pytest.raises(Quarantined, match="the service token"):   # (owner unproven)
            with sqlite3.connect(tmp_path / "s.db") as db:
                db.execute("UPDATE datasets SET token_sha256 = 'x' WHERE name = 'd'")
            db.close()
            store.delete_dataset("d", A)
        assert store.delete_dataset("d", B, operator=True).deleted == "d"
    finally:
        store.close()


@pytest.mark.parametrize("limit", ["client", "token", "records"])
def test_a_controller_refused_by_any_limit_drops_no_idle_one(limit):
    """Idle controllers are dropped for a new one only when it then passes every limit: one
    refused by its client's, its token's or the records' limit leaves them all."""
    now = [0.0]
    plane = ControlPlane(max_jobs=2, max_jobs_per_token=1, max_jobs_per_client=1,
                         max_records=10_000, idle_s=60, clock=lambda: now[0])
    small = ControlConfig(world_size=1, global_batch=8)
    plane.configure("a", small, A, "10.0.0.1")
    plane.configure("b", small, B, "10.0.0.2")
    now[0] += 61
    if limit != "records":
        plane.configure("b", small, B)   # (b reports again: not idle, it keeps its places)
    other = token_digest("c-round47-token-0123456789")
    who = {"client": (other, "10.0.0.2"), "token": (B, "10.0.0.3"),
           "records": (other, "10.0.0.3")}[limit]
    cfg = ControlConfig(world_size=1000, global_batch=1000) if limit == "records" else small
    with pytest.raises(QuotaExceeded, match={"client": "max_jobs_per_client",
                                             "token": "max_jobs_per_token",
                                             "records": "max_control_records"}[limit]):
        plane.configure("c", cfg, *who)
    assert plane.has("a") and plane.has("b")
    plane.configure("c", small, other, "10.0.0.5")
    assert plane.has("c") and not plane.has("a")   # room made for one that fits


def _config(**kw):
    from stragglers.adapt.service import ServiceConfig
    return ServiceConfig(**kw)
