"""The monitor's store: one SQLite file in WAL mode holding jobs, parts, windows and alerts.

Writes go through one connection under a lock (one writer, as SQLite wants); every reading
thread gets its own connection, which WAL lets read while a write is in progress. A part's
identity is (job, rank, part): the primary key makes a part seen twice count once.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Iterable

from stragglers.errors import InputError

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job TEXT PRIMARY KEY, directory TEXT NOT NULL, way TEXT NOT NULL, meta TEXT,
    state TEXT NOT NULL DEFAULT 'running', created_at REAL NOT NULL, last_part_at REAL,
    finished_at REAL, closed INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS parts (
    job TEXT NOT NULL, rank INTEGER NOT NULL, part INTEGER NOT NULL, records INTEGER NOT NULL,
    first_step INTEGER NOT NULL, last_step INTEGER NOT NULL, bytes INTEGER NOT NULL,
    way TEXT NOT NULL, ingested_at REAL NOT NULL, digest TEXT,
    PRIMARY KEY (job, rank, part)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS windows (
    job TEXT NOT NULL, idx INTEGER NOT NULL, first_step INTEGER NOT NULL,
    last_step INTEGER NOT NULL, steps TEXT NOT NULL, slowdown REAL, waste REAL, t_base REAL,
    t_ideal REAL, sim_error REAL, m_w REAL, m_s REAL, scores TEXT NOT NULL,
    diagnosis TEXT NOT NULL, missing_ranks TEXT NOT NULL, error TEXT, reason TEXT NOT NULL,
    closed_at REAL NOT NULL,
    analysed_at REAL NOT NULL, analysis_s REAL NOT NULL, PRIMARY KEY (job, idx)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS alerts (
    fingerprint TEXT PRIMARY KEY, rule TEXT NOT NULL, job TEXT NOT NULL, labels TEXT NOT NULL,
    annotations TEXT NOT NULL, status TEXT NOT NULL, starts_at REAL NOT NULL, ends_at REAL,
    last_sent REAL NOT NULL);
CREATE TABLE IF NOT EXISTS alert_log (
    id INTEGER PRIMARY KEY AUTOINCREMENT, at REAL NOT NULL, fingerprint TEXT NOT NULL,
    job TEXT NOT NULL, rule TEXT NOT NULL, status TEXT NOT NULL, severity TEXT NOT NULL,
    summary TEXT NOT NULL, description TEXT NOT NULL, window INTEGER);
CREATE INDEX IF NOT EXISTS alert_log_job ON alert_log (job, id);
CREATE TABLE IF NOT EXISTS upload_drops (
    job TEXT NOT NULL, rank INTEGER NOT NULL, dropped INTEGER NOT NULL,
    PRIMARY KEY (job, rank)) WITHOUT ROWID;
"""

WINDOW_SUMMARY = ("idx", "first_step", "last_step", "slowdown", "waste", "m_w", "m_s", "error",
                  "reason", "closed_at", "analysed_at", "analysis_s")


class JobConflict(Exception):
    """A job name already belongs to another directory."""


