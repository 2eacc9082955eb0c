"""Two openers of one older shard database at once upgrade it once (hV50 #4's suspicion)."""

from __future__ import annotations

import contextlib
import sqlite3
import threading

from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.schema import SCHEMA_VERSION
from stragglers.adapt.shards import ShardStore


def test_two_openers_of_one_schema_6_file_upgrade_it_once(tmp_path, monkeypatch):
    """Two ShardStore(db) on one schema-6 file with a store floor (its deleted names' floors
    folded: fence_folds gets its row 0), each waiting for the write lock (held here) before
    it upgrades. The service's claim keeps two services apart, but not where the file system
    has no flock (the claim is skipped, with a warning) nor two stores of one process: the
    version read before the lock was stale for the second, which ran the upgrade again
    (IntegrityError on fence_folds id 0: 'not a usable SQLite database'). Read under the
    lock, the second finds the file upgraded and opens it."""
    db = tmp_path / "shards.db"
    s = ShardStore(db)
    s.create_dataset(DatasetConfig("d", 100, 10))
    s.close()
    with contextlib.closing(sqlite3.connect(db)) as c:
        c.executescript("INSERT OR REPLACE INTO fence_floors VALUES ('*', 3);"
                        " DROP TABLE fence_folds; PRAGMA user_version=6;")
    # each opener's connection says when it asks for the write lock (it then waits for ours)
    asking = {name: threading.Event() for name in ("a", "b")}
    connect = sqlite3.connect

    def traced(*args, **kwargs):
        conn = connect(*args, **kwargs)
        said = asking.get(threading.current_thread().name)
        if said is not None:
            conn.set_trace_callback(
                lambda sql: said.set() if sql.startswith("BEGIN IMMEDIATE") else None)
        return conn

    got: dict[str, object] = {}

    def open_it():
        try:
            got[threading.current_thread().name] = ShardStore(db)
        except Exception as exc:  # (the test names what either opener raised)
            got[threading.current_thread().name] = exc

    lock = connect(db, isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")
    monkeypatch.setattr(sqlite3, "connect", traced)
    threads = [threading.Thread(target=open_it, name=n, daemon=True) for n in asking]
    try:
        for t in threads:
            t.start()
        for e in asking.values():
            assert e.wait(60)   # (a bound against a hang)
    finally:
        lock.execute("ROLLBACK")
        lock.close()
        for t in threads:
            t.join(60)
        monkeypatch.undo()
    try:
        assert not [x for x in got.values() if isinstance(x, Exception)], got
    finally:
        for x in got.values():
            if isinstance(x, ShardStore):
                x.close()
    with contextlib.closing(sqlite3.connect(db)) as c:
        assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        assert c.execute("SELECT id, names FROM fence_folds").fetchall() == [(0, None)]
