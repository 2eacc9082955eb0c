"""The monitor's store interface, its queries written once for SQLite and PostgreSQL.

`SQLStore` holds every query (jobs, parts, windows, alerts, leases, the alert outbox); a
backend (store_sqlite.SQLiteStore, store_postgres.PostgresStore) supplies the connection, the
schema, its clock and the few words the two dialects spell differently. Queries are written with
`?` and `:name` parameters; the PostgreSQL backend rewrites them to psycopg's.
"""

from __future__ import annotations

import errno
import json
import logging
import time
import uuid
from typing import Any, Callable, Iterable, TypeVar

import msgspec

from stragglers.monitor import fast_state
from stragglers.monitor.records import Alert, AlertLogEntry, ClaimedMessage, IngestMark, \
    JobMark, JobRecord, JobSummary, Lease, LeaseRow, OutboxRow, PartCount, PartIndex, PartRow, \
    WindowFinding, WindowRow, WindowScore, WindowSummary, plain, sorted_json

from stragglers.monitor.replaced import MAX_SUPERSEDED  # noqa: F401 (named by tests, docs)
from stragglers.monitor.replaced import read as read_replaced, was_replaced, with_replaced
from stragglers.monitor.windows import MAX_NOTES

log = logging.getLogger(__name__)

WINDOW_SUMMARY = ("idx", "first_step", "last_step", "slowdown", "waste", "m_w", "m_s", "error",
                  "reason", "closed_at", "analysed_at", "analysis_s")
WINDOW_COLUMNS = ("job", "idx", "first_step", "last_step", "steps", "slowdown", "waste",
                  "t_base", "t_ideal", "sim_error", "m_w", "m_s", "scores", "diagnosis",
                  "missing_ranks", "error", "reason", "closed_at", "analysed_at", "analysis_s",
                  "notes")
# a window's columns kept as JSON text, and the type of their items
_WINDOW_JSON: dict[str, Any] = {"steps": int, "scores": WindowScore, "diagnosis": WindowFinding,
                                "missing_ranks": int, "notes": str}
# characters of one note line read back (windows.MAX_NOTES lines at most): a stored row (a
# damaged store, an older version, a hand edit) of 10 MB or 100,000 lines went out whole
NOTE_CHARS = 4_000
ALERT_COLUMNS = ("fingerprint", "rule", "job", "labels", "annotations", "status", "starts_at",
                 "ends_at", "last_sent")


PROBE_KEY = "probe:"   # store_info key of an instance's uploads-folder probe (+ its id)
KEEP_S = 86400.0   # dead instances' rows and delivered messages are kept this long
# bytes of a job's parts past a step: served by the index parts_tail (job, last_step, bytes), so
# it visits the tail's rows alone (read after every stored window, it scanned every part row of
# the job: 0.35 s at 1,024 ranks x 1,000 windows, on the ingest thread). The step is a value,
# not a subquery: PostgreSQL planned a subquery's bound as a third of the rows, a scan.
# (Sums are taken as doubles, here and below: they cannot overflow. One damaged part row of
# 2^63-1 overflowed an integer SUM, SQLite's and PostgreSQL's BIGINT alike, and that read
# failed for good: /api/stats 503, every stats or job-list read.)
JOB_BYTES_SQL = ("SELECT COALESCE(SUM(CAST(bytes AS DOUBLE PRECISION)), 0) AS n FROM parts "
                 "WHERE job = ? AND last_step > ?")
T = TypeVar("T")


class _JobDir(msgspec.Struct):
    directory: str
    meta: str | None
    way: str = ""
    superseded: str | None = None


class _Count(msgspec.Struct):
    n: int


class _Sum(msgspec.Struct):
    n: float


def _whole(total: float) -> int:
    """A sum taken as a double as the count it is (a damaged row's infinity: the most)."""
    return int(min(total, 2.0 ** 63 - 1)) if total == total else 0


class _Name(msgspec.Struct):
    job: str


class _Value(msgspec.Struct):
    value: str


class _Probe(msgspec.Struct):
    instance: str
    probe: str


class _PartDigest(msgspec.Struct):
    rank: int
    part: int
    digest: str


class _Seq(msgspec.Struct):
    part_seq: int
    meta_seq: int = 0


STALE = "stale"   # add_parts: the job's metadata changed since its parts were checked
DAMAGED = "damaged"   # add_parts: the job's row does not read (its sequences): set it aside


class _Held(msgspec.Struct):
    job: str
    epoch: int


class _Lease(msgspec.Struct):
    owner: str | None
    epoch: int
    expires_at: float | None = None


class _Claimed(msgspec.Struct):
    id: int
    job: str
    fingerprint: str
    status: str
    alert: str
    attempts: int


class _Totals(msgspec.Struct):
    key: str
    n: int
    records: float


class _Span(msgspec.Struct):
    n: int
    first: int | None


class _Dropped(msgspec.Struct):
    rank: int
    dropped: int


class JobShape(msgspec.Struct):
    """The job's shape as its meta.json gives it (the job list shows it)."""

    world_size: int | None = None
    dp_size: int | None = None
    pp_size: int | None = None


def job_shape(meta: Any) -> JobShape:
    """The shape of stored metadata (none where it is not a mapping of ints)."""
    try:
        return msgspec.convert(meta, JobShape)
    except msgspec.ValidationError:
        return JobShape()


class JobConflict(Exception):
    """A job name already belongs to another directory."""


class LeaseLost(Exception):
    """This instance no longer holds the job's lease: another one analyses it now."""


class StoreClosed(RuntimeError):
    """The store was closed (its service stopped): nothing is read or written any more."""

    def __init__(self, path: str):
        super().__init__(f"{path}: the monitor's store is closed (its service stopped); "
                         "nothing was read or written")


