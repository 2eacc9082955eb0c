"""Durable shard state machine (TODO -> DOING -> DONE, FAILED) over SQLite in WAL mode.

A shard is a contiguous range of positions in an epoch's deterministic permutation of the
sample indices; only ranges are stored, indices are recomputed from (seed, epoch).
"""

from __future__ import annotations

import math
import sqlite3
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from stragglers.errors import InputError, StragglersError

TODO, DOING, DONE, FAILED = "TODO", "DOING", "DONE", "FAILED"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS datasets (
    name TEXT PRIMARY KEY, num_samples INTEGER, shard_size INTEGER, seed INTEGER,
    num_epochs INTEGER, lease_s REAL, max_retries INTEGER, epochs_created INTEGER,
    front INTEGER);
CREATE TABLE IF NOT EXISTS shards (
    dataset TEXT, epoch INTEGER, shard INTEGER, start INTEGER, stop INTEGER,
    state TEXT, worker TEXT, lease_until REAL, consumed INTEGER, retries INTEGER,
    queue_pos INTEGER, error TEXT, PRIMARY KEY (dataset, epoch, shard));
CREATE INDEX IF NOT EXISTS shards_queue ON shards (dataset, state, queue_pos);
CREATE INDEX IF NOT EXISTS shards_lease ON shards (dataset, state, lease_until);
"""


class LeaseLost(StragglersError):
    """The worker no longer holds the shard (lease expired and the shard was requeued)."""


@dataclass(frozen=True)
class DatasetConfig:
    """How a data set is cut into shards and how long a lease lasts."""

    name: str
    num_samples: int
    shard_size: int
    seed: int = 0
    num_epochs: int | None = 1  # None: unbounded, new epochs as long as workers pull
    lease_s: float = 30.0
    max_retries: int = 3

    def validate(self, source: str = "dataset") -> None:
        """Raise InputError for a config that cannot be served."""
        if not self.name or "/" in self.name:
            raise InputError(source, "name", "expected a non-empty name without '/'")
        if self.num_samples < 1:
            raise InputError(source, "num_samples", f"expected >= 1, got {self.num_samples}")
        if self.shard_size < 1:
            raise InputError(source, "shard_size", f"expected >= 1, got {self.shard_size}")
        if self.num_epochs is not None and self.num_epochs < 1:
            raise InputError(source, "num_epochs", f"expected >= 1 or null, got {self.num_epochs}")
        if not self.lease_s > 0:
            raise InputError(source, "lease_s", f"expected > 0 seconds, got {self.lease_s}")
        if self.max_retries < 0:
            raise InputError(source, "max_retries", f"expected >= 0, got {self.max_retries}")


@dataclass
class Lease:
    """One shard handed to a worker: the sample indices still to consume, from `offset`."""

    epoch: int
    shard: int
    offset: int
    indices: list[int]
    size: int


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The deterministic shuffle of epoch `epoch` (same seed and epoch, same order)."""
    return np.random.default_rng([seed, epoch]).permutation(num_samples)


