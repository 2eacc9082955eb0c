"""Red team round 12, finding 3: a store floor ('*') row lost while the folded names' filter
holds names is damaged, never read as 0 (a folded name's deleted fences came back)."""

from __future__ import annotations

import sqlite3

import pytest

from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.errors import Quarantined
from stragglers.adapt.service import token_digest
from stragglers.adapt.shards import ShardStore

A = token_digest("a-round12-floors-token-0123456789")


def test_a_lost_store_floor_refuses_folded_names_and_takes_no_new_folds(tmp_path):
    """d's fences went to 3, then d was folded into '*' (max_kept_floors 0) and the '*' row
    lost. d (in the filter) is refused, nothing written; a name never folded is served from 1;
    e deleted then is not folded into a '*' written anew (it would hold e's fences only, d's
    lost): e keeps its own row and is created again above its fences."""
    db = tmp_path / "s.db"
    store = ShardStore(db, max_kept_floors=0)
    try:
        store.create_dataset(DatasetConfig("d", 16, 4), A)
        for _ in range(3):
            store.join("d", "w", A)
        store.delete_dataset("d", A)
    finally:
        store.close()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT * FROM fence_floors").fetchall() == [("*", 3)]
        c.execute("DELETE FROM fence_floors WHERE dataset='*'")
    store = ShardStore(db, max_kept_floors=0)
    try:
        with pytest.raises(Quarantined, match=r"fence_floors row '\*'.*missing"):
            store.create_dataset(DatasetConfig("d", 16, 4), A)
        store.create_dataset(DatasetConfig("never-folded", 16, 4), A)
        assert store.join("never-folded", "w", A).fence == 1
        store.create_dataset(DatasetConfig("e", 16, 4), A)
        tops = [store.join("e", "w", A).fence for _ in range(5)]
        store.delete_dataset("e", A)
        store.create_dataset(DatasetConfig("e", 16, 4), A)
        assert store.join("e", "w", A).fence > tops[-1]
    finally:
        store.close()
    with sqlite3.connect(db) as c:
        assert c.execute("SELECT COUNT(*) FROM datasets WHERE name='d'").fetchone() == (0,)
        assert c.execute("SELECT COUNT(*) FROM fence_floors WHERE dataset='*'").fetchone() == (0,)
