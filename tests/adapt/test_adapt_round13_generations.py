"""Generations of the shard store (ShardStore.generation): one counter of commits, kept only for
the data sets that exist, an incarnation that a DELETE and a creation again change (round 13)."""

from __future__ import annotations

import pytest

from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.shards import ShardStore


def test_a_generation_changes_with_each_commit_and_a_new_incarnation_never_repeats(tmp_path):
    # (fails before: generation() was (0, commits that touched the name), kept for every name
    # ever created; x created again after its DELETE went on from its old count: no
    # incarnation to tell them apart, and an entry per deleted name for good)
    store = ShardStore(tmp_path / "s.db", durable=False)
    try:
        store.create_dataset(DatasetConfig("x", 64, 8))
        first = store.generation("x")
        store.join("x", "w")
        joined = store.generation("x")
        assert joined != first and joined.incarnation == first.incarnation
        store.delete_dataset("x")
        gone = store.generation("x")
        assert "x" not in store._gen and gone.incarnation != first.incarnation
        store.create_dataset(DatasetConfig("x", 64, 8))
        again = store.generation("x")
        assert again.incarnation not in (first.incarnation, gone.incarnation)
        assert again.commit > joined.commit
        store.delete_dataset("x")
        assert store.generation("x").incarnation != gone.incarnation   # (each delete: new)
        assert store._gen == {}
    finally:
        store.close()


def test_a_creation_rolled_back_keeps_no_generation(tmp_path):
    # a creation refused after its name was touched (its row's INSERT refused, as a full disk
    # would) is rolled back: the name exists no more than before, and keeps no entry
    import sqlite3

    db = tmp_path / "s.db"
    ShardStore(db, durable=False).close()
    conn = sqlite3.connect(db)
    conn.execute("CREATE TRIGGER refuse BEFORE INSERT ON datasets WHEN NEW.name LIKE 'b%'"
                 " BEGIN SELECT RAISE(ABORT, 'refused'); END")
    conn.commit()
    conn.close()
    store = ShardStore(db, durable=False)
    try:
        for i in range(3):
            with pytest.raises(sqlite3.IntegrityError):
                store.create_dataset(DatasetConfig(f"b{i}", 64, 8))
        results = store.run_batch([lambda: store.create_dataset(DatasetConfig("a", 64, 8)),
                                   lambda: store.create_dataset(DatasetConfig("b", 64, 8))])
        assert [ok for ok, _ in results] == [True, False]
        assert set(store._gen) == {"a"}
    finally:
        store.close()


def test_the_data_sets_of_the_file_keep_their_generation_across_other_deletes(tmp_path):
    # a data set untouched since the start keeps its generation when others are deleted (a
    # big cached snapshot of it is not built again for each DELETE elsewhere)
    db = tmp_path / "s.db"
    store = ShardStore(db, durable=False)
    store.create_dataset(DatasetConfig("kept", 64, 8))
    store.close()
    store = ShardStore(db, durable=False)
    try:
        before = store.generation("kept")
        store.create_dataset(DatasetConfig("other", 64, 8))
        store.delete_dataset("other")
        assert store.generation("kept") == before
    finally:
        store.close()


def test_a_delete_drops_its_data_sets_cached_bodies(tmp_path):
    # (fails before: the cache kept a deleted data set's snapshot and status bytes by name
    # until evicted by others' bytes)
    import httpx

    from stragglers.adapt.service import EmbeddedServer

    token = {"Authorization": "Bearer cache-round13-token-0123456789"}
    server = EmbeddedServer(tmp_path / "s.db", durable=False).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=token) as c:
            r = c.post("/datasets", json={"name": "x", "num_samples": 64, "shard_size": 8})
            assert r.status_code == 200, r.text
            for kind in ("snapshot", "status"):
                assert c.get(f"/datasets/x/{kind}").status_code == 200
            cache = server.app.state.reader._cache
            assert {("snapshot", "x"), ("status", "x")} <= set(cache)
            assert c.delete("/datasets/x").status_code == 200
            assert not {("snapshot", "x"), ("status", "x")} & set(cache)
    finally:
        server.stop()


def test_a_stale_snapshot_is_served_only_within_its_incarnation(tmp_path, monkeypatch):
    # (fails before: a big cached snapshot was served stale whatever the generation: the
    # deleted x's as the x created again, with another config, when no DELETE dropped it)
    import asyncio
    import json

    from stragglers.adapt import reads

    monkeypatch.setattr(reads, "BIG_SNAPSHOT", 1)   # (every snapshot "big": stale allowed)
    db = tmp_path / "s.db"
    store = ShardStore(db, durable=False)
    side = reads.ReadSide(str(db), store.generation)
    try:
        store.create_dataset(DatasetConfig("x", 64, 8))

        async def snapshot() -> dict:
            return json.loads(await side.snapshot("x", stale_s=3600.0))

        first = asyncio.run(snapshot())
        fence = store.join("x", "w").fence
        assert store.lease("x", "w", fence, 1).status == "ok"
        assert asyncio.run(snapshot()) == first   # (changed since, same incarnation: stale)
        store.delete_dataset("x")
        store.create_dataset(DatasetConfig("x", 32, 8))
        assert asyncio.run(snapshot())["dataset"]["num_samples"] == 32
    finally:
        side.close()
        store.close()
