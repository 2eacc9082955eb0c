"""The shard database's tables, their versions and the upgrade of older files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from stragglers.adapt.dataset import MAX_FENCE
from stragglers.adapt.space import out_of_space
from stragglers.errors import EnvironmentFailure, InputError, StragglersError

SCHEMA_VERSION = 8

_SCHEMA = """
CREATE TABLE IF NOT EXISTS datasets (
    name TEXT PRIMARY KEY, num_samples INTEGER, shard_size INTEGER, seed INTEGER,
    num_epochs INTEGER, lease_s REAL, max_retries INTEGER, epochs_created INTEGER,
    front INTEGER, token_sha256 TEXT, materialized INTEGER, rows_key TEXT, creator TEXT);
CREATE TABLE IF NOT EXISTS shards (
    dataset TEXT, epoch INTEGER, shard INTEGER, start INTEGER, stop INTEGER,
    state TEXT, worker TEXT, fence INTEGER, lease_until REAL, consumed INTEGER,
    retries INTEGER, queue_pos INTEGER, error TEXT, PRIMARY KEY (dataset, epoch, shard));
CREATE INDEX IF NOT EXISTS shards_queue ON shards (dataset, state, queue_pos);
CREATE INDEX IF NOT EXISTS shards_lease ON shards (dataset, state, lease_until);
CREATE INDEX IF NOT EXISTS shards_holder ON shards (dataset, worker, state);
CREATE TABLE IF NOT EXISTS workers (
    dataset TEXT, worker TEXT, fence INTEGER, request_id TEXT, reply TEXT, seq INTEGER DEFAULT 0,
    PRIMARY KEY (dataset, worker));
CREATE TABLE IF NOT EXISTS lease_requests (
    dataset TEXT, worker TEXT, seq INTEGER, request_id TEXT, fence INTEGER, status TEXT,
    reply TEXT, PRIMARY KEY (dataset, worker, seq));