class SQLStore:
    """Jobs, parts, windows, alerts, leases and the alert outbox (see the module docstring)."""

    # set by the backend
    path: str = ""             # the SQLite file, or the PostgreSQL URL without its password
    shared: bool = False       # several instances may use this store at once
    FOR_UPDATE = ""            # row locks (PostgreSQL); SQLite's writer lock covers them
    SKIP_LOCKED = ""

    transient_errors: tuple[type[Exception], ...] = ()   # a write worth retrying (busy, locked)

    def __init__(self) -> None:
        self.version = 0  # bumped on every write seen; pages poll it to skip unchanged reads
        self._listeners: list[Callable[[int], None]] = []
        self._damaged_seen: set[tuple[str, str]] = set()   # damaged rows named in the log
        self.damaged_messages = 0   # outbox messages set aside as damaged (not sendable)

    # ---- what a backend provides ------------------------------------------------------------

    def _write(self, fn: Callable[[Any], T], notify: bool = True) -> T:
        """Run fn(db) in one write transaction; its result (then, with `notify`, listeners
        hear of the change)."""
        raise NotImplementedError

    def _rows(self, sql: str, args: Iterable[Any] | dict[str, Any] = ()) -> list[dict[str, Any]]:
        """Rows of a read, as dicts (the backend's; the store's methods return records)."""
        raise NotImplementedError

    def _typed(self, kind: type[T], sql: str, args: Iterable[Any] = ()) -> list[T]:
        """Rows of a read as records of `kind` (each column a field); a row that does not
        convert (damaged in the store: a blob for a text, text for a number) is left out and
        named once in the log: one such row failed every read of its table, and a job row's
        the start of the whole service."""
        rows = self._rows(sql, args)
        try:
            return msgspec.convert(rows, list[kind])  # type: ignore[valid-type]
        except msgspec.ValidationError:
            out = []
            for row in rows:
                try:
                    out.append(msgspec.convert(row, kind))
                except msgspec.ValidationError as exc:
                    self._damaged(kind.__name__, row, exc)
            return out

    def _damaged(self, kind: str, row: dict[str, Any], exc: Exception) -> None:
        """Log a stored row that does not read, once per table and problem."""
        key = (kind, str(exc))
        if key in self._damaged_seen or len(self._damaged_seen) > 1000:
            return
        self._damaged_seen.add(key)
        log.warning("store: a damaged %s row (job %r) is left out of reads: %s", kind,
                    str(row.get("job", "?"))[:80], exc)

    def _now(self, db: Any) -> float:
        """The time leases are measured in (the database's clock when shared)."""
        return time.time()

    def _exec(self, db: Any, sql: str, args: Iterable[Any] | dict[str, Any] = ()) -> Any:
        """Execute one statement in a write transaction; the cursor."""
        return db.execute(sql, args)

    def _one(self, db: Any, kind: type[T], sql: str, args: Iterable[Any] = ()) -> T | None:
        """The first row of a statement in a write transaction as a `kind`, or None."""
        row = self._exec(db, sql, args).fetchone()
        return None if row is None else msgspec.convert(dict(row), kind)

    def _one_or_damaged(self, db: Any, kind: type[T], sql: str, args: Iterable[Any] = ()
                        ) -> tuple[T | None, dict[str, Any] | None]:
        """The first row of a statement in a write transaction: (the `kind`, None), (None,
        None) when there is none, or (None, the row) when it does not convert (damaged in the
        store: named once in the log), for the caller to set that row aside: `_one` raised
        out of the transaction, and one such row rolled back every later one with it."""
        row = self._exec(db, sql, args).fetchone()
        if row is None:
            return None, None
        try:
            return msgspec.convert(dict(row), kind), None
        except msgspec.ValidationError as exc:
            self._damaged(kind.__name__, dict(row), exc)
            return None, dict(row)

    def _many(self, db: Any, kind: type[T], sql: str, args: Iterable[Any] = ()) -> list[T]:
        """Every row of a statement in a write transaction as `kind`s; a damaged row is left
        out and named in the log (a lease row of a job stored as a blob failed every
        heartbeat, so the service did not start)."""
        out = []
        for r in self._exec(db, sql, args).fetchall():
            try:
                out.append(msgspec.convert(dict(r), kind))
            except msgspec.ValidationError as exc:
                self._damaged(kind.__name__, dict(r), exc)
        return out

    def close(self) -> None:
        """Close the connections."""

    def serve_alone(self) -> None:
        """Claim the store for this process's service (SQLite: a file one monitor serves;
        InputError when another holds it). A shared store (PostgreSQL) takes several."""

    def on_change(self, listener: Callable[[int], None]) -> None:
        """Call `listener(version)` after every committed write (of any instance sharing the
        store, where the backend hears of them)."""
        self._listeners.append(listener)

    def _notify(self) -> None:
        """Tell the listeners the version it is now."""
        for listener in list(self._listeners):
            try:
                listener(self.version)
            except Exception:  # a listener (the dashboard's event stream) must not fail a write
                log.exception("store change listener failed")

    # ---- jobs -------------------------------------------------------------------------------

    def register_job(self, job: str, directory: str, way: str, meta: dict[str, Any] | None,
                     now: float | None = None, sizes_change: bool = False) -> bool:
        """Create or update a job; JobConflict when the name belongs to another directory, or
        when `sizes_change` (the new metadata moves ranks) and a part of it is stored: judged
        under the job row's lock, which add_parts takes too (another instance's part committed
        after this instance looked for parts was stored at sizes the job no longer had)."""
        now = time.time() if now is None else now
        meta_text = None if meta is None else json.dumps(meta, sort_keys=True)

        def tx(db: Any) -> bool:
            row = self._one(db, _JobDir, "SELECT directory, meta, way FROM jobs WHERE job = ?"
                            + self.FOR_UPDATE, (job,))
            if row is None:
                cur = self._exec(db, "INSERT INTO jobs (job, directory, way, meta, created_at) "
                                 "VALUES (?, ?, ?, ?, ?) ON CONFLICT (job) DO NOTHING",
                                 (job, directory, way, meta_text, now))
                self._exec(db, "INSERT INTO leases (job) VALUES (?) ON CONFLICT (job) DO NOTHING",
                           (job,))
                if cur.rowcount == 1:
                    return True
                row = self._one(db, _JobDir, "SELECT directory, meta, way FROM jobs WHERE "
                                "job = ?", (job,))
                assert row is not None   # the insert found it there
            # an uploaded job is the uploads folder's by its name: instances reaching a shared
            # folder by different paths announce one job (its row keeps the first path)
            if row.directory != directory and not (way == "http" and row.way == "http"):
                raise JobConflict(f"job name {job!r} already belongs to {row.directory}")
            if way == "http":   # a way the ingest never writes, repaired by the announcement
                self._exec(db, "UPDATE jobs SET way = ? WHERE job = ? AND way NOT IN "
                           "('http', 'files')", (way, job))
            if meta_text is not None and meta_text != row.meta:
                if sizes_change and self._exec(db, "SELECT 1 FROM parts WHERE job = ? LIMIT 1",
                                               (job,)).fetchone() is not None:
                    raise JobConflict(f"job {job!r}: its sizes or layout would change where "
                                      "parts of the run are stored (another instance stored "
                                      "one meanwhile); a run keeps its sizes")
                # (meta_seq: a part checked against the metadata before is not committed)
                self._exec(db, "UPDATE jobs SET meta = ?, meta_seq = meta_seq + 1 WHERE job = ?",
                           (meta_text, job))
            if way == "http" and meta is not None:
                # an uploaded job announced again before its first part: its expiry
                # (expire_empty_jobs) counts from now
                self._exec(db, "UPDATE jobs SET created_at = ? WHERE job = ? AND NOT EXISTS "
                           "(SELECT 1 FROM parts WHERE parts.job = ?)", (now, job, job))
            return False

        return self._write(tx)

    def move_job(self, job: str, old: str, new: str) -> bool:
        """A watched job's run directory renamed from `old` to `new` (the job, its parts,
        windows and alerts stay); False when its row names another directory now."""
        def tx(db: Any) -> bool:
            cur = self._exec(db, "UPDATE jobs SET directory = ? WHERE job = ? AND directory = ? "
                             "AND way = 'files'", (new, job, old))
            return bool(cur.rowcount == 1)

        return self._write(tx)

    def expire_empty_jobs(self, before: float, way: str) -> list[str]:
        """Delete the jobs that came in by `way`, were created (or announced again) before
        `before` and have no part (their lease and any other row with them); their names."""
        # a read first: a sweep that finds nothing costs no write transaction (an fsync)
        if not self._rows("SELECT 1 AS due FROM jobs WHERE way = ? AND created_at < ? AND NOT "
                          "EXISTS (SELECT 1 FROM parts WHERE parts.job = jobs.job) LIMIT 1",
                          (way, before)):
            return []

        def tx(db: Any) -> list[str]:
            # the jobs' rows locked first (add_parts holds its job's row until its parts are
            # committed), then parts looked for again by a statement that sees what committed
            # meanwhile: one DELETE judged the parts by its snapshot, and deleted a job whose
            # part another instance stored in the same instant (an orphan part row)
            due = [r.job for r in self._many(
                db, _Name, "SELECT job FROM jobs WHERE way = ? AND created_at < ? AND NOT "
                "EXISTS (SELECT 1 FROM parts WHERE parts.job = jobs.job) ORDER BY job"
                + self.FOR_UPDATE, (way, before))]
            gone: list[str] = []
            for i in range(0, len(due), 500):
                chunk = due[i:i + 500]
                gone += [r.job for r in self._many(
                    db, _Name, f"DELETE FROM jobs WHERE job IN ({', '.join('?' * len(chunk))}) "
                    "AND NOT EXISTS (SELECT 1 FROM parts WHERE parts.job = jobs.job) "
                    "RETURNING job", chunk)]
            for job in gone:
                for table in ("leases", "windows", "upload_drops", "alerts"):
                    self._exec(db, f"DELETE FROM {table} WHERE job = ?", (job,))
                fast_state.forget_job(self, db, job)
            return gone

        return self._write(tx)

    def store_id(self) -> str | None:
        """This store's id, made at its first start (an uploads folder is marked with it);
        None where it cannot be written now (a full disk: the monitor still starts)."""
        rows = self._typed(_Value, "SELECT value FROM store_info WHERE key = 'id'")
        if rows:
            return rows[0].value

        def tx(db: Any) -> str:
            self._exec(db, "INSERT INTO store_info (key, value) VALUES ('id', ?) ON CONFLICT "
                       "(key) DO NOTHING", (uuid.uuid4().hex,))
            row = self._one(db, _Value, "SELECT value FROM store_info WHERE key = 'id'")
            assert row is not None   # (inserted above, or by another instance first)
            return row.value

        try:
            return self._write(tx, notify=False)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                return None
            raise

    def has_uploaded_parts(self) -> bool:
        """Whether an uploaded job stored a part (its file lies in the uploads folder)."""
        return bool(self._typed(_Count, "SELECT CAST(COUNT(*) AS BIGINT) AS n FROM (SELECT 1 "
                                "FROM parts p JOIN jobs j ON j.job = p.job WHERE j.way = 'http' "
                                "LIMIT 1) AS one")[0].n)

    def uploaded_jobs(self) -> list[str]:
        """The names of the uploaded jobs not finished that stored parts (their parts may be
        read again; a finished job's never are)."""
        return [r.job for r in self._typed(_Name, "SELECT DISTINCT j.job FROM jobs j JOIN "
                                            "parts p ON p.job = j.job WHERE j.way = 'http' "
                                            "AND j.state <> 'finished' ORDER BY j.job")]

    def superseded(self, job: str) -> list[str]:
        """The run tokens the job's row lists as replaced by name, the last MAX_SUPERSEDED
        (none for a job unknown or damaged)."""
        rows = self._rows("SELECT superseded FROM jobs WHERE job = ?", (job,))
        return superseded_tokens(rows[0].get("superseded")) if rows else []

    def was_replaced(self, job: str, token: str) -> bool:
        """Whether a newer run of the job replaced the run of `token`, ever (replaced.py)."""
        rows = self._rows("SELECT superseded FROM jobs WHERE job = ?", (job,))
        return bool(rows) and was_replaced(rows[0].get("superseded"), token)

    def job_names(self) -> set[str]:
        """The names of every job stored."""
        return {r.job for r in self._typed(_Name, "SELECT job FROM jobs")}

    def job_bytes(self, job: str) -> int:
        """Bytes of the parts a job stored that hold steps not analysed yet (past its last
        window): those of windows analysed long ago counted too, and a long job's parts were
        refused for good once it had recorded max_job_bytes."""
        last = self._typed(_Count, "SELECT last_step AS n FROM windows WHERE job = ? ORDER BY "
                           "idx DESC LIMIT 1", (job,))
        rows = self._typed(_Sum, JOB_BYTES_SQL, (job, last[0].n if last else -1))
        return _whole(rows[0].n) if rows else 0

    def reset_job(self, job: str, meta: dict[str, Any], alert_rows: list[Alert],
                  log_rows: list[AlertLogEntry],
                  still_old: Callable[[Any], bool] | None = None,
                  token_of: Callable[[Any], str | None] | None = None,
                  directory: str | None = None, way: str | None = None) -> bool:
        """A new run of a job: its parts, windows and upload drop counts go, its metadata is
        replaced, and its alerts resolve (alert_rows, log_rows), in one transaction. With
        `still_old(stored_meta)`, only while it holds (two instances seeing one new run reset
        it once); False when it did not. With `token_of(stored_meta)`, the replaced run's
        token joins the job's superseded ones (replaced.with_replaced). With `directory` and
        `way`, the new run is registered there in the same transaction: JobConflict (nothing
        deleted) where register_job would refuse it."""
        meta_text = json.dumps(meta, sort_keys=True)

        def tx(db: Any) -> bool:
            row = self._one(db, _JobDir, "SELECT directory, meta, way, superseded FROM jobs "
                            "WHERE job = ?" + self.FOR_UPDATE, (job,))
            stored = None if row is None else _loads(row.meta, None)
            if still_old is not None and (row is None or not still_old(stored)):
                return False
            if row is not None and directory is not None and row.directory != directory \
                    and not (way == "http" and row.way == "http"):
                raise JobConflict(f"job name {job!r} already belongs to {row.directory}")
            if way == "http":   # (as register_job repairs it)
                self._exec(db, "UPDATE jobs SET way = ? WHERE job = ? AND way NOT IN "
                           "('http', 'files')", (way, job))
            for table in ("parts", "windows", "upload_drops"):
                self._exec(db, f"DELETE FROM {table} WHERE job = ?", (job,))
            fast_state.forget_job(self, db, job)   # (its alerts resolve below, every rank's)
            # in the job's row, not an instance's memory: a replaced run announcing itself
            # again after a restart, or to another instance, reset the newer run's windows away
            replaced = None if row is None else row.superseded
            token = None if token_of is None else token_of(stored)
            if token is not None:
                replaced = with_replaced(replaced, token)
            self._exec(db, "UPDATE jobs SET meta = ?, state = 'running', last_part_at = NULL, "
                       "finished_at = NULL, closed = 0, created_at = ?, run = run + 1, "
                       "meta_seq = meta_seq + 1, superseded = ? "
                       "WHERE job = ?", (meta_text, time.time(),
                                         replaced or None, job))
            self._alert_changes(db, alert_rows, log_rows)
            return True

        return self._write(tx)

    def set_job_state(self, job: str, state: str, closed: bool | None = None,
                      finished_at: float | None = None, lease: Lease | None = None,
                      alert_rows: list[Alert] | None = None,
                      log_rows: list[AlertLogEntry] | None = None) -> bool:
        """Record a job's state (running, stalled, finished) with the alert changes it caused
        (and their messages), in one transaction: a write refused leaves neither, so it is
        written again whole; with `lease`, only while it holds the job (False: not recorded)."""
        def tx(db: Any) -> bool:
            self._fence(db, job, lease)
            self._exec(db, "UPDATE jobs SET state = ?, finished_at = COALESCE(?, finished_at), "
                       "closed = COALESCE(?, closed) WHERE job = ?",
                       (state, finished_at, None if closed is None else int(closed), job))
            if alert_rows or log_rows:
                self._alert_changes(db, alert_rows or [], log_rows or [])
            return True
        return self._fenced(tx)

    def job(self, job: str) -> JobRecord | None:
        """One job's row (meta decoded), or None; msgspec.ValidationError for a damaged row
        (the monitor sets that job aside)."""
        rows = msgspec.convert(self._rows("SELECT * FROM jobs WHERE job = ?", (job,)),
                               list[JobRecord])
        if not rows:
            return None
        row = rows[0]
        # a row that does not decode comes back as its text: check_meta refuses it and the
        # job is quarantined (Monitor), rather than every read of the store failing
        row.meta = _loads(row.meta, row.meta) if row.meta else None
        return row

    def jobs(self) -> list[JobSummary]:
        """Every job with its latest window's S and its open alerts, newest activity first."""
        rows = self._rows(
            "SELECT j.job, j.directory, j.way, j.meta AS meta_text, j.state, j.created_at, "
            "j.last_part_at, "
            "j.finished_at, w.idx AS \"window\", w.slowdown, w.analysed_at, "
            "(SELECT COUNT(*) FROM alerts a WHERE a.job = j.job AND a.status = 'firing') "
            "AS open_alerts, (SELECT COALESCE(SUM(CAST(dropped AS DOUBLE PRECISION)), 0) "
            "FROM upload_drops d WHERE d.job = j.job) AS upload_dropped "
            "FROM jobs j LEFT JOIN windows w ON w.job = j.job AND w.idx = "
            "(SELECT MAX(idx) FROM windows WHERE job = j.job) "
            "ORDER BY COALESCE(j.last_part_at, j.created_at) DESC")
        out = []
        for r in rows:
            text = r.pop("meta_text")
            r["upload_dropped"] = _whole(float(r["upload_dropped"]))
            try:
                # checked, not trusted: a damaged row (a blob for the state, text for a time)
                # was listed as it read, which the job list could not show
                row = _job_summary(r)
                if row.state not in JOB_STATES:
                    raise msgspec.ValidationError(f"unknown state {row.state!r}")
            except msgspec.ValidationError as exc:
                self._damaged("job", r, exc)
                out.append(_unreadable_job(r))   # listed as quarantined, never left out
                continue
            shape = job_shape(_loads(text, {}) if text else {})
            out.append(msgspec.structs.replace(row, world_size=shape.world_size,
                                               dp=shape.dp_size, pp=shape.pp_size))
        return out

    def job_marks(self, jobs: Iterable[str]) -> dict[str, JobMark]:
        """job → its part sequence, run number and metadata text: what an owner compares to
        learn of parts, new runs and new metadata another instance stored."""
        jobs = list(jobs)
        if not jobs:
            return {}
        marks = ", ".join("?" * len(jobs))
        return {r.job: r for r in self._typed(
            JobMark, f"SELECT job, part_seq, run, meta, state, meta_seq FROM jobs WHERE job IN "
            f"({marks})",
            jobs)}

    # ---- parts ------------------------------------------------------------------------------

    def add_parts(self, rows: list[tuple[Any, ...]], now: float | None = None,
                  fence: dict[str, int] | None = None) -> list[bool | None | str]:
        """Insert parts (job, rank, part, records, first_step, last_step, bytes, way[, digest[,
        step_set[, heard]]]) in one transaction; returns for each whether it was new (False: seen before,
        not counted; None: its job is gone, or its row does not read, nothing stored). digest: the uploaded bytes'
        fingerprint (None for watched files); step_set: its distinct steps (step_sets.encode;
        None: not known, read from its file when needed); heard: when it arrived, for silence
        (stored as its ingested_at; None: `now`, the commit's time, later by the ingest's
        delays: another instance that follows the part judged silence from there). Each new part gets the next number of its job's
        part sequence (commits of one job's parts are ordered by its row's lock, so an owner
        reading `seq > n` misses none). `fence`: job → the meta_seq its parts were checked
        against; a job's metadata changed since (another instance's new run or sizes) stores
        none of its parts, each answered STALE (checked again by the caller)."""
        now = time.time() if now is None else now
        fence = fence or {}

        def tx(db: Any) -> list[bool | None | str]:
            seqs, stale, damaged = {}, set(), set()
            for job in sorted({r[0] for r in rows}):   # locks in one order: no deadlock
                # (a job row whose sequences do not read, damaged while serving, stores none
                # of its parts, answered as a job gone: it raised out of the transaction, and
                # every part of the batch, every job's, was refused 500 with it)
                row, bad = self._one_or_damaged(db, _Seq, "SELECT part_seq, meta_seq FROM "
                                                "jobs WHERE job = ?" + self.FOR_UPDATE, (job,))
                if bad is not None:
                    damaged.add(job)
                    continue
                if row is None:   # (expired by another instance's sweep)
                    continue
                if job in fence and fence[job] != row.meta_seq:
                    stale.add(job)
                else:
                    seqs[job] = row.part_seq
            new: list[bool | None | str] = []
            touched = set()
            for r in rows:
                if r[0] in stale or r[0] in damaged:
                    new.append(STALE if r[0] in stale else DAMAGED)
                    continue
                if r[0] not in seqs:
                    new.append(None)
                    continue
                seq = seqs[r[0]] + 1
                cur = self._exec(
                    db, "INSERT INTO parts (job, rank, part, records, first_step, last_step, "
                    "bytes, way, ingested_at, digest, seq, step_set) VALUES "
                    "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT (job, rank, part) DO NOTHING",
                    (*r[:8], r[10] if len(r) > 10 and r[10] is not None else now,
                     r[8] if len(r) > 8 else None, seq, r[9] if len(r) > 9 else None))
                new.append(cur.rowcount == 1)
                if new[-1]:
                    seqs[r[0]] = seq
                    touched.add(r[0])
            for job in sorted(touched):
                self._exec(db, "UPDATE jobs SET last_part_at = ?, part_seq = ? WHERE job = ?",
                           (now, seqs[job], job))
            return new

        return self._write(tx)

    def has_part(self, job: str, rank: int, part: int) -> bool:
        """Whether this part was stored already."""
        return bool(self._rows("SELECT 1 AS one FROM parts WHERE job = ? AND rank = ? AND part = ?",
                               (job, rank, part)))

    def has_parts(self, job: str) -> bool:
        """Whether any part of the job is stored."""
        return bool(self._rows("SELECT 1 AS one FROM parts WHERE job = ? LIMIT 1", (job,)))

    def part_digest(self, job: str, rank: int, part: int) -> str | None:
        """The stored fingerprint of an uploaded part (None: not stored, or not known)."""
        rows = self._rows("SELECT digest FROM parts WHERE job = ? AND rank = ? AND part = ?",
                          (job, rank, part))
        return next(iter(rows[0].values())) if rows else None

    def part_digests(self, job: str, after_step: int = -1) -> dict[tuple[int, int], str]:
        """(rank, part) → the stored fingerprint of each uploaded part holding steps after
        `after_step` (parts stored without one are left out)."""
        rows = self._typed(_PartDigest, "SELECT rank, part, digest FROM parts WHERE job = ? "
                           "AND last_step > ? AND digest IS NOT NULL", (job, after_step))
        return {(r.rank, r.part): r.digest for r in rows}

    def parts(self, job: str, after_step: int = -1) -> list[PartRow]:
        """A job's parts that hold steps after `after_step` (for rebuilding after a restart)."""
        return self._typed(PartRow, "SELECT rank, part, records, first_step, last_step, "
                           "ingested_at, way FROM parts WHERE job = ? AND last_step > ? "
                           "ORDER BY rank, part", (job, after_step))

    def part_index(self, job: str, after_seq: int = -1) -> list[PartIndex]:
        """(rank, part, last_step, ingested_at, seq) of a job's parts (those numbered after
        `after_seq` in its part sequence; parts stored before sequences count as 0)."""
        # (a time that does not read is read as 0: the row left out was a part never
        # arrived, its acknowledged rows never analysed)
        if after_seq < 0:
            return self._typed(PartIndex, "SELECT rank, part, last_step, CAST(ingested_at AS "
                               "DOUBLE PRECISION) AS ingested_at, COALESCE(seq, 0) AS seq FROM "
                               "parts WHERE job = ? ORDER BY rank, part", (job,))
        # (seq itself compared, so that the index on (job, seq) serves the holder's every tick)
        return self._typed(PartIndex, "SELECT rank, part, last_step, CAST(ingested_at AS DOUBLE "
                           "PRECISION) AS ingested_at, seq FROM parts WHERE job = ? AND seq > ? "
                           "ORDER BY rank, part", (job, after_seq))

    def overlapping_parts(self, job: str, rank: int, part: int, first_step: int,
                          last_step: int) -> list[tuple[int, int, int, str | None]]:
        """(part, first_step, last_step, step_set) of the rank's other stored parts whose step
        ranges meet first_step..last_step, in part order: those that may share a step
        (step_sets.meet decides; step_set None: written before step sets, or not known)."""
        rows = self._rows("SELECT part, first_step, last_step, step_set FROM parts WHERE "
                          "job = ? AND rank = ? AND part <> ? AND first_step <= ? AND "
                          "last_step >= ? ORDER BY part", (job, rank, part, last_step, first_step))
        return [(int(r["part"]), int(r["first_step"]), int(r["last_step"]),
                 r["step_set"] if isinstance(r["step_set"], str) else None) for r in rows]

    def set_step_set(self, job: str, rank: int, part: int, step_set: str) -> None:
        """Note the step set of a part stored without one (read from its file: a row of the
        previous schema, or a file taken by its footer), so that it is read once."""
        self._write(lambda db: self._exec(
            db, "UPDATE parts SET step_set = ? WHERE job = ? AND rank = ? AND part = ? AND "
            "step_set IS NULL", (step_set, job, rank, part)), notify=False)

    def max_step(self, job: str) -> int:
        """The last step of any stored part of the job (-1: none)."""
        rows = self._typed(_Count, "SELECT COALESCE(MAX(last_step), -1) AS n FROM parts "
                           "WHERE job = ?", (job,))
        return rows[0].n if rows else -1

    def totals(self) -> dict[str, dict[str, PartCount]]:
        """Parts and op records stored, per way in (`by_way`) and per job (`by_job`)."""
        return {f"by_{by}": {r.key: PartCount(r.n, _whole(r.records)) for r in self._typed(
            _Totals, f"SELECT {by} AS key, COUNT(*) AS n, SUM(CAST(records AS DOUBLE "
            f"PRECISION)) AS records FROM parts GROUP BY {by}")} for by in ("way", "job")}

    def set_upload_dropped(self, job: str, rank: int, dropped: int,
                           run: int | None = None) -> bool:
        """What an uploader reported it had to drop (buffer overflow) so far; with `run`, only
        while the job's run number is that one (False: a new run replaced it, nothing stored:
        an old run's part in flight across a reset wrote its count into the new run's rows)."""
        same_run, args = ("", ()) if run is None else (" AND run = ?", (run,))

        def tx(db: Any) -> bool:
            # (under the job row, which reset_job updates in its transaction: a count is
            # stored in the run it was reported for, or not at all)
            return bool(self._exec(
                db, "INSERT INTO upload_drops (job, rank, dropped) SELECT ?, ?, ? FROM jobs "
                f"WHERE job = ?{same_run} "
                "ON CONFLICT (job, rank) DO UPDATE SET dropped = CASE WHEN "
                "excluded.dropped > upload_drops.dropped THEN excluded.dropped "
                "ELSE upload_drops.dropped END RETURNING job",
                (job, rank, dropped, job, *args)).fetchall())
        return self._write(tx)

    def upload_dropped(self, job: str) -> dict[int, int]:
        """Parts each rank's uploader dropped, as reported."""
        return {r.rank: r.dropped for r in self._typed(
            _Dropped, "SELECT rank, dropped FROM upload_drops WHERE job = ?", (job,))}

    # ---- windows and alerts -----------------------------------------------------------------

    def add_window(self, row: WindowRow, alert_rows: list[Alert], log_rows: list[AlertLogEntry],
                   lease: Lease | None = None) -> bool:
        """Store one analysed window with the alert changes it caused (and their messages,
        in the outbox), in one transaction; with `lease` (owner, epoch) only while that lease
        holds the job. False (nothing stored) when another instance took it over, or when the
        window was stored already."""
        values = plain(row)
        for column in _WINDOW_JSON:
            values[column] = json.dumps(values[column])
        sql = (f"INSERT INTO windows ({', '.join(WINDOW_COLUMNS)}) VALUES "
               f"({', '.join(':' + c for c in WINDOW_COLUMNS)}) ON CONFLICT (job, idx) DO NOTHING")

        def tx(db: Any) -> bool:
            self._fence(db, row.job, lease)
            if self._exec(db, sql, values).rowcount != 1:
                raise LeaseLost(row.job)   # stored already: a window is stored once
            self._alert_changes(db, alert_rows, log_rows)
            return True

        return self._fenced(tx)

    def add_alert_changes(self, alert_rows: list[Alert], log_rows: list[AlertLogEntry],
                          lease: Lease | None = None, job: str | None = None) -> bool:
        """Store alert changes not tied to a window (a job stalled), with their messages;
        with `lease`, only while it holds `job`."""
        if not (alert_rows or log_rows):
            return True

        def tx(db: Any) -> bool:
            if lease is not None and job is not None:
                self._fence(db, job, lease)
            self._alert_changes(db, alert_rows, log_rows)
            return True

        return self._fenced(tx)

    def add_dead_man(self, job: str, state: str | None, alert_rows: list[Alert],
                     log_rows: list[AlertLogEntry], lease: Lease | None, instance: str,
                     claim_s: float) -> list[ClaimedMessage] | None:
        """A silence decided (the job's state, if given, and its alert changes) in one
        transaction, with their messages claimed by `instance` for sending at once (no
        claim transaction and no poll before the dead-man's alert leaves); a message behind
        an older one of its alert still unsent is left to the outbox (firing before
        resolved). None (nothing stored) when `lease` no longer holds the job, or has run
        out on a shared store: a silence is decided from a clock, and an instance paused past
        its lease (SIGSTOP, a VM pause) decides from what it saw before the pause."""
        def tx(db: Any) -> list[ClaimedMessage]:
            self._fence(db, job, lease, live=True)
            if state is not None:
                self._exec(db, "UPDATE jobs SET state = ? WHERE job = ?", (state, job))
            self._alert_changes(db, alert_rows, log_rows)
            now, out = self._now(db), []
            for a in alert_rows:
                # (a damaged row in its place is left unclaimed: the outbox sets it aside)
                got, _ = self._one_or_damaged(
                    db, _Claimed, "UPDATE alert_outbox SET claimed_by = ?, claim_until = ?, "
                    "attempts = attempts + 1 WHERE fingerprint = ? AND status = ? AND sent_at = ? "
                    "AND delivered_at IS NULL AND claimed_by IS NULL AND NOT EXISTS (SELECT 1 "
                    "FROM alert_outbox p WHERE p.fingerprint = ? AND p.id < alert_outbox.id AND "
                    "p.delivered_at IS NULL AND p.failed_at IS NULL) RETURNING id, job, "
                    "fingerprint, status, alert, attempts",
                    (instance, now + claim_s, a.fingerprint, a.status, a.last_sent,
                     a.fingerprint))
                if got is not None:
                    out.append(ClaimedMessage(got.id, got.job, got.fingerprint, got.status, a,
                                              got.attempts))
            return out

        try:
            return self._write(tx)
        except LeaseLost:
            return None

    def _fenced(self, tx: Callable[[Any], bool]) -> bool:
        try:
            return self._write(tx)
        except LeaseLost:
            return False

    def _fence(self, db: Any, job: str, lease: Lease | None, live: bool = False) -> None:
        """LeaseLost unless `lease` still holds `job` (its row locked till the commit, so a
        taker waits for this transaction and then sees what it stored); `live`: and, on a
        shared store, has not run out (nobody may have taken it yet)."""
        if lease is None:
            return
        row = self._one(db, _Lease, "SELECT owner, epoch, CAST(expires_at AS DOUBLE PRECISION) "
                        "AS expires_at FROM leases WHERE job = ?" + self.FOR_UPDATE, (job,))
        if row is None or row.owner != lease[0] or row.epoch != int(lease[1]):
            raise LeaseLost(job)
        if live and self.shared and (row.expires_at is None or row.expires_at < self._now(db)):
            raise LeaseLost(job)

    def _alert_changes(self, db: Any, alert_rows: list[Alert],
                       log_rows: list[AlertLogEntry]) -> None:
        """Alert rows and log rows, and for each alert row one outbox message (the send
        decision is this transaction: a message is queued once, with its alert's change)."""
        now = time.time()
        # a fast alert resolved, however (the job finished, a new run, the detector): what it
        # fired against goes with it (a job that ended while a rank fired kept its row)
        fast_state.forget_resolved(self, db, alert_rows)
        for a in alert_rows:
            values = {**plain(a), "labels": sorted_json(a.labels),
                      "annotations": sorted_json(a.annotations)}
            self._exec(db, _upsert("alerts", ALERT_COLUMNS, ("fingerprint",)), values)
            self._exec(db, "INSERT INTO alert_outbox (job, fingerprint, status, sent_at, alert, "
                       "created_at) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (fingerprint, status, "
                       "sent_at) DO NOTHING",
                       (a.job, a.fingerprint, a.status, a.last_sent, sorted_json(a), now))
        for e in log_rows:
            self._exec(db, "INSERT INTO alert_log (at, fingerprint, job, rule, status, severity, "
                       "summary, description, \"window\") VALUES (:at, :fingerprint, :job, :rule, "
                       ":status, :severity, :summary, :description, :window)",
                       {k: v for k, v in plain(e).items() if k != "id"})

    def last_window(self, job: str) -> WindowRow | None:
        """The latest window of a job (decoded), or None."""
        rows = self._rows("SELECT * FROM windows WHERE job = ? ORDER BY idx DESC LIMIT 1", (job,))
        return _decode_window(rows[0]) if rows else None

    def window(self, job: str, idx: int) -> WindowRow | None:
        """One window of a job (decoded), or None."""
        rows = self._rows("SELECT * FROM windows WHERE job = ? AND idx = ?", (job, idx))
        return _decode_window(rows[0]) if rows else None

    def window_span(self, job: str) -> tuple[int, int | None]:
        """(how many windows the job has, the first one's index or None)."""
        r = self._typed(_Span, "SELECT COUNT(*) AS n, MIN(idx) AS first FROM windows "
                        "WHERE job = ?", (job,))[0]
        return r.n, r.first

    def windows(self, job: str, limit: int = 100_000) -> list[WindowSummary]:
        """Summaries (no scores, no diagnosis) of a job's windows, oldest first."""
        rows = self._rows(f"SELECT {', '.join(WINDOW_SUMMARY)}, diagnosis FROM windows "
                          "WHERE job = ? ORDER BY idx DESC LIMIT ?", (job, limit))
        out = []
        for r in rows:
            found = _findings(r.pop("diagnosis"))
            # each cause once (a cause found at two places is two findings, one cause); a
            # figure that does not read shown empty, a row whose index or steps do not left out
            r["causes"] = list(dict.fromkeys(f.cause for f in found))
            try:
                out.append(_converted(r, WindowSummary))
            except msgspec.ValidationError:
                continue
        return out[::-1]

    def recent_windows(self, job: str, count: int) -> list[WindowRow]:
        """The last `count` windows of a job (decoded), newest first."""
        rows = self._rows("SELECT * FROM windows WHERE job = ? ORDER BY idx DESC LIMIT ?",
                          (job, count))
        out = []
        for r in rows:
            try:
                out.append(_decode_window(r))
            except msgspec.ValidationError:
                continue   # its index or steps do not read: not one of the job's windows
        return out

    def alerts(self, job: str | None = None, status: str | None = None) -> list[Alert]:
        """Current alert states (firing or resolved), optionally of one job / one status."""
        sql, args = "SELECT * FROM alerts WHERE 1 = 1", list[Any]()
        if job is not None:
            sql, args = sql + " AND job = ?", [*args, job]
        if status is not None:
            sql, args = sql + " AND status = ?", [*args, status]
        alerts = [_decode_alert(r) for r in self._rows(sql + " ORDER BY starts_at", args)]
        return [a for a in alerts if a is not None]

    def alerts_page(self, status: str, after: str | None, limit: int
                    ) -> tuple[list[Alert], str | None]:
        """Up to `limit` alerts of `status` in fingerprint order (their key: stable while
        pages are read), after the fingerprint `after`; and the fingerprint to read the rest
        after (None when there is no more). A damaged row is left out of its page, not ending
        it (/api/alerts returned every alert of every job in one answer)."""
        sql, args = "SELECT * FROM alerts WHERE status = ?", list[Any]([status])
        if after is not None:
            sql, args = sql + " AND fingerprint > ?", [*args, after]
        rows = self._rows(sql + " ORDER BY fingerprint LIMIT ?", [*args, limit + 1])
        more = len(rows) > limit
        rows = rows[:limit]
        # (a fingerprint stored as a number sorts before every text: the rest lie after '';
        # one stored as a blob after them: nothing readable is left)
        last = rows[-1]["fingerprint"] if rows else None
        cursor = None if not more or isinstance(last, (bytes, memoryview)) else \
            last if isinstance(last, str) else ""
        alerts = [_decode_alert(r) for r in rows]
        return [a for a in alerts if a is not None], cursor

    def alert_log_page(self, before: int | None, limit: int
                       ) -> tuple[list[AlertLogEntry], int | None]:
        """Up to `limit` alert transitions, newest first, older than the entry `before`; and
        the entry to read the older ones before (None when there are none)."""
        sql, args = "SELECT * FROM alert_log", list[Any]()
        if before is not None:
            sql, args = sql + " WHERE id < ?", [before]
        rows = self._rows(sql + " ORDER BY id DESC LIMIT ?", [*args, limit + 1])
        more = len(rows) > limit
        rows = rows[:limit]
        last = rows[-1]["id"] if rows else None
        entries = []
        for row in rows:
            try:
                entries.append(msgspec.convert(row, AlertLogEntry))
            except msgspec.ValidationError:
                log.warning("store: alert log entry %.20s does not read", row.get("id"))
        return entries, (int(last) if more and isinstance(last, int) else None)

    def alert_log(self, job: str | None = None, limit: int = 200) -> list[AlertLogEntry]:
        """Alert transitions (firing, resolved), newest first."""
        if job is None:
            return self._typed(AlertLogEntry, "SELECT * FROM alert_log ORDER BY id DESC LIMIT ?",
                               (limit,))
        return self._typed(AlertLogEntry, "SELECT * FROM alert_log WHERE job = ? ORDER BY id "
                           "DESC LIMIT ?", (job, limit))

    # ---- the alert outbox ---------------------------------------------------------------------

    def claim_messages(self, instance: str, limit: int, claim_s: float) -> list[ClaimedMessage]:
        """Up to `limit` undelivered messages, claimed by `instance` for `claim_s` (another
        instance takes them only once the claim ran out: its holder died mid-send); the oldest
        first, and none while an older one of the same alert waits (firing before resolved)."""
        # a read first: an idle outbox costs no write transaction (an fsync on SQLite) a poll
        if not self._rows("SELECT 1 AS due FROM alert_outbox WHERE delivered_at IS NULL AND "
                          "failed_at IS NULL LIMIT 1"):
            return []

        def tx(db: Any) -> list[ClaimedMessage]:
            now = self._now(db)
            rows = self._many(
                db, _Count, "SELECT id AS n FROM alert_outbox o WHERE delivered_at IS NULL AND "
                "failed_at IS "
                "NULL AND (claim_until IS NULL OR claim_until < ?) AND NOT EXISTS (SELECT 1 FROM "
                "alert_outbox p WHERE p.fingerprint = o.fingerprint AND p.id < o.id AND "
                "p.delivered_at IS NULL AND p.failed_at IS NULL) ORDER BY id LIMIT ?"
                + self.FOR_UPDATE + self.SKIP_LOCKED, (now, limit))
            out = []
            for r in rows:
                got, bad = self._one_or_damaged(
                    db, _Claimed, "UPDATE alert_outbox SET claimed_by = ?, claim_until = ?, "
                    "attempts = attempts + 1 WHERE id = ? RETURNING id, job, fingerprint, "
                    "status, alert, attempts", (instance, now + claim_s, r.n))
                if bad is not None:
                    # a column of another type (a blob for the alert, text for the attempts):
                    # given up on by its id, as one that does not decode below (it raised
                    # out of the claim, whose rollback held every job's messages, for good)
                    self._give_up(db, r.n, now)
                    continue
                if got is None:
                    continue
                try:
                    alert = msgspec.json.decode(got.alert, type=Alert)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    # a message that does not read is given up on, named in the log: claimed
                    # first at every poll, its failure once held back every other message
                    self._give_up(db, got.id, now)
                    self._damaged("alert_outbox", {"job": got.job}, exc)
                    continue
                out.append(ClaimedMessage(got.id, got.job, got.fingerprint, got.status, alert,
                                          got.attempts))
            return out

        return self._write(tx)

    def _give_up(self, db: Any, message_id: int, now: float) -> None:
        """Set a damaged message aside (failed, never claimed again) and count it."""
        self._exec(db, "UPDATE alert_outbox SET failed_at = ? WHERE id = ?", (now, message_id))
        self.damaged_messages += 1

    def message_sent(self, message_id: int, instance: str) -> None:
        """A claimed message was delivered."""
        def tx(db: Any) -> None:
            self._exec(db, "UPDATE alert_outbox SET delivered_at = ?, delivered_by = ? "
                       "WHERE id = ?", (time.time(), instance, message_id))
        self._write(tx, notify=False)

    def message_failed(self, message_id: int, retry_in_s: float | None) -> None:
        """A claimed message was not delivered: tried again after `retry_in_s` (by any
        instance), or given up on (None)."""
        def tx(db: Any) -> None:
            if retry_in_s is None:
                self._exec(db, "UPDATE alert_outbox SET failed_at = ? WHERE id = ?",
                           (time.time(), message_id))
            else:
                self._exec(db, "UPDATE alert_outbox SET claim_until = ?, claimed_by = NULL "
                           "WHERE id = ?", (self._now(db) + retry_in_s, message_id))
        self._write(tx, notify=False)

    def outbox(self, job: str | None = None) -> list[OutboxRow]:
        """Every queued message with its delivery (for /api/stats, tests and benchmarks)."""
        sql = "SELECT id, job, fingerprint, status, sent_at, attempts, claimed_by, " \
              "delivered_by, delivered_at, failed_at FROM alert_outbox"
        if job is None:
            return self._typed(OutboxRow, sql + " ORDER BY id")
        return self._typed(OutboxRow, sql + " WHERE job = ? ORDER BY id", (job,))

    # ---- leases -------------------------------------------------------------------------------

    def heartbeat(self, instance: str, url: str, lease_s: float,
                  leases: dict[str, int], alone: bool = False,
                  probe: str | None = None) -> dict[str, int]:
        """One round of leasing for `instance` (holding `leases`: job → epoch): renew what it
        holds, and take free or expired leases up to its fair share (jobs / live instances);
        `alone` (the only instance of its store), every lease. `probe`: the name of the file
        it wrote into its uploads folder (uploads_mark.InstanceProbe), recorded with it.
        Returns the jobs it holds now with their epochs (a job missing was taken over)."""
        def tx(db: Any) -> dict[str, int]:
            now = self._now(db)
            self._exec(db, "INSERT INTO instances (id, url, started_at, seen_at, expires_at) "
                       "VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET seen_at = "
                       "excluded.seen_at, expires_at = excluded.expires_at, url = excluded.url",
                       (instance, url, now, now, now + lease_s))
            if probe is not None:   # (in the same transaction: live means probe recorded)
                self._exec(db, "INSERT INTO store_info (key, value) VALUES (?, ?) ON CONFLICT "
                           "(key) DO UPDATE SET value = excluded.value",
                           (PROBE_KEY + instance, probe))
            # instances gone for a day, and messages delivered a day ago, are forgotten
            self._exec(db, "DELETE FROM instances WHERE expires_at < ?", (now - KEEP_S,))
            self._exec(db, "DELETE FROM store_info WHERE substr(key, 1, 6) = 'probe:' AND "
                       "substr(key, 7) NOT IN (SELECT id FROM instances)")
            self._exec(db, "DELETE FROM ingest_marks WHERE instance NOT IN (SELECT id FROM "
                       "instances)")
            self._exec(db, "DELETE FROM alert_outbox WHERE delivered_at < ?", (now - KEEP_S,))
            if alone:
                # alone on its store, every lease is this instance's: one held by another
                # name (a damaged row) was never free, and with no later heartbeat its job's
                # parts were acknowledged and none of its windows analysed
                self._exec(db, "UPDATE leases SET owner = NULL WHERE owner IS NOT NULL AND "
                           "owner <> ?", (instance,))
            # (an epoch that does not read is made one: such a lease was left out of every
            # read, its job analysed by nobody)
            held = {r.job: r.epoch for r in self._many(
                db, _Held, "UPDATE leases SET expires_at = ?, epoch = CAST(epoch AS INTEGER) "
                "WHERE owner = ? RETURNING job, epoch", (now + lease_s, instance))}
            live = self._count(db, "SELECT COUNT(*) AS n FROM instances WHERE expires_at > ?",
                               (now,))
            total = self._count(db, "SELECT COUNT(*) AS n FROM leases")
            share = -(-total // max(1, live))
            want = share - len(held)
            if want < 0:
                # more than a fair share (an instance joined): hand the surplus back, for the
                # newcomer to take at its next heartbeat
                for job in sorted(held)[want:]:
                    self._exec(db, "UPDATE leases SET owner = NULL, expires_at = NULL "
                               "WHERE job = ?", (job,))
                    del held[job]
            elif want > 0:
                # free: no owner, or no expiry, or one passed or not a number (a damaged
                # owner or expiry was never free, never renewed: its job analysed by nobody)
                free = self._many(
                    db, _Held, "SELECT job, CAST(epoch AS INTEGER) AS epoch FROM leases WHERE "
                    "owner IS NULL OR expires_at IS NULL OR CAST(expires_at AS DOUBLE "
                    "PRECISION) < ? ORDER BY job LIMIT ?" + self.FOR_UPDATE + self.SKIP_LOCKED,
                    (now, want))
                for r in free:
                    held[r.job] = self._take(db, instance, r.job, now + lease_s, now)
            return held

        return self._write(tx, notify=False)

    def take_lease(self, instance: str, job: str, lease_s: float,
                   alone: bool = False) -> int | None:
        """Take a job's lease now if it is free or expired (a new job, registered here), or
        whoever holds it when `alone`; its epoch, or None when another instance holds it."""
        def tx(db: Any) -> int | None:
            now = self._now(db)
            row = self._one(db, _Lease, "SELECT owner, CAST(epoch AS BIGINT) AS epoch, "
                            "expires_at FROM leases WHERE job = ?" + self.FOR_UPDATE
                            + self.SKIP_LOCKED, (job,))
            if row is None:
                return None
            if row.owner == instance:
                return row.epoch
            if row.owner is not None and row.expires_at is not None and row.expires_at >= now \
                    and not alone:   # (alone on its store: every lease is this instance's)
                return None
            return self._take(db, instance, job, now + lease_s, now)

        return self._write(tx, notify=False)

    def _take(self, db: Any, instance: str, job: str, until: float, now: float) -> int:
        """Take a job's lease (its row locked by the caller); its new epoch."""
        # (an epoch that is not a whole number, damaged, is made one: its RETURNING raised
        # out of the heartbeat, which renews every lease, and no job was analysed)
        got = self._one(db, _Held, "UPDATE leases SET owner = ?, epoch = CAST(epoch AS "
                        "BIGINT) + 1, "
                        "expires_at = ?, taken_at = ? WHERE job = ? RETURNING job, epoch",
                        (instance, until, now, job))
        assert got is not None   # the caller found the row
        return got.epoch

    def _count(self, db: Any, sql: str, args: Iterable[Any] = ()) -> int:
        """The `n` a counting statement returns in a write transaction."""
        row = self._one(db, _Count, sql, args)
        return row.n if row is not None else 0

    def release_leases(self, instance: str) -> None:
        """Give up every lease of `instance` (a clean stop: others take its jobs at once)."""
        def tx(db: Any) -> None:
            self._exec(db, "UPDATE leases SET owner = NULL, expires_at = NULL WHERE owner = ?",
                       (instance,))
            self._exec(db, "DELETE FROM instances WHERE id = ?", (instance,))
            self._exec(db, "DELETE FROM ingest_marks WHERE instance = ?", (instance,))
            self._exec(db, "DELETE FROM store_info WHERE key = ?", (PROBE_KEY + instance,))
        self._write(tx, notify=False)

    def live_probes(self, instance: str) -> list[tuple[str, str]]:
        """(instance, probe file name) of the live instances other than `instance` that
        recorded a probe (one of a version without probes is not looked for)."""
        def tx(db: Any) -> list[tuple[str, str]]:
            rows = self._many(db, _Probe, "SELECT i.id AS instance, s.value AS probe FROM "
                              "instances i JOIN store_info s ON s.key = 'probe:' || i.id "
                              "WHERE i.expires_at > ? AND i.id <> ?", (self._now(db), instance))
            return [(r.instance, r.probe) for r in rows]
        return self._write(tx, notify=False)

    # ---- ingest marks: silence on a shared store ----------------------------------------------

    def set_ingest_mark(self, instance: str, as_of: float, oldest: float | None) -> None:
        """Say that every part `instance` heard before `as_of` is stored or refused, but those
        still in flight, the oldest heard at `oldest` (None: none)."""
        def tx(db: Any) -> None:
            self._exec(db, "INSERT INTO ingest_marks (instance, as_of, oldest) VALUES (?, ?, ?) "
                       "ON CONFLICT (instance) DO UPDATE SET as_of = excluded.as_of, "
                       "oldest = excluded.oldest", (instance, as_of, oldest))
        self._write(tx, notify=False)

    def ingest_marks(self, instance: str) -> list[IngestMark]:
        """The ingest marks of the live instances other than `instance` (their heartbeat's
        lease not run out: a killed one's parts in flight were never acknowledged)."""
        def tx(db: Any) -> list[IngestMark]:
            return self._many(db, IngestMark, "SELECT m.instance, m.as_of, m.oldest FROM "
                              "ingest_marks m JOIN instances i ON i.id = m.instance WHERE "
                              "i.expires_at > ? AND m.instance <> ?", (self._now(db), instance))
        return self._write(tx, notify=False)

    def leases(self) -> list[LeaseRow]:
        """Every job's lease: owner, epoch, expiry, when taken."""
        return self._typed(LeaseRow, "SELECT job, owner, epoch, expires_at, taken_at FROM leases "
                           "ORDER BY job")


def _upsert(table: str, columns: tuple[str, ...], key: tuple[str, ...]) -> str:
    """INSERT of a whole row that replaces the row with the same key (both dialects)."""
    names = ", ".join(columns)
    values = ", ".join(f":{c}" for c in columns)
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in key)
    return (f"INSERT INTO {table} ({names}) VALUES ({values}) "
            f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET {updates}")


def _job_summary(r: dict[str, Any]) -> JobSummary:
    """A job-list row; its latest window's figures left out when they do not read (a damaged
    window row is not a damaged job: the job was listed, and so set aside at start)."""
    try:
        return msgspec.convert(r, JobSummary)
    except msgspec.ValidationError:
        pass
    r = dict(r)
    for column in ("slowdown", "analysed_at"):
        try:
            msgspec.convert(r[column], float | None)
        except msgspec.ValidationError:
            r[column] = None
    return msgspec.convert(r, JobSummary)


def _decode_window(row: dict[str, Any]) -> WindowRow:
    """A stored window row as a record; a JSON column that does not decode, or a figure, time
    or text of another type (text where a number belongs, a blob), is left empty (a damaged
    row is shown as empty, not a failure of every read: the alert rules read the job's last
    windows, and such a row failed every later window of its job, none stored). A row whose
    job, index or steps do not read raises msgspec.ValidationError."""
    for column, kind in _WINDOW_JSON.items():
        row[column] = _decoded(row[column], kind)
    row["notes"] = _bounded_notes(row["notes"])
    return _converted(row, WindowRow)


def _bounded_notes(notes: list[str]) -> list[str]:
    """A window's notes as written at most: MAX_NOTES lines of NOTE_CHARS (a longer line cut,
    saying by how much)."""
    if len(notes) > MAX_NOTES:
        log.warning("store: a window's notes have %d lines; the first %d are read", len(notes),
                    MAX_NOTES)
    out = []
    for line in notes[:MAX_NOTES]:
        if len(line) > NOTE_CHARS:
            keep = NOTE_CHARS - 40   # (room for the tail)
            line = f"{line[:keep]}… ({len(line) - keep} more characters)"
        out.append(line)
    return out


_Record = TypeVar("_Record", WindowRow, WindowSummary)

# a window's figures, times and texts: their types and what a value that does not read is
_WINDOW_FIGURES = {f.name: (f.type, f.default) for f in msgspec.structs.fields(WindowRow)
                   if not f.required and f.name not in _WINDOW_JSON}


def _converted(row: dict[str, Any], kind: type[_Record]) -> _Record:
    """A window row (or summary) as `kind`, its figures that do not read left empty."""
    try:
        return msgspec.convert(row, kind)
    except msgspec.ValidationError:
        return msgspec.convert(_readable_figures(row), kind)


def _readable_figures(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with each window figure, time or text that is not of its type left empty."""
    for name, (kind, empty) in _WINDOW_FIGURES.items():
        if name in row:
            try:
                msgspec.convert(row[name], kind)
            except msgspec.ValidationError:
                row[name] = empty
    return row


def _decoded(text: Any, kind: Any) -> list[Any]:
    """A stored JSON list read into `kind` items, skipping items that do not fit."""
    items = _loads(text, [])
    if not isinstance(items, list):
        return []
    try:
        return msgspec.convert([_upgraded(item, kind) for item in items], list[kind])
    except msgspec.ValidationError:
        pass   # one item at fault: the others are kept
    out = []
    for item in items:
        try:
            out.append(msgspec.convert(_upgraded(item, kind), kind))
        except msgspec.ValidationError as exc:
            log.warning("store: a stored %s does not read: %s", kind.__name__, exc)
    return out


def _upgraded(item: Any, kind: Any) -> Any:
    """A finding stored before workers were objects ([dp, pp] pairs) in today's form."""
    if kind is WindowFinding and isinstance(item, dict) and isinstance(item.get("where"), dict):
        workers = item["where"].get("workers")
        if isinstance(workers, list) and any(isinstance(w, list) for w in workers):
            item["where"]["workers"] = [{"dp": w[0], "pp": w[1]} if isinstance(w, list)
                                        and len(w) >= 2 else w for w in workers]
    return item


def _findings(text: Any) -> list[WindowFinding]:
    """A window's stored diagnosis."""
    return _decoded(text, WindowFinding)


def _decode_alert(row: dict[str, Any]) -> Alert | None:
    """A stored alert row as a record (labels and annotations are JSON text); None, with a
    warning, for a damaged one (left out rather than failing every read of the alerts)."""
    for column in ("labels", "annotations"):
        row[column] = _loads(row[column], None)
    try:
        return msgspec.convert(row, Alert)
    except msgspec.ValidationError as exc:
        log.warning("store: alert %.20s does not read: %s", row.get("fingerprint"), exc)
        return None


JOB_STATES = ("running", "stalled", "finished")


def _unreadable_job(row: dict[str, Any]) -> JobSummary:
    """A job row that does not read, as the job list shows it: its name (as text), state
    `quarantined`, what else reads."""
    def text(v: Any) -> str:
        return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)

    def number(v: Any) -> float | None:
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None

    return JobSummary(job=text(row.get("job")), directory="", way=text(row.get("way")),
                      state="quarantined", created_at=number(row.get("created_at")) or 0.0,
                      last_part_at=number(row.get("last_part_at")),
                      finished_at=number(row.get("finished_at")), window=None, slowdown=None,
                      analysed_at=None, open_alerts=0, upload_dropped=0)


def superseded_tokens(text: Any) -> list[str]:
    """A job row's superseded run tokens by name, the last MAX_SUPERSEDED (replaced.py; a
    damaged value reads as none: uploads are then judged by their start clocks)."""
    return read_replaced(text).last


def _loads(text: Any, default: Any) -> Any:
    """Stored JSON decoded; `default` for text that does not decode (a damaged row is shown
    as empty, not a failure of every read)."""
    try:
        return json.loads(text)
    except (TypeError, ValueError, RecursionError):
        log.warning("store: a stored value does not decode as JSON: %.80r", text)
        return default
