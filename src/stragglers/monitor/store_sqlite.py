"""The store in one SQLite file (WAL): the embedded default, one monitor instance.

Writes go through one connection under a lock (one writer, as SQLite wants); every reading
thread gets its own connection, which WAL lets read while a write is in progress. A part's
identity is (job, rank, part): the primary key makes a part seen twice count once.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
import shutil
import sqlite3
import threading
import weakref
from pathlib import Path
from typing import Iterable

from stragglers.errors import InputError
from stragglers.file_claim import FileClaim, Held, claim_file
from stragglers.monitor.store_base import SQLStore, StoreClosed

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job TEXT PRIMARY KEY, directory TEXT NOT NULL, way TEXT NOT NULL, meta TEXT,
    state TEXT NOT NULL DEFAULT 'running', created_at REAL NOT NULL, last_part_at REAL,
    finished_at REAL, closed INTEGER NOT NULL DEFAULT 0, part_seq INTEGER NOT NULL DEFAULT 0,
    run INTEGER NOT NULL DEFAULT 0, meta_seq INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS parts (
    job TEXT NOT NULL, rank INTEGER NOT NULL, part INTEGER NOT NULL, records INTEGER NOT NULL,
    first_step INTEGER NOT NULL, last_step INTEGER NOT NULL, bytes INTEGER NOT NULL,
    way TEXT NOT NULL, ingested_at REAL NOT NULL, digest TEXT, seq INTEGER, step_set TEXT,
    PRIMARY KEY (job, rank, part)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS windows (
    job TEXT NOT NULL, idx INTEGER NOT NULL, first_step INTEGER NOT NULL,
    last_step INTEGER NOT NULL, steps TEXT NOT NULL, slowdown REAL, waste REAL, t_base REAL,
    t_ideal REAL, sim_error REAL, m_w REAL, m_s REAL, scores TEXT NOT NULL,
    diagnosis TEXT NOT NULL, missing_ranks TEXT NOT NULL, error TEXT, reason TEXT NOT NULL,
    closed_at REAL NOT NULL,
    analysed_at REAL NOT NULL, analysis_s REAL NOT NULL, notes TEXT NOT NULL DEFAULT '[]',
    PRIMARY KEY (job, idx)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS alerts (
    fingerprint TEXT PRIMARY KEY, rule TEXT NOT NULL, job TEXT NOT NULL, labels TEXT NOT NULL,
    annotations TEXT NOT NULL, status TEXT NOT NULL, starts_at REAL NOT NULL, ends_at REAL,
    last_sent REAL NOT NULL);
CREATE TABLE IF NOT EXISTS alert_log (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, fingerprint TEXT NOT NULL,
    job TEXT NOT NULL, rule TEXT NOT NULL, status TEXT NOT NULL, severity TEXT NOT NULL,
    summary TEXT NOT NULL, description TEXT NOT NULL, window INTEGER);
CREATE INDEX IF NOT EXISTS alert_log_job ON alert_log (job, id);
CREATE INDEX IF NOT EXISTS parts_tail ON parts (job, last_step, bytes);
CREATE TABLE IF NOT EXISTS upload_drops (
    job TEXT NOT NULL, rank INTEGER NOT NULL, dropped INTEGER NOT NULL,
    PRIMARY KEY (job, rank)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS leases (
    job TEXT PRIMARY KEY, owner TEXT, epoch INTEGER NOT NULL DEFAULT 0, expires_at REAL,
    taken_at REAL);
CREATE TABLE IF NOT EXISTS instances (
    id TEXT PRIMARY KEY, url TEXT NOT NULL, started_at REAL NOT NULL, seen_at REAL NOT NULL,
    expires_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS ingest_marks (
    instance TEXT PRIMARY KEY, as_of REAL NOT NULL, oldest REAL);
CREATE TABLE IF NOT EXISTS alert_outbox (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job TEXT NOT NULL, fingerprint TEXT NOT NULL,
    status TEXT NOT NULL, sent_at REAL NOT NULL, alert TEXT NOT NULL, created_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, claimed_by TEXT, claim_until REAL,
    delivered_by TEXT, delivered_at REAL, failed_at REAL, UNIQUE (fingerprint, status, sent_at));
CREATE INDEX IF NOT EXISTS alert_outbox_due ON alert_outbox (delivered_at, failed_at, id);
CREATE TABLE IF NOT EXISTS store_info (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""

# columns added since the first stores: (table, column, declaration)
ADDED_COLUMNS = (("parts", "digest", "TEXT"), ("parts", "seq", "INTEGER"),
                 ("parts", "step_set", "TEXT"),
                 ("jobs", "part_seq", "INTEGER NOT NULL DEFAULT 0"),
                 ("jobs", "run", "INTEGER NOT NULL DEFAULT 0"),
                 ("jobs", "meta_seq", "INTEGER NOT NULL DEFAULT 0"),
                 ("jobs", "superseded", "TEXT"),
                 ("windows", "notes", "TEXT NOT NULL DEFAULT '[]'"))


class _Connection(sqlite3.Connection):
    """A connection a WeakSet can hold (sqlite3.Connection itself takes no weak reference),
    with the count of reads running on it (see `SQLiteStore.close`)."""

    users = 0


class SQLiteStore(SQLStore):
    """Jobs, parts, windows and alerts in one SQLite file (WAL)."""

    def __init__(self, path: str | Path, durable: bool = True):
        super().__init__()
        self.path = str(path)
        if self.path in ("", ":memory:") or self.path.startswith("file:"):
            # each connection (the writer's, every reader's) would open a database of its own,
            # empty: the service said it served, then died 'no such table'
            raise InputError(self.path or "''", None, "not a file path; expected the store's "
                             "file (it must outlive the process, and every connection opens it)")
        self.transient_errors = (sqlite3.OperationalError,)
        self._claim: FileClaim | None = None   # the flock of `serve_alone`
        self._lock = threading.Lock()
        self._local = threading.local()
        # every thread's reading connection, closed with the store: those of threads still
        # alive (the one that started and stopped the service among them) kept the file and
        # its WAL open, 4 descriptors a stopped service (weak: a thread's ends with it)
        self._readers: weakref.WeakSet[_Connection] = weakref.WeakSet()
        self._readers_lock = threading.Lock()   # (guards _readers, each one's users, _closed)
        self._closed = False
        try:
            self._db = self._connect()
            self._db.execute("PRAGMA journal_mode=WAL")
            # FULL: the WAL is fsynced at every commit, so what was acknowledged survives power
            # loss; NORMAL survives a killed process (the WAL is still on disk), not a power cut.
            self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._migrate()
        except sqlite3.DatabaseError as exc:   # another kind of file, a damaged store, or
            # one that cannot be written now (a WAL past a full disk once read as "not a
            # usable SQLite database", which sent the operator after a good store)
            raise InputError(path, None, _open_problem(exc, self.path)) from None

    def _migrate(self) -> None:
        """Create the tables; add the columns a store from an earlier version lacks."""
        self._db.executescript(SCHEMA)
        for table, column, declaration in ADDED_COLUMNS:
            have = {r[1] for r in self._db.execute(f"PRAGMA table_info({table})")}
            if column not in have:
                self._db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {declaration}")
        # (no index on (job, seq): one instance never reads other instances' parts by their
        # sequence, service._follow_store, and the index cost every insert ~20%)
        self._db.execute("DROP INDEX IF EXISTS parts_seq")
        # jobs stored before leases: each gets its (free) lease
        self._db.execute("INSERT INTO leases (job) SELECT job FROM jobs WHERE true "
                         "ON CONFLICT (job) DO NOTHING")

    def _connect(self) -> _Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                             timeout=30.0, factory=_Connection)
        assert isinstance(db, _Connection)   # (the factory's class; typeshed says Connection)
        db.row_factory = sqlite3.Row
        return db

    def _reader(self) -> _Connection:
        """This thread's reading connection, counted in use until `_done` (a closed store
        refuses: StoreClosed)."""
        with self._readers_lock:
            if self._closed:
                raise StoreClosed(self.path)
            db = getattr(self._local, "db", None)
            if db is None:
                db = self._local.db = self._connect()
                self._readers.add(db)
            db.users += 1
            return db

    def _done(self, db: _Connection) -> None:
        """A read on `db` ended: if the store was closed meanwhile, this thread closes it."""
        with self._readers_lock:
            db.users -= 1
            if self._closed and db.users == 0:
                db.close()
                self._local.db = None

    def close(self) -> None:
        """Close every connection, the writing one last (the last to close folds the WAL
        back into the file), and give up the claim of `serve_alone`. A reading connection in
        use is closed by its own thread when its read ends: closing a connection another
        thread is reading through crashed the process (SIGSEGV; the app's reader threads and
        the ingest's worker threads are not joined at a stop)."""
        with self._readers_lock:
            self._closed = True
            for db in list(self._readers):
                if db.users == 0:
                    db.close()
            self._readers.clear()
            self._local.db = None
        with self._lock:
            self._db.close()
            if self._claim is not None:
                self._claim.close()   # (the lock goes with the descriptor)
                self._claim = None

    def serve_alone(self) -> None:
        """An exclusive lock on the store's file for as long as this store is open: a second
        monitor on the same file (a restart that overlapped, a second unit by mistake) started
        silently and took every lease too, so parts one acknowledged the other never analysed.
        (flock, apart from the POSIX locks SQLite takes on the same file; a refused claim keeps
        its descriptor: stragglers.file_claim.)"""
        try:
            self._claim = claim_file(self.path)
        except Held:
            raise InputError(self.path, None, "served by another monitor already (one "
                             "monitor serves a SQLite store: stop the other first; instances "
                             "that share a store use PostgreSQL)") from None
        except OSError as exc:
            raise InputError(self.path, None, f"cannot open the store to claim it "
                             f"({exc.strerror})") from None

    def _write(self, fn, notify: bool = True):
        with self._lock:
            if self._closed:   # (set before the writer closes, under this lock)
                raise StoreClosed(self.path)
            try:
                self._db.execute("BEGIN IMMEDIATE")
                try:
                    out = fn(self._db)
                except BaseException:
                    if self._db.in_transaction:
                        self._db.execute("ROLLBACK")
                    raise
                self._db.execute("COMMIT")
            except sqlite3.DatabaseError as exc:
                # a full disk (or file-size limit) as the OSError it is: answered 507, not
                # 503 (SQLite says "disk I/O error" for a write refused with EFBIG)
                full = _full(exc, self.path)
                if self._db.in_transaction:
                    try:
                        self._db.execute("ROLLBACK")
                    except sqlite3.Error:
                        pass
                if full is not None:
                    raise full from exc
                raise
            if notify:
                self.version += 1
        if notify:
            self._notify()
        return out

    def _rows(self, sql: str, args: Iterable = ()) -> list[dict]:
        db = self._reader()
        try:
            return [dict(r) for r in db.execute(sql, tuple(args))]
        finally:
            self._done(db)


SQLITE_FULL, SQLITE_IOERR, SQLITE_BUSY, SQLITE_LOCKED, SQLITE_READONLY, SQLITE_CANTOPEN, \
    SQLITE_PERM = 13, 10, 5, 6, 8, 14, 3
ROOM = 1 << 20   # a disk with less free than this cannot take a commit of the store's


def _no_room(path: str) -> str | None:
    """Why the store's files cannot grow now (a full disk, a file-size limit), or None."""
    folder = Path(path).resolve().parent
    try:
        if shutil.disk_usage(folder).free < ROOM:
            return f"the disk holding {folder} is full"
    except OSError:
        pass
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        sizes = [os.path.getsize(p) for p in (path, path + "-wal", path + "-shm")
                 if os.path.exists(p)]
        if max(sizes, default=0) + ROOM >= limit:
            return f"a file of the store is at this process's file-size limit ({limit} bytes, " \
                   "ulimit -f)"
    return None


def _code(exc: sqlite3.Error) -> int | None:
    code = getattr(exc, "sqlite_errorcode", None)
    return None if code is None else code & 0xFF   # the primary code of an extended one


def _full(exc: sqlite3.Error, path: str) -> OSError | None:
    """An OSError (ENOSPC) for a write refused for room: SQLITE_FULL, or an I/O error while
    the disk is full or a store file at the file-size limit; None for anything else."""
    code = _code(exc)
    if code not in (SQLITE_FULL, SQLITE_IOERR):
        return None
    why = _no_room(path)
    if why is None and code != SQLITE_FULL:
        return None   # an I/O error with room left: the disk itself (503)
    return OSError(errno.ENOSPC, f"the store {path} cannot be written: {why or 'disk full'}")


def _open_problem(exc: sqlite3.DatabaseError, path: str) -> str:
    """What is wrong with a store that did not open, and what to do about it."""
    code = _code(exc)
    why = _no_room(path) if code in (SQLITE_FULL, SQLITE_IOERR) else None
    if code == SQLITE_FULL or why is not None:
        return f"cannot be written ({exc}): {why or 'the disk is full'}; free space (or raise " \
               "the limit) and start again: the store and its write-ahead log are kept, " \
               "nothing is lost"
    if code == SQLITE_IOERR:
        return f"cannot be read or written ({exc}); check the disk (the store's files are " \
               "kept as they are)"
    if code in (SQLITE_READONLY, SQLITE_CANTOPEN, SQLITE_PERM):
        return f"cannot be opened for writing ({exc}); the monitor needs to write the file " \
               "and its folder (its -wal and -shm files live next to it)"
    if code in (SQLITE_BUSY, SQLITE_LOCKED):
        return f"is locked by another process ({exc}); one monitor uses a SQLite store at a " \
               "time (several instances share a postgresql:// store)"
    return f"not a usable SQLite database ({exc}); expected the monitor's store or a path " \
           "for a new one"
