"""The shard database's tables, their versions and the upgrade of older files."""

from __future__ import annotations

import sqlite3
from pathlib import Path

from stragglers.adapt.dataset import MAX_FENCE
from stragglers.adapt.errors import Conflict, Quarantined
from stragglers.adapt.space import out_of_space
from stragglers.errors import EnvironmentFailure, InputError, StragglersError

SCHEMA_VERSION = 6

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
"""
# workers.reply (schema 2's last lease reply, unused since schema 3): LEFT once the name has
# released (its own release, or a launcher's); a join, a lease that hands it shards, or an ack
# of a shard it holds, clears it. EXPIRED once a lease of its current incarnation expired in
# another's call; a lease of it (whatever its answer) or an ack of a shard it holds clears
# that too. A name that left either way and holds no shard gives its place of
# max_workers_per_dataset to a new name (shards._take_place_of_left).
LEFT = "left"
EXPIRED = "expired"
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
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        old = conn.execute("SELECT name FROM sqlite_master WHERE name='datasets'").fetchone()
        if old is not None and version not in (2, 3, 4, 5, SCHEMA_VERSION):
            raise InputError(db, None, f"shard database of schema version {version};"
                             f" this version reads {SCHEMA_VERSION} (start a new file)")
        if old is None or version != SCHEMA_VERSION:
            # The upgrade (or a new file's tables) in one transaction, its version with it: run
            # as separate scripts, each statement committed, a start killed between them left
            # schema 4's columns under user_version 3, and every later start failed on
            # 'duplicate column name' (the acknowledged rows in it, no version opening it).
            steps = [_MIGRATE_2] if old is not None and version == 2 else []
            steps += [_MIGRATE_3] if old is not None and version in (2, 3) else []
            steps += [_SCHEMA]
            steps += [_MIGRATE_4] if old is not None and version in (2, 3, 4) else []
            steps += [_MIGRATE_5] if old is not None and version in (2, 3, 4, 5) else []
            try:
                conn.executescript("BEGIN IMMEDIATE;" + "".join(steps)
                                   + f"PRAGMA user_version={SCHEMA_VERSION}; COMMIT;")
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


# The fence_floors row of the oldest deleted names, folded into one (no data set is named so:
# see dataset.NAME_PATTERN). A data set takes it into a row of its own when it is created (a
# name folded into it may be the new one's), so only creations read it: a damaged one refuses
# those of names without a row of their own, never a data set that exists.
STORE_FLOOR = "*"
# A floor raised to `excluded.floor`; a damaged one stays as it is (MAX of -1 or 'x' with a
# fence wrote a floor that looked sound and was not: the fences it stood for were lost).
_RAISE = ("INSERT INTO fence_floors VALUES (?,?) ON CONFLICT (dataset) DO UPDATE SET floor ="
          f" CASE WHEN typeof(floor) = 'integer' AND floor BETWEEN 0 AND {MAX_FENCE} THEN"
          " MAX(floor, excluded.floor) ELSE floor END")
# A fence a kept floor may be raised to (a stored one past MAX_FENCE is damaged: its data set
# quarantined, never a floor; 2^63-1 kept made every new name's fence 2^63, a 500 for good)
_SOUND_FENCE = f"typeof(fence) = 'integer' AND fence BETWEEN 1 AND {MAX_FENCE}"


def sound_floor(floor: object) -> bool:
    """Whether a stored fence floor reads as one (an integer 0..MAX_FENCE)."""
    return type(floor) is int and 0 <= floor <= MAX_FENCE


def raise_fence_floor(c: sqlite3.Connection, name: str, fence: int) -> None:
    """Raise data set `name`'s fence floor to `fence` (a damaged floor is left damaged)."""
    c.execute(_RAISE, (name, fence))


