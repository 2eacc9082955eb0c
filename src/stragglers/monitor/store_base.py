"""The monitor's store interface, its queries written once for SQLite and PostgreSQL.

`SQLStore` holds every query (jobs, parts, windows, alerts, leases, the alert outbox); a
backend (store_sqlite.SQLiteStore, store_postgres.PostgresStore) supplies the connection, the
schema, its clock and the few words the two dialects spell differently. Queries are written with
`?` and `:name` parameters; the PostgreSQL backend rewrites them to psycopg's.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Iterable

log = logging.getLogger(__name__)

WINDOW_SUMMARY = ("idx", "first_step", "last_step", "slowdown", "waste", "m_w", "m_s", "error",
                  "reason", "closed_at", "analysed_at", "analysis_s")
WINDOW_COLUMNS = ("job", "idx", "first_step", "last_step", "steps", "slowdown", "waste",
                  "t_base", "t_ideal", "sim_error", "m_w", "m_s", "scores", "diagnosis",
                  "missing_ranks", "error", "reason", "closed_at", "analysed_at", "analysis_s")
ALERT_COLUMNS = ("fingerprint", "rule", "job", "labels", "annotations", "status", "starts_at",
                 "ends_at", "last_sent")


KEEP_S = 86400.0   # dead instances' rows and delivered messages are kept this long


class JobConflict(Exception):
    """A job name already belongs to another directory."""


class LeaseLost(Exception):
    """This instance no longer holds the job's lease: another one analyses it now."""