CREATE UNIQUE INDEX IF NOT EXISTS lease_requests_id ON lease_requests (dataset, worker, request_id);
CREATE INDEX IF NOT EXISTS datasets_owner ON datasets (token_sha256);
CREATE INDEX IF NOT EXISTS datasets_creator ON datasets (creator);
CREATE TABLE IF NOT EXISTS row_sets (rows_key TEXT PRIMARY KEY, dataset TEXT, state TEXT);
CREATE TABLE IF NOT EXISTS fence_floors (dataset TEXT PRIMARY KEY, floor INTEGER);
CREATE TABLE IF NOT EXISTS fence_folds (id INTEGER PRIMARY KEY CHECK (id = 0), names BLOB);
"""
# workers.reply (schema 2's last lease reply, unused since schema 3): LEFT once the name has
# released itself; a join, a lease that hands it shards, or an ack of a shard it holds, clears
# it. FENCED_OFF ("fenced") once a launcher released it without a fence: every call is
# refused until a join clears it (a lease at the next fence must not pass). EXPIRED once a lease of its current incarnation expired in
# another's call; a lease of it (whatever its answer) or an ack of a shard it holds clears
# that too. A name that left either way and holds no shard gives its place of
# max_workers_per_dataset to a new name (shards._take_place_of_left).
LEFT = "left"
EXPIRED = "expired"
FENCED_OFF = "fenced"
# Schema 2 -> 3: a history of lease request ids per worker (schema 2 kept only the last one),
# and the last epoch's rows written in chunks (materialized: how many of them exist; NULL: all).
_MIGRATE_2 = ("ALTER TABLE workers ADD COLUMN seq INTEGER DEFAULT 0;"
              " ALTER TABLE datasets ADD COLUMN materialized INTEGER;")
# Schema 3 -> 4: a data set's shard rows under a key of their own (rows_key; NULL: its name), so
# that a restore writes its rows beside the old ones, a chunk at a time, and then switches the
# key in one small transaction (row_sets: keys being written, or left to delete); the client
# address that created a data set (creator), for the per-client quota.
_MIGRATE_3 = ("ALTER TABLE datasets ADD COLUMN rows_key TEXT;"
              " ALTER TABLE datasets ADD COLUMN creator TEXT;")
# Schema 4 -> 5: fence_floors, a data set's highest fence of a worker name that gave its place
# (new names' fences start above it). Which names of an older file gave theirs is not known:
# its floor is the highest fence its rows hold (the rule of those versions, kept).
_MIGRATE_4 = ("INSERT OR REPLACE INTO fence_floors SELECT dataset, MAX(fence) FROM workers"
              f" WHERE typeof(fence)='integer' AND fence BETWEEN 1 AND {MAX_FENCE} GROUP BY"
              " dataset;")
# Schema 5 -> 6: a deleted data set's fence floor is kept (its name's fences never repeat: a
# recreated one started at 1 again, and a stuck holder of the old one was current). Files of
# schema 5 dropped it at the delete: the deleted rows not yet collected (garbage) hold fences
# of its holders, and its name's floor goes above them.
_MIGRATE_5 = ("INSERT INTO fence_floors SELECT r.dataset, MAX(s.fence) FROM row_sets r JOIN shards"
              " s ON s.dataset = r.rows_key WHERE r.state = 'garbage' AND typeof(s.fence) ="
              f" 'integer' AND s.fence BETWEEN 1 AND {MAX_FENCE} GROUP BY r.dataset ON CONFLICT"
              " (dataset) DO UPDATE SET floor = CASE WHEN typeof(floor) = 'integer' AND floor"
              f" BETWEEN 0 AND {MAX_FENCE} THEN MAX(floor, excluded.floor) ELSE floor END;")
# Schema 6 -> 7: fence_folds, the names folded into the store floor (floors.py). A file of
# schema 6 folded without it: where it has a store floor, the names in it are unknown (NULL).
_MIGRATE_6 = "INSERT INTO fence_folds SELECT 0, NULL FROM fence_floors WHERE dataset = '*';"
# Schema 7 -> 8: a launcher's release (no fence) of older files left the name LEFT at the next
# fence, which nobody held and a lease at it was served (round 14 #1, fixed in the code since:
# shards.FENCED_OFF); those rows are fenced off. They are the LEFT rows at seq 0 (that release
# wrote seq 0 and deleted the history; a worker's own release keeps its seq, past 0 once it
# leased with a request id, as every ShardClient lease does); a worker that joined and
# released itself without such a lease is fenced off too, and joins again (a safe error:
# keeping it would keep every burnt fence of those files usable).
_MIGRATE_7 = (f"UPDATE workers SET reply = '{FENCED_OFF}' WHERE reply = '{LEFT}' AND"
              " (seq IS NULL OR seq = 0);")


def open_database(db: str | Path, durable: bool, busy_timeout_s: float) -> sqlite3.Connection:
    """The writer's connection (WAL), its file upgraded to SCHEMA_VERSION; InputError naming
    the file when it is no shard database this version reads."""
    if str(db) in ("", ":memory:") or str(db).startswith("file:"):
        # each connection (the writer's, the readers', the WAL folder's) would open a
        # database of its own, empty: the service said it served, then died 'no such table'
        raise InputError(str(db) or "''", None, "not a file path; expected the shard "
                         "database's file (it must outlive the process, and every connection "
                         "opens it)")
    try:
        conn = sqlite3.connect(str(db), isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        # FULL: the WAL is fsynced at every commit, so an acknowledged lease/ack survives
        # a crash of the machine, not only of the process.
        conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
        version, old = _version(conn, db)
        if old is None or version != SCHEMA_VERSION:
            # The upgrade (or a new file's tables) in one transaction, its version with it: run
            # as separate scripts, each statement committed, a start killed between them left
            # schema 4's columns under user_version 3, and every later start failed on
            # 'duplicate column name' (the acknowledged rows in it, no version opening it).
            try:
                conn.execute("BEGIN IMMEDIATE")
                # read again under the write lock: another opener may have upgraded it since
                # (two at once, where the service's claim is skipped, or two stores of one
                # process): the second ran the upgrade again on its result ('not a usable
                # SQLite database': UNIQUE constraint failed: fence_folds.id)
                version, old = _version(conn, db)
                if old is None or version != SCHEMA_VERSION:
                    for statement in _statements(_steps(version if old is not None else None)):
                        conn.execute(statement)
                    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
                conn.execute("COMMIT")
            except BaseException:
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                raise
        else:
            # (nothing written when the file is current: a start on a full disk serves reads
            # and refuses writes 507 until space is freed)
            conn.executescript(_SCHEMA)
    except sqlite3.DatabaseError as exc:
        raise unusable(db, exc) from exc
    return conn


def _version(conn: sqlite3.Connection, db: str | Path) -> tuple[int, object]:
    """The file's user_version and whether it has tables (None: a new file); InputError when
    it is a version this one cannot read."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    old = conn.execute("SELECT name FROM sqlite_master WHERE name='datasets'").fetchone()
    if old is not None and version not in (2, 3, 4, 5, 6, 7, SCHEMA_VERSION):
        raise InputError(db, None, f"shard database of schema version {version};"
                         f" this version reads {SCHEMA_VERSION} (start a new file)")
    return version, old


def _steps(version: int | None) -> str:
    """The script that brings a file of `version` (None: a new file) to SCHEMA_VERSION."""
    steps = [_MIGRATE_2] if version == 2 else []
    steps += [_MIGRATE_3] if version in (2, 3) else []
    steps += [_SCHEMA]
    steps += [_MIGRATE_4] if version in (2, 3, 4) else []
    steps += [_MIGRATE_5] if version in (2, 3, 4, 5) else []
    steps += [_MIGRATE_6] if version in (2, 3, 4, 5, 6) else []
    steps += [_MIGRATE_7] if version in (2, 3, 4, 5, 6, 7) else []
    return "".join(steps)


def _statements(script: str) -> list[str]:
    """The script's statements one by one (executescript would commit the open transaction
    first, giving up the write lock the version was read under)."""
    out, part = [], ""
    for piece in script.split(";"):
        part += piece + ";"
        if sqlite3.complete_statement(part):   # (a ';' inside a literal does not end one)
            if part.strip(" \n;"):
                out.append(part.strip())
            part = ""
    return out


def unusable(db: str | Path, exc: sqlite3.DatabaseError) -> StragglersError:
    """The error of a shard database that cannot be opened: EnvironmentFailure when its disk
    is full (the file is fine: free space and start again), else InputError."""
    if out_of_space(exc, str(db)):   # (a full disk, or at the file-size limit: checked)
        return EnvironmentFailure(str(db), f"its disk is full ({exc}); free space and start"
                                  " again (the file is not damaged)")
    return InputError(db, None, f"not a usable SQLite database ({exc})")
