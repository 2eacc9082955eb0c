"""A schema upgrade (or a new file's tables) that fails at any of its statements (a disk full,
a kill) leaves the file as it was, and the next start upgrades it (schema.open_database: one
transaction with its user_version), from every older version."""

from __future__ import annotations

import shutil
import sqlite3

import pytest

from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.schema import SCHEMA_VERSION, open_database
from stragglers.adapt.shards import ShardStore
from stragglers.errors import StragglersError

# back from schema 8 to each older layout, a step at a time (as test_adapt_shards makes them)
_DOWN = {7: "PRAGMA user_version=7;",
         6: "DROP TABLE fence_folds; PRAGMA user_version=6;",
         5: "PRAGMA user_version=5;",
         4: "DROP TABLE fence_floors; PRAGMA user_version=4;",
         3: "DROP TABLE row_sets; DROP INDEX datasets_creator; ALTER TABLE datasets DROP COLUMN"
            " rows_key; ALTER TABLE datasets DROP COLUMN creator; PRAGMA user_version=3;",
         2: "DROP TABLE lease_requests; ALTER TABLE workers DROP COLUMN seq; UPDATE datasets SET"
            " materialized=NULL; ALTER TABLE datasets DROP COLUMN materialized;"
            " PRAGMA user_version=2;"}


def _old_file(path, version):
    """A file of schema `version` (None: a new, empty file) holding one leased shard."""
    if version is None:
        sqlite3.connect(path).close()
        return
    s = ShardStore(path)
    s.create_dataset(DatasetConfig("d", 100, 10))
    f = s.join("d", "w").fence
    s.lease("d", "w", f, request_id="r1")
    s.close()
    c = sqlite3.connect(path)
    for v in range(SCHEMA_VERSION - 1, version - 1, -1):
        c.executescript(_DOWN[v])
    c.close()   # (the last connection: the log is folded into the file, which is copied)
    assert not path.with_name(path.name + "-wal").exists()


_SETUP_PRAGMAS = ("journal_mode", "synchronous", "busy_timeout")   # (the connection's own)
_SETUP = tuple(f"PRAGMA {p}" for p in _SETUP_PRAGMAS)


def _open_failing_at(db, k, monkeypatch) -> int:
    """open_database(db) with its k-th statement refused by SQLite (its authorizer: as a full
    disk or an I/O error refuses one), counted from the first after the connection's PRAGMAs;
    the number of statements it ran."""
    real = sqlite3.connect
    run = []

    def connect(*args, **kwargs):
        # (no statement cache: a statement run again is prepared again, so it can be refused)
        conn = real(*args, **{**kwargs, "cached_statements": 0})

        def trace(sql):
            if not sql.startswith(_SETUP):
                run.append(sql)

        def authorize(action, arg1, *_):
            # (refused once: the ROLLBACK after it must run)
            setup = action == sqlite3.SQLITE_PRAGMA and arg1 in _SETUP_PRAGMAS
            if len(run) == k and not refused and not setup:
                refused.append(True)
                return sqlite3.SQLITE_DENY
            return sqlite3.SQLITE_OK
        refused: list = []
        conn.set_trace_callback(trace)
        conn.set_authorizer(authorize)
        return conn

    monkeypatch.setattr(sqlite3, "connect", connect)
    try:
        conn = open_database(db, False, 1.0)
    except StragglersError:
        return -1
    finally:
        monkeypatch.setattr(sqlite3, "connect", real)
    conn.close()
    return len(run)


@pytest.mark.parametrize("version", [None, 2, 3, 4, 5, 6])
def test_an_upgrade_cut_at_any_statement_leaves_the_old_file_and_the_next_start_upgrades_it(
        tmp_path, monkeypatch, version):
    template = tmp_path / "template.db"
    _old_file(template, version)
    k, cut = 0, 0
    while True:
        db = tmp_path / f"cut{k}.db"
        shutil.copy(template, db)
        if _open_failing_at(db, k, monkeypatch) >= 0:
            break   # (k is past the upgrade's last statement: nothing was refused)
        cut += 1
        with sqlite3.connect(db) as c:   # as it was: the old version, its rows
            assert c.execute("PRAGMA user_version").fetchone()[0] == (version or 0)
            names = {r[0] for r in c.execute("SELECT name FROM sqlite_master")}
            assert ("datasets" in names) == (version is not None), (k, names)
        s = ShardStore(db)   # the next start upgrades it
        try:
            if version is not None:
                assert s.status("d").epochs["0"]["DOING"] == 1, k
        finally:
            s.close()
        with sqlite3.connect(db) as c:
            assert c.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        k += 1
    assert cut >= 3, cut   # (BEGIN, the statements, user_version, COMMIT were each cut)