def pin_fence_floor(c: sqlite3.Connection, name: str) -> int:
    """Data set `name`'s fence floor, a row of its own written where it has none: the store
    floor (its name may be one folded into it); Quarantined, nothing written, where the floor
    it needs is damaged (only that: a data set with a sound row of its own never reads the
    store floor, whose names were all deleted before the data set was created)."""
    row = c.execute("SELECT floor FROM fence_floors WHERE dataset=?", (name,)).fetchone()
    if row is not None:
        if not sound_floor(row[0]):
            raise Quarantined(f"data set '{name}': its stored fence floor is damaged (floor="
                              f"{row[0]!r:.40}, expected an integer 0..{MAX_FENCE}): new"
                              " worker names cannot be given fences above its deleted"
                              " incarnations'; other data sets are not affected (restore the"
                              " file from a backup)")
        return row[0]
    store = c.execute("SELECT floor FROM fence_floors WHERE dataset=?",
                      (STORE_FLOOR,)).fetchone()
    if store is not None and not sound_floor(store[0]):
        raise Quarantined(f"data set '{name}' has no fence floor of its own and the store's"
                          f" (fence_floors row '{STORE_FLOOR}', the oldest deleted data sets')"
                          f" is damaged (floor={store[0]!r:.40}, expected an integer"
                          f" 0..{MAX_FENCE}):"
                          " its name may be one of theirs, whose fences its new workers must"
                          " start above; data sets with a floor of their own are not affected"
                          f" (set row '{STORE_FLOOR}' to the highest fence a deleted data set's"
                          " workers held, or restore the file from a backup)")
    floor = 0 if store is None else store[0]
    c.execute("INSERT INTO fence_floors VALUES (?,?)", (name, floor))
    return floor


def next_fence(name: str, worker: str, fence: int) -> int:
    """The fence after `fence` (a join's, or a new name's above its floor); Conflict past
    MAX_FENCE (no request can carry it: the worker could never call again)."""
    if fence >= MAX_FENCE:
        raise Conflict(f"worker '{worker}' of data set '{name}' has no fence left (fences end at"
                       f" {MAX_FENCE}); join with another name")
    return fence + 1


def keep_fence_floor(c: sqlite3.Connection, name: str, key: str, max_kept: int) -> None:
    """Raise data set `name`'s fence floor to its workers' fences, before it is deleted: the
    floor outlives it, so a data set created again under its name starts its fences above
    every fence of the deleted one (they started at 1 again: a stuck holder was current).
    Past `max_kept` rows by name, the oldest deleted names' floors go into STORE_FLOOR."""
    high = c.execute("SELECT MAX(fence) FROM workers WHERE dataset=? AND " + _SOUND_FENCE,
                     (name,)).fetchone()[0]
    row = c.execute("SELECT floor FROM fence_floors WHERE dataset=?", (name,)).fetchone()
    if row is not None and not sound_floor(row[0]):
        # a damaged floor (a quarantined data set's delete): above every fence its rows
        # (under `key`) hold instead, read this once (one data set's rows, a rare path)
        held = c.execute("SELECT MAX(fence) FROM shards WHERE dataset=? AND " + _SOUND_FENCE,
                         (key,)).fetchone()[0]
        high = max((v for v in (high, held) if v is not None), default=0)
        c.execute("UPDATE fence_floors SET floor=? WHERE dataset=?", (high, name))
    elif high is not None:   # (no worker ever joined: no row, none kept for it)
        raise_fence_floor(c, name, high)
    # (names created and deleted in a loop would each keep a row: the file grew without bound)
    over = c.execute("SELECT COUNT(*) FROM fence_floors WHERE dataset != ?",
                     (STORE_FLOOR,)).fetchone()[0] - max_kept
    store = c.execute("SELECT floor FROM fence_floors WHERE dataset=?",
                      (STORE_FLOOR,)).fetchone()
    # Neither into a damaged store floor (the names' rows are kept: their floors are proven,
    # and while it is damaged no name without a row can be created, so none are added in a
    # loop) nor from a damaged row (its name's creation stays refused, not let past its fences)
    if over > 0 and (store is None or sound_floor(store[0])):
        fold = c.execute("SELECT rowid, floor FROM fence_floors f WHERE dataset != ? AND"
                         f" typeof(floor) = 'integer' AND floor BETWEEN 0 AND {MAX_FENCE} AND"
                         " NOT EXISTS (SELECT 1 FROM datasets d WHERE d.name = f.dataset)"
                         " ORDER BY rowid LIMIT ?", (STORE_FLOOR, over)).fetchall()
        if fold:
            raise_fence_floor(c, STORE_FLOOR, max(f for _, f in fold))
            c.executemany("DELETE FROM fence_floors WHERE rowid=?", [(r,) for r, _ in fold])


def unusable(db: str | Path, exc: sqlite3.DatabaseError) -> StragglersError:
    """The error of a shard database that cannot be opened: EnvironmentFailure when its disk
    is full (the file is fine: free space and start again), else InputError."""
    if out_of_space(exc, str(db)):   # (a full disk, or at the file-size limit: checked)
        return EnvironmentFailure(str(db), f"its disk is full ({exc}); free space and start"
                                  " again (the file is not damaged)")
    return InputError(db, None, f"not a usable SQLite database ({exc})")