class SQLStore:
    """Jobs, parts, windows, alerts, leases and the alert outbox (see the module docstring)."""

    # set by the backend
    path: str = ""             # the SQLite file, or the PostgreSQL URL without its password
    shared: bool = False       # several instances may use this store at once
    FOR_UPDATE = ""            # row locks (PostgreSQL); SQLite's writer lock covers them
    SKIP_LOCKED = ""

    def __init__(self):
        self.version = 0  # bumped on every write seen; pages poll it to skip unchanged reads
        self._listeners: list = []

    # ---- what a backend provides ------------------------------------------------------------

    def _write(self, fn, notify: bool = True):
        """Run fn(db) in one write transaction; its result (then, with `notify`, listeners
        hear of the change)."""
        raise NotImplementedError

    def _rows(self, sql: str, args: Iterable = ()) -> list[dict]:
        """Rows of a read, as dicts."""
        raise NotImplementedError

    def _now(self, db) -> float:
        """The time leases are measured in (the database's clock when shared)."""
        return time.time()

    def _exec(self, db, sql: str, args=()):
        """Execute one statement in a write transaction; the cursor."""
        return db.execute(sql, args)

    def close(self) -> None:
        """Close the connections."""

    def on_change(self, listener) -> None:
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

    def register_job(self, job: str, directory: str, way: str, meta: dict | None,
                     now: float | None = None) -> bool:
        """Create or update a job; JobConflict when the name belongs to another directory."""
        now = time.time() if now is None else now
        meta_text = None if meta is None else json.dumps(meta, sort_keys=True)

        def tx(db):
            row = self._exec(db, "SELECT directory, meta FROM jobs WHERE job = ?" + self.FOR_UPDATE,
                             (job,)).fetchone()
            if row is None:
                cur = self._exec(db, "INSERT INTO jobs (job, directory, way, meta, created_at) "
                                 "VALUES (?, ?, ?, ?, ?) ON CONFLICT (job) DO NOTHING",
                                 (job, directory, way, meta_text, now))
                self._exec(db, "INSERT INTO leases (job) VALUES (?) ON CONFLICT (job) DO NOTHING",
                           (job,))
                if cur.rowcount == 1:
                    return True
                row = self._exec(db, "SELECT directory, meta FROM jobs WHERE job = ?",
                                 (job,)).fetchone()
            if row["directory"] != directory:
                raise JobConflict(f"job name {job!r} already belongs to {row['directory']}")
            if meta_text is not None and meta_text != row["meta"]:
                self._exec(db, "UPDATE jobs SET meta = ? WHERE job = ?", (meta_text, job))
            return False

        return self._write(tx)

    def reset_job(self, job: str, meta: dict, alert_rows: list[dict],
                  log_rows: list[dict], still_old=None) -> bool:
        """A new run of a job: its parts, windows and upload drop counts go, its metadata is
        replaced, and its alerts resolve (alert_rows, log_rows), in one transaction. With
        `still_old(stored_meta)`, only while it holds (two instances seeing one new run reset
        it once); False when it did not."""
        meta_text = json.dumps(meta, sort_keys=True)

        def tx(db):
            row = self._exec(db, "SELECT meta FROM jobs WHERE job = ?" + self.FOR_UPDATE,
                             (job,)).fetchone()
            if still_old is not None and (row is None or not still_old(_loads(row["meta"], None))):
                return False
            for table in ("parts", "windows", "upload_drops"):
                self._exec(db, f"DELETE FROM {table} WHERE job = ?", (job,))
            self._exec(db, "UPDATE jobs SET meta = ?, state = 'running', last_part_at = NULL, "
                       "finished_at = NULL, closed = 0, created_at = ?, run = run + 1 "
                       "WHERE job = ?", (meta_text, time.time(), job))
            self._alert_changes(db, alert_rows, log_rows)
            return True

        return self._write(tx)

    def set_job_state(self, job: str, state: str, closed: bool | None = None,
                      finished_at: float | None = None,
                      lease: tuple[str, int] | None = None) -> bool:
        """Record a job's state (running, stalled, finished); with `lease`, only while it
        holds the job (False: not recorded)."""
        def tx(db):
            self._fence(db, job, lease)
            self._exec(db, "UPDATE jobs SET state = ?, finished_at = COALESCE(?, finished_at), "
                       "closed = COALESCE(?, closed) WHERE job = ?",
                       (state, finished_at, None if closed is None else int(closed), job))
            return True
        return self._fenced(tx)

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
            "j.finished_at, w.idx AS \"window\", w.slowdown, w.analysed_at, "
            "(SELECT COUNT(*) FROM alerts a WHERE a.job = j.job AND a.status = 'firing') "
            "AS open_alerts, (SELECT CAST(COALESCE(SUM(dropped), 0) AS BIGINT) FROM "
            "upload_drops d WHERE d.job = j.job) AS upload_dropped "
            "FROM jobs j LEFT JOIN windows w ON w.job = j.job AND w.idx = "
            "(SELECT MAX(idx) FROM windows WHERE job = j.job) "
            "ORDER BY COALESCE(j.last_part_at, j.created_at) DESC")
        for r in rows:
            meta = _loads(r.pop("meta"), {}) if r["meta"] else {}
            meta = meta if isinstance(meta, dict) else {}
            r["world_size"] = meta.get("world_size")
            r["dp"], r["pp"] = meta.get("dp_size"), meta.get("pp_size")
        return rows

    def job_marks(self, jobs: Iterable[str]) -> dict[str, dict]:
        """job → its part sequence, run number and metadata text: what an owner compares to
        learn of parts, new runs and new metadata another instance stored."""
        jobs = list(jobs)
        if not jobs:
            return {}
        marks = ", ".join("?" * len(jobs))
        return {r["job"]: r for r in self._rows(
            f"SELECT job, part_seq, run, meta, state FROM jobs WHERE job IN ({marks})", jobs)}

    # ---- parts ------------------------------------------------------------------------------

    def add_parts(self, rows: list[tuple], now: float | None = None) -> list[bool]:
        """Insert parts (job, rank, part, records, first_step, last_step, bytes, way[, digest])
        in one transaction; returns for each whether it was new (False: seen before, not
        counted). digest: the uploaded bytes' fingerprint (None for watched files). Each new
        part gets the next number of its job's part sequence (commits of one job's parts are
        ordered by its row's lock, so an owner reading `seq > n` misses none)."""
        now = time.time() if now is None else now

        def tx(db):
            seqs = {}
            for job in sorted({r[0] for r in rows}):   # locks in one order: no deadlock
                row = self._exec(db, "SELECT part_seq FROM jobs WHERE job = ?" + self.FOR_UPDATE,
                                 (job,)).fetchone()
                seqs[job] = int(row["part_seq"]) if row is not None else 0
            new, touched = [], set()
            for r in rows:
                seq = seqs[r[0]] + 1
                cur = self._exec(
                    db, "INSERT INTO parts (job, rank, part, records, first_step, last_step, "
                    "bytes, way, ingested_at, digest, seq) VALUES "
                    "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (job, rank, part) DO NOTHING",
                    (*r[:8], now, r[8] if len(r) > 8 else None, seq))
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

    def part_index(self, job: str, after_seq: int = -1) -> list[dict]:
        """(rank, part, last_step, ingested_at, seq) of a job's parts (those numbered after
        `after_seq` in its part sequence; parts stored before sequences count as 0)."""
        if after_seq < 0:
            return self._rows("SELECT rank, part, last_step, ingested_at, COALESCE(seq, 0) AS "
                              "seq FROM parts WHERE job = ? ORDER BY rank, part", (job,))
        # (seq itself compared, so that the index on (job, seq) serves the holder's every tick)
        return self._rows("SELECT rank, part, last_step, ingested_at, seq FROM parts "
                          "WHERE job = ? AND seq > ? ORDER BY rank, part", (job, after_seq))

    def max_step(self, job: str) -> int:
        """The last step of any stored part of the job (-1: none)."""
        rows = self._rows("SELECT MAX(last_step) AS m FROM parts WHERE job = ?", (job,))
        return int(rows[0]["m"]) if rows and rows[0]["m"] is not None else -1

    def totals(self) -> dict:
        """Parts and op records stored, per way in and per job."""
        by_way = {r["way"]: {"parts": r["n"], "records": r["records"]} for r in self._rows(
            "SELECT way, COUNT(*) AS n, CAST(SUM(records) AS BIGINT) AS records FROM parts "
            "GROUP BY way")}
        by_job = {r["job"]: {"parts": r["n"], "records": r["records"]} for r in self._rows(
            "SELECT job, COUNT(*) AS n, CAST(SUM(records) AS BIGINT) AS records FROM parts "
            "GROUP BY job")}
        return {"by_way": by_way, "by_job": by_job}

    def set_upload_dropped(self, job: str, rank: int, dropped: int) -> None:
        """What an uploader reported it had to drop (buffer overflow) so far."""
        def tx(db):
            self._exec(db, "INSERT INTO upload_drops (job, rank, dropped) VALUES (?, ?, ?) "
                       "ON CONFLICT (job, rank) DO UPDATE SET dropped = CASE WHEN "
                       "excluded.dropped > upload_drops.dropped THEN excluded.dropped "
                       "ELSE upload_drops.dropped END", (job, rank, dropped))
        self._write(tx)

    def upload_dropped(self, job: str) -> dict[int, int]:
        """Parts each rank's uploader dropped, as reported."""
        return {r["rank"]: r["dropped"] for r in self._rows(
            "SELECT rank, dropped FROM upload_drops WHERE job = ?", (job,))}

    # ---- windows and alerts -----------------------------------------------------------------

    def add_window(self, row: dict, alert_rows: list[dict], log_rows: list[dict],
                   lease: tuple[str, int] | None = None) -> bool:
        """Store one analysed window with the alert changes it caused (and their messages,
        in the outbox), in one transaction; with `lease` (owner, epoch) only while that lease
        holds the job. False (nothing stored) when another instance took it over, or when the
        window was stored already."""
        values = {**row, "steps": json.dumps(row["steps"]), "scores": json.dumps(row["scores"]),
                  "diagnosis": json.dumps(row["diagnosis"]),
                  "missing_ranks": json.dumps(row["missing_ranks"])}
        values = {k: values[k] for k in WINDOW_COLUMNS}
        sql = (f"INSERT INTO windows ({', '.join(WINDOW_COLUMNS)}) VALUES "
               f"({', '.join(':' + c for c in WINDOW_COLUMNS)}) ON CONFLICT (job, idx) DO NOTHING")

        def tx(db):
            self._fence(db, row["job"], lease)
            if self._exec(db, sql, values).rowcount != 1:
                raise LeaseLost(row["job"])   # stored already: a window is stored once
            self._alert_changes(db, alert_rows, log_rows)
            return True

        return self._fenced(tx)

    def add_alert_changes(self, alert_rows: list[dict], log_rows: list[dict],
                          lease: tuple[str, int] | None = None, job: str | None = None) -> bool:
        """Store alert changes not tied to a window (a job stalled), with their messages;
        with `lease`, only while it holds `job`."""
        if not (alert_rows or log_rows):
            return True

        def tx(db):
            if lease is not None:
                self._fence(db, job, lease)
            self._alert_changes(db, alert_rows, log_rows)
            return True

        return self._fenced(tx)

    def _fenced(self, tx) -> bool:
        try:
            return self._write(tx)
        except LeaseLost:
            return False

    def _fence(self, db, job: str, lease: tuple[str, int] | None) -> None:
        """LeaseLost unless `lease` still holds `job` (its row locked till the commit, so a
        taker waits for this transaction and then sees what it stored)."""
        if lease is None:
            return
        row = self._exec(db, "SELECT owner, epoch FROM leases WHERE job = ?" + self.FOR_UPDATE,
                         (job,)).fetchone()
        if row is None or row["owner"] != lease[0] or int(row["epoch"]) != int(lease[1]):
            raise LeaseLost(job)

    def _alert_changes(self, db, alert_rows: list[dict], log_rows: list[dict]) -> None:
        """Alert rows and log rows, and for each alert row one outbox message (the send
        decision is this transaction: a message is queued once, with its alert's change)."""
        now = time.time()
        for a in alert_rows:
            values = {**{k: a[k] for k in ALERT_COLUMNS},
                      "labels": json.dumps(a["labels"], sort_keys=True),
                      "annotations": json.dumps(a["annotations"], sort_keys=True)}
            self._exec(db, _upsert("alerts", ALERT_COLUMNS, ("fingerprint",)), values)
            plain = {k: a[k] for k in ALERT_COLUMNS}
            self._exec(db, "INSERT INTO alert_outbox (job, fingerprint, status, sent_at, alert, "
                       "created_at) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (fingerprint, status, "
                       "sent_at) DO NOTHING",
                       (a["job"], a["fingerprint"], a["status"], a["last_sent"],
                        json.dumps(plain, sort_keys=True), now))
        for e in log_rows:
            self._exec(db, "INSERT INTO alert_log (at, fingerprint, job, rule, status, severity, "
                       "summary, description, \"window\") VALUES (:at, :fingerprint, :job, :rule, "
                       ":status, :severity, :summary, :description, :window)",
                       {k: e[k] for k in ("at", "fingerprint", "job", "rule", "status",
                                          "severity", "summary", "description", "window")})

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
        r = self._rows("SELECT COUNT(*) AS n, MIN(idx) AS first FROM windows WHERE job = ?",
                       (job,))[0]
        return int(r["n"]), r["first"]

    def windows(self, job: str, limit: int = 100_000) -> list[dict]:
        """Summaries (no scores, no diagnosis) of a job's windows, oldest first."""
        rows = self._rows(f"SELECT {', '.join(WINDOW_SUMMARY)}, diagnosis FROM windows "
                          "WHERE job = ? ORDER BY idx DESC LIMIT ?", (job, limit))
        for r in rows:
            found = _loads(r.pop("diagnosis"), [])
            # each cause once (a cause found at two places is two findings, one cause)
            r["causes"] = list(dict.fromkeys(f.get("cause") for f in found
                                             if isinstance(f, dict))) \
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

    # ---- the alert outbox ---------------------------------------------------------------------

    def claim_messages(self, instance: str, limit: int, claim_s: float) -> list[dict]:
        """Up to `limit` undelivered messages, claimed by `instance` for `claim_s` (another
        instance takes them only once the claim ran out: its holder died mid-send); the oldest
        first, and none while an older one of the same alert waits (firing before resolved)."""
        # a read first: an idle outbox costs no write transaction (an fsync on SQLite) a poll
        if not self._rows("SELECT 1 AS due FROM alert_outbox WHERE delivered_at IS NULL AND "
                          "failed_at IS NULL LIMIT 1"):
            return []

        def tx(db):
            now = self._now(db)
            rows = self._exec(
                db, "SELECT id FROM alert_outbox o WHERE delivered_at IS NULL AND failed_at IS "
                "NULL AND (claim_until IS NULL OR claim_until < ?) AND NOT EXISTS (SELECT 1 FROM "
                "alert_outbox p WHERE p.fingerprint = o.fingerprint AND p.id < o.id AND "
                "p.delivered_at IS NULL AND p.failed_at IS NULL) ORDER BY id LIMIT ?"
                + self.FOR_UPDATE + self.SKIP_LOCKED, (now, limit)).fetchall()
            ids = [r["id"] for r in rows]
            out = []
            for i in ids:
                out.append(self._exec(
                    db, "UPDATE alert_outbox SET claimed_by = ?, claim_until = ?, attempts = "
                    "attempts + 1 WHERE id = ? RETURNING id, job, fingerprint, status, alert, "
                    "attempts", (instance, now + claim_s, i)).fetchone())
            return [dict(r) for r in out]

        return self._write(tx)

    def message_sent(self, message_id: int, instance: str) -> None:
        """A claimed message was delivered."""
        def tx(db):
            self._exec(db, "UPDATE alert_outbox SET delivered_at = ?, delivered_by = ? "
                       "WHERE id = ?", (time.time(), instance, message_id))
        self._write(tx, notify=False)

    def message_failed(self, message_id: int, retry_in_s: float | None) -> None:
        """A claimed message was not delivered: tried again after `retry_in_s` (by any
        instance), or given up on (None)."""
        def tx(db):
            if retry_in_s is None:
                self._exec(db, "UPDATE alert_outbox SET failed_at = ? WHERE id = ?",
                           (time.time(), message_id))
            else:
                self._exec(db, "UPDATE alert_outbox SET claim_until = ?, claimed_by = NULL "
                           "WHERE id = ?", (self._now(db) + retry_in_s, message_id))
        self._write(tx, notify=False)

    def outbox(self, job: str | None = None) -> list[dict]:
        """Every queued message with its delivery (for /api/stats, tests and benchmarks)."""
        sql = "SELECT id, job, fingerprint, status, sent_at, attempts, claimed_by, " \
              "delivered_by, delivered_at, failed_at FROM alert_outbox"
        if job is None:
            return self._rows(sql + " ORDER BY id")
        return self._rows(sql + " WHERE job = ? ORDER BY id", (job,))

    # ---- leases -------------------------------------------------------------------------------

    def heartbeat(self, instance: str, url: str, lease_s: float,
                  leases: dict[str, int]) -> dict[str, int]:
        """One round of leasing for `instance` (holding `leases`: job → epoch): renew what it
        holds, and take free or expired leases up to its fair share (jobs / live instances).
        Returns the jobs it holds now with their epochs (a job missing was taken over)."""
        def tx(db):
            now = self._now(db)
            self._exec(db, "INSERT INTO instances (id, url, started_at, seen_at, expires_at) "
                       "VALUES (?, ?, ?, ?, ?) ON CONFLICT (id) DO UPDATE SET seen_at = "
                       "excluded.seen_at, expires_at = excluded.expires_at, url = excluded.url",
                       (instance, url, now, now, now + lease_s))
            # instances gone for a day, and messages delivered a day ago, are forgotten
            self._exec(db, "DELETE FROM instances WHERE expires_at < ?", (now - KEEP_S,))
            self._exec(db, "DELETE FROM alert_outbox WHERE delivered_at < ?", (now - KEEP_S,))
            held = {r["job"]: int(r["epoch"]) for r in self._exec(
                db, "UPDATE leases SET expires_at = ? WHERE owner = ? RETURNING job, epoch",
                (now + lease_s, instance)).fetchall()}
            live = self._exec(db, "SELECT COUNT(*) AS n FROM instances WHERE expires_at > ?",
                              (now,)).fetchone()["n"]
            total = self._exec(db, "SELECT COUNT(*) AS n FROM leases").fetchone()["n"]
            share = -(-int(total) // max(1, int(live)))
            want = share - len(held)
            if want < 0:
                # more than a fair share (an instance joined): hand the surplus back, for the
                # newcomer to take at its next heartbeat
                for job in sorted(held)[want:]:
                    self._exec(db, "UPDATE leases SET owner = NULL, expires_at = NULL "
                               "WHERE job = ?", (job,))
                    del held[job]
            elif want > 0:
                free = self._exec(
                    db, "SELECT job FROM leases WHERE owner IS NULL OR expires_at < ? "
                    "ORDER BY job LIMIT ?" + self.FOR_UPDATE + self.SKIP_LOCKED,
                    (now, want)).fetchall()
                for r in free:
                    got = self._exec(db, "UPDATE leases SET owner = ?, epoch = epoch + 1, "
                                     "expires_at = ?, taken_at = ? WHERE job = ? "
                                     "RETURNING epoch", (instance, now + lease_s, now,
                                                          r["job"])).fetchone()
                    held[r["job"]] = int(got["epoch"])
            return held

        return self._write(tx, notify=False)

    def take_lease(self, instance: str, job: str, lease_s: float) -> int | None:
        """Take a job's lease now if it is free or expired (a new job, registered here);
        its epoch, or None when another instance holds it."""
        def tx(db):
            now = self._now(db)
            row = self._exec(db, "SELECT owner, expires_at, epoch FROM leases WHERE job = ?"
                             + self.FOR_UPDATE + self.SKIP_LOCKED, (job,)).fetchone()
            if row is None:
                return None
            if row["owner"] == instance:
                return int(row["epoch"])
            if row["owner"] is not None and row["expires_at"] is not None and \
                    row["expires_at"] >= now:
                return None
            return int(self._exec(db, "UPDATE leases SET owner = ?, epoch = epoch + 1, "
                                  "expires_at = ?, taken_at = ? WHERE job = ? RETURNING epoch",
                                  (instance, now + lease_s, now, job)).fetchone()["epoch"])

        return self._write(tx, notify=False)

    def release_leases(self, instance: str) -> None:
        """Give up every lease of `instance` (a clean stop: others take its jobs at once)."""
        def tx(db):
            self._exec(db, "UPDATE leases SET owner = NULL, expires_at = NULL WHERE owner = ?",
                       (instance,))
            self._exec(db, "DELETE FROM instances WHERE id = ?", (instance,))
        self._write(tx, notify=False)

    def leases(self) -> list[dict]:
        """Every job's lease: owner, epoch, expiry, when taken."""
        return self._rows("SELECT job, owner, epoch, expires_at, taken_at FROM leases ORDER BY job")


def _upsert(table: str, columns: tuple, key: tuple) -> str:
    """INSERT of a whole row that replaces the row with the same key (both dialects)."""
    names = ", ".join(columns)
    values = ", ".join(f":{c}" for c in columns)
    updates = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in key)
    return (f"INSERT INTO {table} ({names}) VALUES ({values}) "
            f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET {updates}")


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