class Store:
    """Jobs, parts, windows and alerts in one SQLite file (WAL)."""

    def __init__(self, path: str | Path, durable: bool = True):
        self.path = str(path)
        self._lock = threading.Lock()
        self._local = threading.local()
        try:
            self._db = self._connect()
            self._db.execute("PRAGMA journal_mode=WAL")
            # FULL: the WAL is fsynced at every commit, so what was acknowledged survives power
            # loss; NORMAL survives a killed process (the WAL is still on disk), not a power cut.
            self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._db.executescript(SCHEMA)
            # stores from before uploads were fingerprinted: add the column (NULL = not known)
            if "digest" not in {r[1] for r in self._db.execute("PRAGMA table_info(parts)")}:
                self._db.execute("ALTER TABLE parts ADD COLUMN digest TEXT")
        except sqlite3.DatabaseError as exc:   # another kind of file, or a damaged store
            raise InputError(path, None, f"not a usable SQLite database ({exc}); expected the "
                             "monitor's store or a path for a new one") from None
        self.version = 0  # bumped on every write; pages poll it to skip unchanged reads
        self._listeners: list = []

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None,
                             timeout=30.0)
        db.row_factory = sqlite3.Row
        return db

    def _reader(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = self._connect()
        return db

    def close(self) -> None:
        """Close the writing connection."""
        with self._lock:
            self._db.close()

    def _write(self, fn):
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                out = fn(self._db)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
            self.version += 1
        for listener in list(self._listeners):
            try:
                listener(self.version)
            except Exception:  # a listener (the dashboard's event stream) must not fail a write
                log.exception("store change listener failed")
        return out

    def on_change(self, listener) -> None:
        """Call `listener(version)` after every committed write (from the writing thread)."""
        self._listeners.append(listener)

    def _rows(self, sql: str, args: Iterable = ()) -> list[dict]:
        return [dict(r) for r in self._reader().execute(sql, tuple(args))]

    # ---- jobs -------------------------------------------------------------------------------

    def register_job(self, job: str, directory: str, way: str, meta: dict | None,
                     now: float | None = None) -> bool:
        """Create or update a job; JobConflict when the name belongs to another directory."""
        now = time.time() if now is None else now
        meta_text = None if meta is None else json.dumps(meta, sort_keys=True)

        def tx(db):
            row = db.execute("SELECT directory, meta FROM jobs WHERE job = ?", (job,)).fetchone()
            if row is None:
                db.execute("INSERT INTO jobs (job, directory, way, meta, created_at) "
                           "VALUES (?, ?, ?, ?, ?)", (job, directory, way, meta_text, now))
                return True
            if row["directory"] != directory:
                raise JobConflict(f"job name {job!r} already belongs to {row['directory']}")
            if meta_text is not None and meta_text != row["meta"]:
                db.execute("UPDATE jobs SET meta = ? WHERE job = ?", (meta_text, job))
            return False

        return self._write(tx)

    def reset_job(self, job: str, meta: dict, alert_rows: list[dict],
                  log_rows: list[dict]) -> None:
        """A new run of a job: its parts, windows and upload drop counts go, its metadata is
        replaced, and its alerts resolve (alert_rows, log_rows), in one transaction."""
        meta_text = json.dumps(meta, sort_keys=True)

        def tx(db):
            for table in ("parts", "windows", "upload_drops"):
                db.execute(f"DELETE FROM {table} WHERE job = ?", (job,))
            db.execute("UPDATE jobs SET meta = ?, state = 'running', last_part_at = NULL, "
                       "finished_at = NULL, closed = 0, created_at = ? WHERE job = ?",
                       (meta_text, time.time(), job))
            self._alert_changes(db, alert_rows, log_rows)

        self._write(tx)

    def set_job_state(self, job: str, state: str, closed: bool | None = None,
                      finished_at: float | None = None) -> None:
        """Record a job's state (running, stalled, finished)."""
        def tx(db):
            db.execute("UPDATE jobs SET state = ?, finished_at = COALESCE(?, finished_at), "
                       "closed = COALESCE(?, closed) WHERE job = ?",
                       (state, finished_at, None if closed is None else int(closed), job))
        self._write(tx)

    def job(self, job: str) -> dict | None:
        """One job's row (meta decoded), or None."""
        rows = self._rows("SELECT * FROM jobs WHERE job = ?", (job,))
        if not rows:
            return None
        row = rows[0]
        # a row that does not decode comes back as its text: check_meta refuses it and the
        # job is quarantined (Monitor), rather than every read of the store failing
        row["meta"] = _loads(row["meta"], row["meta"]) if row["meta"] else None
        return row

    def jobs(self) -> list[dict]:
        """Every job with its latest window's S and its open alerts, newest activity first."""
        rows = self._rows(
            "SELECT j.job, j.directory, j.way, j.meta, j.state, j.created_at, j.last_part_at, "
            "j.finished_at, w.idx AS window, w.slowdown, w.analysed_at, "
            "(SELECT COUNT(*) FROM alerts a WHERE a.job = j.job AND a.status = 'firing') "
            "AS open_alerts, (SELECT COALESCE(SUM(dropped), 0) FROM upload_drops d "
            "WHERE d.job = j.job) AS upload_dropped "
            "FROM jobs j LEFT JOIN windows w ON w.job = j.job AND w.idx = "
            "(SELECT MAX(idx) FROM windows WHERE job = j.job) "
            "ORDER BY COALESCE(j.last_part_at, j.created_at) DESC")
        for r in rows:
            meta = _loads(r.pop("meta"), {}) if r["meta"] else {}
            meta = meta if isinstance(meta, dict) else {}
            r["world_size"] = meta.get("world_size")
            r["dp"], r["pp"] = meta.get("dp_size"), meta.get("pp_size")
        return rows

    # ---- parts ------------------------------------------------------------------------------

    def add_parts(self, rows: list[tuple], now: float | None = None) -> list[bool]:
        """Insert parts (job, rank, part, records, first_step, last_step, bytes, way[, digest])
        in one transaction; returns for each whether it was new (False: seen before, not
        counted). digest: the uploaded bytes' fingerprint (None for watched files)."""
        now = time.time() if now is None else now

        def tx(db):
            new = []
            for r in rows:
                cur = db.execute(
                    "INSERT OR IGNORE INTO parts (job, rank, part, records, first_step, "
                    "last_step, bytes, way, ingested_at, digest) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (*r[:8], now, r[8] if len(r) > 8 else None))
                new.append(cur.rowcount == 1)
            for job in {r[0] for r, n in zip(rows, new) if n}:
                db.execute("UPDATE jobs SET last_part_at = ? WHERE job = ?", (now, job))
            return new

        return self._write(tx)

    def has_part(self, job: str, rank: int, part: int) -> bool:
        """Whether this part was stored already."""
        return bool(self._rows("SELECT 1 FROM parts WHERE job = ? AND rank = ? AND part = ?",
                               (job, rank, part)))

    def part_digest(self, job: str, rank: int, part: int) -> str | None:
        """The stored fingerprint of an uploaded part (None: not stored, or not known)."""
        rows = self._rows("SELECT digest FROM parts WHERE job = ? AND rank = ? AND part = ?",
                          (job, rank, part))
        return rows[0]["digest"] if rows else None

    def parts(self, job: str, after_step: int = -1) -> list[dict]:
        """A job's parts that hold steps after `after_step` (for rebuilding after a restart)."""
        return self._rows("SELECT rank, part, records, first_step, last_step, ingested_at, way "
                          "FROM parts WHERE job = ? AND last_step > ? ORDER BY rank, part",
                          (job, after_step))

    def part_index(self, job: str) -> list[dict]:
        """(rank, part, last_step, ingested_at) of every part of a job."""
        return self._rows("SELECT rank, part, last_step, ingested_at FROM parts WHERE job = ? "
                          "ORDER BY rank, part", (job,))

    def totals(self) -> dict:
        """Parts and op records stored, per way in and per job."""
        by_way = {r["way"]: {"parts": r["n"], "records": r["records"]} for r in self._rows(
            "SELECT way, COUNT(*) AS n, SUM(records) AS records FROM parts GROUP BY way")}
        by_job = {r["job"]: {"parts": r["n"], "records": r["records"]} for r in self._rows(
            "SELECT job, COUNT(*) AS n, SUM(records) AS records FROM parts GROUP BY job")}
        return {"by_way": by_way, "by_job": by_job}

    def set_upload_dropped(self, job: str, rank: int, dropped: int) -> None:
        """What an uploader reported it had to drop (buffer overflow) so far."""
        def tx(db):
            db.execute("INSERT INTO upload_drops VALUES (?, ?, ?) ON CONFLICT (job, rank) "
                       "DO UPDATE SET dropped = MAX(dropped, excluded.dropped)", (job, rank, dropped))
        self._write(tx)

    def upload_dropped(self, job: str) -> dict[int, int]:
        """Parts each rank's uploader dropped, as reported."""
        return {r["rank"]: r["dropped"] for r in self._rows(
            "SELECT rank, dropped FROM upload_drops WHERE job = ?", (job,))}

    # ---- windows and alerts -----------------------------------------------------------------

    def add_window(self, row: dict, alert_rows: list[dict], log_rows: list[dict]) -> None:
        """Store one analysed window with the alert changes it caused, in one transaction."""
        def tx(db):
            db.execute(
                "INSERT OR REPLACE INTO windows VALUES (:job, :idx, :first_step, :last_step, "
                ":steps, :slowdown, :waste, :t_base, :t_ideal, :sim_error, :m_w, :m_s, :scores, "
                ":diagnosis, :missing_ranks, :error, :reason, :closed_at, :analysed_at, :analysis_s)",
                {**row, "steps": json.dumps(row["steps"]), "scores": json.dumps(row["scores"]),
                 "diagnosis": json.dumps(row["diagnosis"]),
                 "missing_ranks": json.dumps(row["missing_ranks"])})
            self._alert_changes(db, alert_rows, log_rows)
        self._write(tx)

    def add_alert_changes(self, alert_rows: list[dict], log_rows: list[dict]) -> None:
        """Store alert changes not tied to a window (a job stalled)."""
        if alert_rows or log_rows:
            self._write(lambda db: self._alert_changes(db, alert_rows, log_rows))

    @staticmethod
    def _alert_changes(db, alert_rows: list[dict], log_rows: list[dict]) -> None:
        for a in alert_rows:
            db.execute("INSERT OR REPLACE INTO alerts VALUES (:fingerprint, :rule, :job, :labels, "
                       ":annotations, :status, :starts_at, :ends_at, :last_sent)",
                       {**a, "labels": json.dumps(a["labels"], sort_keys=True),
                        "annotations": json.dumps(a["annotations"], sort_keys=True)})
        for e in log_rows:
            db.execute("INSERT INTO alert_log (at, fingerprint, job, rule, status, severity, "
                       "summary, description, window) VALUES (:at, :fingerprint, :job, :rule, "
                       ":status, :severity, :summary, :description, :window)", e)

    def last_window(self, job: str) -> dict | None:
        """The latest window of a job (decoded), or None."""
        rows = self._rows("SELECT * FROM windows WHERE job = ? ORDER BY idx DESC LIMIT 1", (job,))
        return _decode_window(rows[0]) if rows else None

    def window(self, job: str, idx: int) -> dict | None:
        """One window of a job (decoded), or None."""
        rows = self._rows("SELECT * FROM windows WHERE job = ? AND idx = ?", (job, idx))
        return _decode_window(rows[0]) if rows else None

    def window_span(self, job: str) -> tuple[int, int | None]:
        """(how many windows the job has, the first one's index or None)."""
        n, first = self._reader().execute("SELECT count(*), min(idx) FROM windows WHERE job = ?",
                                          (job,)).fetchone()
        return int(n), first

    def windows(self, job: str, limit: int = 100_000) -> list[dict]:
        """Summaries (no scores, no diagnosis) of a job's windows, oldest first."""
        rows = self._rows(f"SELECT {', '.join(WINDOW_SUMMARY)}, diagnosis FROM windows "
                          "WHERE job = ? ORDER BY idx DESC LIMIT ?", (job, limit))
        for r in rows:
            found = _loads(r.pop("diagnosis"), [])
            # each cause once (a cause found at two places is two findings, one cause)
            r["causes"] = list(dict.fromkeys(f.get("cause") for f in found if isinstance(f, dict))) \
                if isinstance(found, list) else []
        return rows[::-1]

    def recent_windows(self, job: str, count: int) -> list[dict]:
        """The last `count` windows of a job (decoded), newest first."""
        rows = self._rows("SELECT * FROM windows WHERE job = ? ORDER BY idx DESC LIMIT ?",
                          (job, count))
        return [_decode_window(r) for r in rows]

    def alerts(self, job: str | None = None, status: str | None = None) -> list[dict]:
        """Current alert states (firing or resolved), optionally of one job / one status."""
        sql, args = "SELECT * FROM alerts WHERE 1 = 1", []
        if job is not None:
            sql, args = sql + " AND job = ?", [*args, job]
        if status is not None:
            sql, args = sql + " AND status = ?", [*args, status]
        rows = self._rows(sql + " ORDER BY starts_at", args)
        for r in rows:
            r["labels"], r["annotations"] = _loads(r["labels"], {}), _loads(r["annotations"], {})
        return rows

    def alert_log(self, job: str | None = None, limit: int = 200) -> list[dict]:
        """Alert transitions (firing, resolved), newest first."""
        if job is None:
            return self._rows("SELECT * FROM alert_log ORDER BY id DESC LIMIT ?", (limit,))
        return self._rows("SELECT * FROM alert_log WHERE job = ? ORDER BY id DESC LIMIT ?",
                          (job, limit))


def _decode_window(row: dict) -> dict:
    for key in ("steps", "scores", "diagnosis", "missing_ranks"):
        row[key] = _loads(row[key], [])
        if not isinstance(row[key], list):
            row[key] = []
    return row


def _loads(text, default):
    """Stored JSON decoded; `default` for text that does not decode (a damaged row is shown
    as empty, not a failure of every read)."""
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError):
        log.warning("store: a stored value does not decode as JSON: %.80r", text)
        return default


