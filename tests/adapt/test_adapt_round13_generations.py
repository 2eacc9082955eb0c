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