class ShardStore:
    """All shard bookkeeping; every method is one SQLite transaction (durable on return)."""

    def __init__(self, db: str | Path, durable: bool = True, clock=time.time):
        self.db = str(db)
        self._clock = clock
        self._lock = threading.Lock()
        self._local = threading.local()
        try:
            self._conn = sqlite3.connect(self.db, isolation_level=None, check_same_thread=False)
            self._conn.execute("PRAGMA journal_mode=WAL")
            # FULL: the WAL is fsynced at every commit, so an acknowledged lease/ack survives
            # a crash of the machine, not only of the process.
            self._conn.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
            self._conn.execute("PRAGMA busy_timeout=10000")
            self._conn.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:
            raise InputError(db, None, f"not a usable SQLite database ({exc})") from exc
        self._perm_cache: dict[tuple[str, int], np.ndarray] = {}

    def close(self) -> None:
        """Close the database connection."""
        self._conn.close()

    # -- transactions -------------------------------------------------------------------
    def _tx(self):
        """One transaction, or a savepoint when running inside run_batch (group commit)."""
        store = self

        class _Tx:
            def __enter__(self):
                if getattr(store._local, "in_batch", False):
                    store._conn.execute("SAVEPOINT op")
                    return store._conn
                store._lock.acquire()
                store._conn.execute("BEGIN IMMEDIATE")
                return store._conn

            def __exit__(self, typ, exc, tb):
                if getattr(store._local, "in_batch", False):
                    if typ is not None:
                        store._conn.execute("ROLLBACK TO op")
                    store._conn.execute("RELEASE op")
                    return
                try:
                    store._conn.execute("COMMIT" if typ is None else "ROLLBACK")
                finally:
                    store._lock.release()

        return _Tx()

    def run_batch(self, calls: list) -> list[tuple[bool, object]]:
        """Group commit: run several store calls in one transaction, one fsync for all.

        Each call is isolated by a savepoint, so one that fails is rolled back alone; the
        results are (ok, value-or-exception), and none is durable before the single COMMIT.
        """
        results: list[tuple[bool, object]] = []
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            self._local.in_batch = True
            try:
                for call in calls:
                    try:
                        results.append((True, call()))
                    except Exception as exc:  # noqa: BLE001 - handed back to its caller
                        results.append((False, exc))
            finally:
                self._local.in_batch = False
            try:
                self._conn.execute("COMMIT")
            except sqlite3.Error as exc:
                self._conn.execute("ROLLBACK")
                return [(False, exc) for _ in calls]
        return results

    def _config(self, c: sqlite3.Connection, name: str) -> tuple[DatasetConfig, int, int]:
        row = c.execute("SELECT num_samples, shard_size, seed, num_epochs, lease_s, max_retries,"
                        " epochs_created, front FROM datasets WHERE name=?", (name,)).fetchone()
        if row is None:
            raise InputError("shard service", "dataset", f"no data set named '{name}'")
        cfg = DatasetConfig(name, row[0], row[1], row[2], row[3], row[4], row[5])
        return cfg, row[6], row[7]

    # -- public API -----------------------------------------------------------------------
    def create_dataset(self, cfg: DatasetConfig) -> dict:
        """Register a data set (idempotent for the same config; a different one is an error)."""
        cfg.validate()
        with self._tx() as c:
            row = c.execute("SELECT num_samples, shard_size, seed, num_epochs FROM datasets"
                            " WHERE name=?", (cfg.name,)).fetchone()
            if row is not None:
                if tuple(row) != (cfg.num_samples, cfg.shard_size, cfg.seed, cfg.num_epochs):
                    raise InputError("shard service", "dataset",
                                     f"'{cfg.name}' already exists with a different config {row}")
                c.execute("UPDATE datasets SET lease_s=?, max_retries=? WHERE name=?",
                          (cfg.lease_s, cfg.max_retries, cfg.name))
                return {"created": False}
            c.execute("INSERT INTO datasets VALUES (?,?,?,?,?,?,?,0,0)",
                      (cfg.name, cfg.num_samples, cfg.shard_size, cfg.seed, cfg.num_epochs,
                       cfg.lease_s, cfg.max_retries))
            self._create_epoch(c, cfg, 0)
        return {"created": True}

    def _create_epoch(self, c: sqlite3.Connection, cfg: DatasetConfig, epoch: int) -> None:
        n = math.ceil(cfg.num_samples / cfg.shard_size)
        base = epoch * (n + 1) + 1  # queue positions after everything of earlier epochs
        rows = [(cfg.name, epoch, s, s * cfg.shard_size,
                 min((s + 1) * cfg.shard_size, cfg.num_samples), TODO, None, None, 0, 0,
                 base + s, None) for s in range(n)]
        c.executemany("INSERT INTO shards VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
        c.execute("UPDATE datasets SET epochs_created=? WHERE name=?", (epoch + 1, cfg.name))

    def _requeue(self, c, cfg: DatasetConfig, front: int, epoch: int, shard: int,
                 retries: int, failure: bool, error: str | None) -> int:
        """Put a DOING shard back at the front of TODO, or FAILED past the retry bound."""
        retries = retries + (1 if failure else 0)
        front -= 1
        state = FAILED if retries > cfg.max_retries else TODO
        c.execute("UPDATE shards SET state=?, worker=NULL, lease_until=NULL, retries=?,"
                  " queue_pos=?, error=COALESCE(?, error) WHERE dataset=? AND epoch=? AND shard=?",
                  (state, retries, front, error, cfg.name, epoch, shard))
        return front

    def _expire(self, c, cfg: DatasetConfig, front: int, now: float) -> int:
        expired = c.execute("SELECT epoch, shard, retries, worker FROM shards WHERE dataset=?"
                            " AND state='DOING' AND lease_until<?", (cfg.name, now)).fetchall()
        for epoch, shard, retries, worker in expired:
            front = self._requeue(c, cfg, front, epoch, shard, retries, True,
                                  f"lease of {worker} expired")
        return front

    def _indices(self, cfg: DatasetConfig, epoch: int, start: int, stop: int) -> list[int]:
        key = (cfg.name, epoch)
        perm = self._perm_cache.get(key)
        if perm is None:
            if len(self._perm_cache) > 8:
                self._perm_cache.clear()
            perm = self._perm_cache[key] = epoch_permutation(cfg.num_samples, cfg.seed, epoch)
        return perm[start:stop].tolist()

    def lease(self, name: str, worker: str) -> dict:
        """Hand the next shard to `worker`: {"status": "ok", "lease": ...}, "wait" or "finished"."""
        now = self._clock()
        with self._tx() as c:
            cfg, epochs_created, front = self._config(c, name)
            front = self._expire(c, cfg, front, now)
            row = c.execute("SELECT epoch, shard, start, stop, consumed FROM shards WHERE"
                            " dataset=? AND state='TODO' ORDER BY queue_pos LIMIT 1",
                            (name,)).fetchone()
            if row is None and (cfg.num_epochs is None or epochs_created < cfg.num_epochs):
                self._create_epoch(c, cfg, epochs_created)
                epochs_created += 1
                row = c.execute("SELECT epoch, shard, start, stop, consumed FROM shards WHERE"
                                " dataset=? AND state='TODO' ORDER BY queue_pos LIMIT 1",
                                (name,)).fetchone()
            c.execute("UPDATE datasets SET front=? WHERE name=?", (front, name))
            if row is None:
                doing = c.execute("SELECT COUNT(*) FROM shards WHERE dataset=? AND"
                                  " state='DOING'", (name,)).fetchone()[0]
                failed = self._failed(c, name)
                return {"status": "wait" if doing else "finished", "failed": failed}
            epoch, shard, start, stop, consumed = row
            c.execute("UPDATE shards SET state='DOING', worker=?, lease_until=? WHERE dataset=?"
                      " AND epoch=? AND shard=?", (worker, now + cfg.lease_s, name, epoch, shard))
            failed = self._failed(c, name)
        lease = Lease(epoch, shard, consumed, self._indices(cfg, epoch, start + consumed, stop),
                      stop - start)
        return {"status": "ok", "lease": lease.__dict__.copy(), "failed": failed}

    def ack(self, name: str, worker: str, epoch: int, shard: int, consumed: int) -> dict:
        """Record that `worker` consumed the first `consumed` samples of its shard; renews the lease."""
        now = self._clock()
        with self._tx() as c:
            cfg, _, _ = self._config(c, name)
            row = c.execute("SELECT state, worker, start, stop, consumed FROM shards WHERE"
                            " dataset=? AND epoch=? AND shard=?", (name, epoch, shard)).fetchone()
            if row is None:
                raise InputError("shard service", "shard", f"no shard {epoch}/{shard} in '{name}'")
            state, holder, start, stop, done = row
            if state != DOING or holder != worker:
                raise LeaseLost(f"shard {epoch}/{shard} of '{name}' is {state}"
                                f" (held by {holder}), not leased to {worker}")
            if not 0 <= consumed <= stop - start:
                raise InputError("shard service", "consumed",
                                 f"expected 0..{stop - start}, got {consumed}")
            consumed = max(consumed, done)
            new_state = DONE if consumed == stop - start else DOING
            c.execute("UPDATE shards SET consumed=?, state=?, lease_until=? WHERE dataset=? AND"
                      " epoch=? AND shard=?", (consumed, new_state, now + cfg.lease_s, name,
                                               epoch, shard))
        return {"state": new_state, "consumed": consumed}

    def release(self, name: str, worker: str, failure: bool = True,
                error: str | None = None) -> dict:
        """Return every DOING shard of `worker` to the front of TODO (a failure counts a retry)."""
        with self._tx() as c:
            cfg, _, front = self._config(c, name)
            rows = c.execute("SELECT epoch, shard, retries FROM shards WHERE dataset=? AND"
                             " state='DOING' AND worker=?", (name, worker)).fetchall()
            for epoch, shard, retries in rows:
                front = self._requeue(c, cfg, front, epoch, shard, retries, failure,
                                      error or (f"released by {worker}" if failure else None))
            c.execute("UPDATE datasets SET front=? WHERE name=?", (front, name))
        return {"released": [[e, s] for e, s, _ in rows]}

    def retry_failed(self, name: str) -> dict:
        """Put every FAILED shard back at the front of TODO with its retry count reset."""
        with self._tx() as c:
            cfg, _, front = self._config(c, name)
            rows = c.execute("SELECT epoch, shard FROM shards WHERE dataset=? AND"
                             " state='FAILED'", (name,)).fetchall()
            for epoch, shard in rows:
                front -= 1
                c.execute("UPDATE shards SET state='TODO', retries=0, queue_pos=? WHERE"
                          " dataset=? AND epoch=? AND shard=?", (front, name, epoch, shard))
            c.execute("UPDATE datasets SET front=? WHERE name=?", (front, name))
        return {"requeued": [list(r) for r in rows]}

    def _failed(self, c, name: str) -> list[dict]:
        rows = c.execute("SELECT epoch, shard, start, stop, consumed, retries, error FROM shards"
                         " WHERE dataset=? AND state='FAILED'", (name,)).fetchall()
        rows.sort()  # in Python: an ORDER BY here makes SQLite scan the primary key
        return [{"epoch": e, "shard": s, "samples": b - a - k, "retries": r, "error": err}
                for e, s, a, b, k, r, err in rows]

    def status(self, name: str) -> dict:
        """Shard counts per epoch and state, plus the report of FAILED shards."""
        now = self._clock()
        with self._tx() as c:
            cfg, epochs_created, front = self._config(c, name)
            front = self._expire(c, cfg, front, now)
            c.execute("UPDATE datasets SET front=? WHERE name=?", (front, name))
            counts: dict[int, dict[str, int]] = {}
            for epoch, state, n in c.execute("SELECT epoch, state, COUNT(*) FROM shards WHERE"
                                             " dataset=? GROUP BY epoch, state", (name,)):
                counts.setdefault(epoch, {TODO: 0, DOING: 0, DONE: 0, FAILED: 0})[state] = n
            failed = self._failed(c, name)
        return {"dataset": asdict(cfg), "epochs_created": epochs_created,
                "epochs": {str(e): v for e, v in sorted(counts.items())}, "failed": failed}

    def snapshot(self, name: str) -> dict:
        """The full shard state, to be saved atomically inside the model checkpoint."""
        with self._tx() as c:
            cfg, epochs_created, _ = self._config(c, name)
            rows = c.execute("SELECT epoch, shard, state, consumed, retries, queue_pos, error"
                             " FROM shards WHERE dataset=? ORDER BY epoch, shard",
                             (name,)).fetchall()
        return {"dataset": asdict(cfg), "epochs_created": epochs_created,
                "shards": [list(r) for r in rows]}

    def restore(self, snap: dict) -> dict:
        """Replace a data set's state with a snapshot: its DOING shards go first, then TODO."""
        try:
            cfg = DatasetConfig(**snap["dataset"])
            epochs_created = int(snap["epochs_created"])
            rows = [tuple(r) for r in snap["shards"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError("snapshot", None, f"not a shard snapshot ({exc})") from exc
        cfg.validate("snapshot")
        doing = sorted((r for r in rows if r[2] == DOING), key=lambda r: r[5])
        with self._tx() as c:
            c.execute("DELETE FROM shards WHERE dataset=?", (cfg.name,))
            c.execute("INSERT OR REPLACE INTO datasets VALUES (?,?,?,?,?,?,?,?,0)",
                      (cfg.name, cfg.num_samples, cfg.shard_size, cfg.seed, cfg.num_epochs,
                       cfg.lease_s, cfg.max_retries, 0))
            for e in range(epochs_created):
                self._create_epoch(c, cfg, e)
            front = min([0] + [r[5] for r in rows]) - len(doing) - 1
            pos_of_doing = {(r[0], r[1]): front + i for i, r in enumerate(doing)}
            c.executemany("UPDATE shards SET state=?, consumed=?, retries=?, queue_pos=?, error=?"
                          " WHERE dataset=? AND epoch=? AND shard=?",
                          [(TODO if st == DOING else st, consumed, retries,
                            pos_of_doing.get((e, s), pos), err, cfg.name, e, s)
                           for e, s, st, consumed, retries, pos, err in rows])
            c.execute("UPDATE datasets SET front=? WHERE name=?", (front, cfg.name))
        return {"restored": len(rows), "requeued_first": len(doing)}
