"""Durable shard state machine (TODO -> DOING -> DONE, FAILED) over SQLite in WAL mode.

A shard is a contiguous range of positions in an epoch's deterministic permutation of the
sample indices; only ranges are stored, indices are recomputed from (seed, epoch).

Every public method is one transaction (or one savepoint of a group commit, see `run_batch`):
it either happens entirely, reply included, or not at all. The store is assembled from one
part per responsibility: transactions.py (transactions, group commit), epochs.py (rows of an
epoch), history.py (replayed lease requests), restores.py (restores and quotas), schema.py.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stragglers.adapt import reads
from stragglers.adapt.dataset import (DOING, DONE, FAILED, MAX_EPOCHS, MAX_FAILED_IN_REPLY,  # noqa: F401
                                     MAX_FENCE, TODO, WORKER_PATTERN, DatasetConfig, check_name)
from stragglers.adapt.epochs import EPOCH_CHUNK, Epochs  # noqa: F401
from stragglers.adapt.errors import (Conflict, Fenced, Forbidden, LeaseLost, NotFound,  # noqa: F401
                                    Quarantined, QuotaExceeded, authorize)
from stragglers.adapt.floors import (STORE_FLOOR, next_fence, pin_fence_floor,  # noqa: F401
                                     raise_fence_floor)
from stragglers.adapt.history import REQUEST_HISTORY, LeaseHistory  # noqa: F401
from stragglers.adapt.permutations import Pending, Permutations
from stragglers.adapt.replies import (Acked, Created, FailedShard, Joined, Lease, LeaseReply,
                                      LeaseStatus, Released, SnapshotJson, Status,
                                      indices_json, lease_reply_json)
from stragglers.adapt.requeues import Requeues
from stragglers.adapt.restores import PreparedRestore, Restores, prepare_restore  # noqa: F401
# FENCED_OFF: workers.reply of a name a launcher released (no fence): its fence is burnt, every
# call of it Fenced until it joins again (a join clears it); like LEFT, its name has left.
# (Before, LEFT with the next fence: nobody held it, and a lease with it was served; files of
# schema 7 and older are swept at their upgrade, schema._MIGRATE_7.)
from stragglers.adapt.schema import (EXPIRED, FENCED_OFF, LEFT, SCHEMA_VERSION,  # noqa: F401
                                     open_database, unusable)
from stragglers.adapt.stored import (check_all_rows, check_dataset_row, check_rows_key,
                                     check_shard, check_worker_row, config_of, damaged)
from stragglers.adapt.transactions import Generation, Transactions
from stragglers.errors import InputError

log = logging.getLogger(__name__)

MAX_INDICES_PER_REPLY = 1 << 18
# a lease's indices up to this many are made a list on the commit thread when their shuffle is
# in memory (a few µs); more are left Pending for lease_json
INLINE_INDICES = 4096


class ShardStore(Transactions, Epochs, Requeues, LeaseHistory, Restores):
    """All shard bookkeeping; every method is one SQLite transaction (durable on return).

    `token_sha256` arguments: a data set created with one is owned by it; every later write on
    it must pass the same digest (compared in constant time), else Forbidden. `creator`
    arguments: the client address that creates (per-client quotas; None in-process).
    """

    def __init__(self, db: str | Path, durable: bool = True,
                 clock: Callable[[], float] = time.time,
                 busy_timeout_s: float = 10.0, max_datasets: int = 4096,
                 max_datasets_per_token: int = 64, max_datasets_per_client: int = 1024,
                 max_workers_per_dataset: int = 1024, max_rows_ahead: int = 1 << 18,
                 max_held_per_worker: int = 1024, unused_dataset_s: float = 60.0,
                 max_kept_floors: int = 1 << 16, max_workers_per_token: int = 4096,
                 max_shard_rows_per_token: int = 1 << 22):
        self.db = str(db)
        self.unused_dataset_s = unused_dataset_s
        self._created_at: dict[str, float] = {}
        self._started = clock()
        self._reclaimed: list[str] = []
        self.max_workers_per_dataset = max_workers_per_dataset
        # worker names all data sets of one token keep: each has its own allowances (held
        # shards, remembered replies, work credit, the token's allowance of requests in
        # progress), and 64 data sets x 1,024 names multiplied them 65,536-fold
        self.max_workers_per_token = max_workers_per_token
        # deleted data sets' fence floors kept by name; older ones fold into one (STORE_FLOOR)
        self.max_kept_floors = max_kept_floors
        # shards one worker may hold (DOING) at once: its release, or a join of its next
        # incarnation, requeues them all in one transaction on the commit thread
        self.max_held_per_worker = max_held_per_worker
        # shard rows an epoch may be written ahead of the oldest one still held (see _take)
        self.max_rows_ahead = max_rows_ahead
        # shard rows all data sets of one token hold (Restores._check_rows): each data set's
        # own bound above let one token's 64 write 64 x 2**18 = 16.7M rows without an ack
        self.max_shard_rows_per_token = max_shard_rows_per_token
        self.busy_timeout_s = busy_timeout_s
        self.max_datasets, self.max_datasets_per_token = max_datasets, max_datasets_per_token
        self.max_datasets_per_client = max_datasets_per_client
        self._clock = clock
        self._lock = threading.Lock()
        self._local = threading.local()
        self._conn = open_database(db, durable, busy_timeout_s)
        try:
            # Leases held while no service ran get a full lease from the first call after this
            # restart (see _expire): a long outage must not expire every in-flight lease.
            self._grace = {r[0] for r in self._conn.execute("SELECT name FROM datasets")}
            self._grace_until: dict[str, float] = {}
            # A restore that was being written when the last process stopped never finishes:
            # its rows are garbage, marked when a write fits (a start on a full disk marking
            # them failed: the service could not start again where they held the space).
            self._cut_short = [r[0] for r in self._conn.execute(
                "SELECT rows_key FROM row_sets WHERE state='writing'")]
        except sqlite3.DatabaseError as exc:
            raise unusable(db, exc) from exc
        self._keys: dict[str, str] = {}   # data set -> the key its shard rows are stored under
        self.permutations = Permutations()
        self._read_conns: list[sqlite3.Connection] = []
        # True in the service: a lease whose epoch's shuffle is not in memory carries Pending
        # indices, computed off the commit thread (service.py); False: computed here.
        self.defer_indices = False
        # Per data set, the commits it was born at and last touched at, numbers of one
        # counter (read caches are keyed by them, see reads.ReadSide and generation), kept
        # for the data sets that exist (those of the file: born before any commit here);
        # _touched: the names of the running transaction, _gone: those it deleted.
        self._gen: dict[str, tuple[int, int]] = {name: (0, 0) for name in self._grace}
        self._ext_gen = self._commits = self._deletes = 0
        self._touched: set[str] = set()
        self._gone: set[str] = set()
        # Data sets whose rows were checked in full since the file was opened (or last written
        # by another process), and those found damaged: every call on them is refused.
        self._verified: set[str] = set()
        self._quarantined: dict[str, Quarantined] = {}
        self._owners: dict[str, str | None] = {}   # owner digests seen (read caches use them)
        # Derived state kept in memory so that a lease does not query it again (see _Tx):
        # per data set, a lower bound of the earliest DOING lease_until (no lease can have
        # expired before it) and the FAILED report of lease replies. Dropped whenever another
        # connection committed (PRAGMA data_version) or one of our calls was rolled back.
        self._next_expiry: dict[str, float] = {}
        self._failed_cache: dict[str, tuple[list[FailedShard], int]] = {}
        # data set -> its leading epochs known to hold no TODO or DOING row (Restores._check_rows)
        self._closed_epochs: dict[str, int] = {}
        self._configs: dict[tuple[object, ...], DatasetConfig] = {}  # (name, *row) -> config
        # in-memory changes of the running call, undone on rollback
        self._undo: list[Callable[[], None]] = []
        self._data_version: int | None = None
        self.on_commit: Callable[[], None] | None = None


    def close(self) -> None:
        """Close the database connections, the writer's last: it folds the WAL into the file
        and cuts it to nothing, so the file alone holds every commit (the last connection's
        close then deletes the empty log)."""
        for conn in self._read_conns:
            conn.close()
        self._read_conns = []
        with self._lock:
            try:
                self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.ProgrammingError:
                return   # closed already (serve() closes the store after the app has)
            except sqlite3.Error as exc:   # a full disk: the log keeps the commits (read back
                # at the next open), the file cannot take them now
                log.warning("folding the shard store's WAL at close failed: %s", exc)
            self._conn.close()

    def grant_grace(self) -> None:
        """After a pause of the service (no calls could be answered), treat it like a restart.

        The next call on each data set renews every DOING lease to a full lease_s from then.
        """
        with self._lock:
            self._grace = {r[0] for r in self._conn.execute("SELECT name FROM datasets")}

    def forget_expiries(self) -> None:
        """Drop the kept bounds of the next lease expiry (the wall clock stepped back): the
        next call on each data set scans its leases."""
        with self._lock:
            self._next_expiry.clear()

    def _config(self, c: sqlite3.Connection, name: str, token_sha256: str | None = None,
                write: bool = True) -> tuple[DatasetConfig, int, int]:
        row = c.execute("SELECT num_samples, shard_size, seed, num_epochs, lease_s, max_retries,"
                        " epochs_created, front, token_sha256, rows_key FROM datasets WHERE name=?",
                        (name,)).fetchone()
        if row is None:
            raise NotFound(f"no data set named '{name}'")
        self._touched.add(name)
        cfg = self._verify(c, name, row[:6], row[6], row[7], row[8], row[9])
        if write:
            authorize(row[8], token_sha256, f"data set '{name}'")
        return cfg, row[6], row[7]

    def _fence(self, c: sqlite3.Connection, name: str, worker: str, fence: int) -> int:
        """Refuse a call of a fenced-off (or never joined) incarnation; the worker's seq."""
        row = c.execute("SELECT fence, seq, reply FROM workers WHERE dataset=? AND worker=?",
                        (name, worker)).fetchone()
        return _check_fence(row, name, worker, fence)

    def _config_fence(self, c: sqlite3.Connection, name: str, worker: str, fence: int,
                      token_sha256: str | None) -> tuple[DatasetConfig, int, int, int, Any]:
        """_config then _fence (same checks, same order) in one query: the lease/ack path;
        also the worker's mark of a name that left (LEFT, EXPIRED; None)."""
        row = c.execute("SELECT d.num_samples, d.shard_size, d.seed, d.num_epochs, d.lease_s,"
                        " d.max_retries, d.epochs_created, d.front, d.token_sha256, d.rows_key,"
                        " w.fence, w.seq, w.reply FROM datasets d LEFT JOIN workers w ON"
                        " w.dataset=d.name AND w.worker=? WHERE d.name=?",
                        (worker, name)).fetchone()
        if row is None:
            raise NotFound(f"no data set named '{name}'")
        self._touched.add(name)
        cfg = self._verify(c, name, row[:6], row[6], row[7], row[8], row[9])
        authorize(row[8], token_sha256, f"data set '{name}'")
        seq = _check_fence(None if row[10] is None else row[10:13], name, worker, fence)
        return cfg, row[6], row[7], seq, row[12]

    def _verify(self, c: sqlite3.Connection, name: str, values: tuple[Any, ...],
                epochs_created: Any, front: Any, owner: Any,
                rows_key: Any = None) -> DatasetConfig:
        """The data set's config, its row checked; all its rows checked at its first call.

        A damaged row quarantines the data set (every later call refused, 503) until another
        process changes the file; other data sets are served as before.
        """
        if name in self._quarantined:
            raise self._quarantined[name]
        try:
            check_dataset_row(name, epochs_created, front, owner)
            self._keys[name] = check_rows_key(name, rows_key)
            self._owners[name] = owner
            cfg = self._config_of(name, values)
            if name not in self._verified:
                check_all_rows(c, cfg, epochs_created, self._materialized(c, cfg),
                               self._keys[name])
                self._verified.add(name)
        except Quarantined as exc:
            self._quarantined[name] = exc
            raise
        return cfg

    def _key(self, name: str) -> str:
        """The key the shard rows of data set `name` are stored under (its config was read in
        this transaction: a restore changes it)."""
        return self._keys.get(name, name)

    def owner_digest(self, name: str) -> str | None:
        """The owner's token digest of a data set a call has seen (None: none or unknown)."""
        return self._owners.get(name)

    def checked(self, name: str, seen: Generation, damage: Quarantined | None) -> None:
        """Record a full check of data set `name` made on a reader (reads.check_dataset) at
        generation `seen`: verified, or quarantined by `damage`; nothing where it may have
        changed since (a commit touched it, another process wrote: its next call checks it).
        (Run on the commit thread, the check made there held every job's calls: an anonymous
        status GET of a 655,360-row data set stalled another job's lease 0.78 s.)"""
        with self._tx():
            if self.generation(name) != seen or name in self._touched:
                return
            if damage is None:
                self._verified.add(name)
            else:
                self._quarantined[name] = damage

    def raise_if_quarantined(self, name: str) -> None:
        """Quarantined if a call on `name` found a damaged row (reads check this first)."""
        exc = self._quarantined.get(name)
        if exc is not None:
            raise exc

    def _config_of(self, name: str, values: tuple[object, ...]) -> DatasetConfig:
        """The DatasetConfig of a datasets row, reused while the row's values are the same
        (building the frozen dataclass was ~4% of a one-shard lease's CPU)."""
        key = (name, *values)
        cfg = self._configs.get(key)
        if cfg is None:
            if len(self._configs) >= 1024:
                self._configs.clear()
            cfg = self._configs[key] = config_of(name, values)
        return cfg

    # -- public API -----------------------------------------------------------------------
    def create_dataset(self, cfg: DatasetConfig, token_sha256: str | None = None,
                       creator: str | None = None) -> Created:
        """Register a data set (idempotent for the same config and owner; otherwise refused)."""
        cfg.validate()
        with self._tx() as c:
            row = c.execute("SELECT num_samples, shard_size, seed, num_epochs, lease_s,"
                            " max_retries, token_sha256 FROM datasets WHERE name=?",
                            (cfg.name,)).fetchone()
            if row is not None:
                check_dataset_row(cfg.name, 0, 0, row[6])
                authorize(row[6], token_sha256, f"data set '{cfg.name}'")
                have = dict(zip(("num_samples", "shard_size", "seed", "num_epochs", "lease_s",
                                 "max_retries"), row[:6]))
                want = {k: getattr(cfg, k) for k in have}
                if have != want:
                    diff = {k: [have[k], want[k]] for k in have if have[k] != want[k]}
                    raise Conflict(f"data set '{cfg.name}' exists with another config"
                                   f" (existing, requested): {diff}")
                return Created(False)
            self._check_quota(c, token_sha256, creator, reclaim=True)
            self._touched.add(cfg.name)
            # (rolled back, the name exists no more than before: no generation kept for it)
            self._undo.append(lambda: self._gone.add(cfg.name))
            pin_fence_floor(c, cfg.name)
            key = self._fresh_key(c, cfg.name)
            c.execute("INSERT INTO datasets VALUES (?,?,?,?,?,?,?,0,0,?,0,?,?)",
                      (cfg.name, cfg.num_samples, cfg.shard_size, cfg.seed, cfg.num_epochs,
                       cfg.lease_s, cfg.max_retries, token_sha256, key, creator))
            self._keys[cfg.name] = key or cfg.name
            self._check_rows(c, cfg.name, min(cfg.num_shards, EPOCH_CHUNK))
            self._create_epoch(c, cfg, 0)
            self._created_at[cfg.name] = self._clock()
            # (its rows are the ones written here: nothing to check at its first call, which
            # was a reader's read before its owner's first write, behind other callers' reads)
            self._verified.add(cfg.name)
            self._undo.append(lambda: self._verified.discard(cfg.name))
        return Created(True)

    def _read_conn(self) -> sqlite3.Connection:
        """This thread's read-only connection (reads that must not wait for the commit thread)."""
        conn = getattr(self._local, "read_conn", None)
        if conn is None:
            conn = reads.read_only_connection(self.db, self.busy_timeout_s)
            self._local.read_conn = conn
            self._read_conns.append(conn)
        return conn

    def _lease_of(self, cfg: DatasetConfig, epoch: int, shard: int, start: int, stop: int,
                  consumed: int) -> Lease:
        """One shard handed to a worker: the sample indices still to consume, from `offset`."""
        check_shard(cfg, epoch, shard, start, stop, consumed)
        return Lease(epoch, shard, consumed, self._indices(cfg, epoch, start + consumed, stop),
                     stop - start)

    def _indices(self, cfg: DatasetConfig, epoch: int, start: int, stop: int) -> list[int] | Pending:
        key = (cfg.num_samples, cfg.seed, epoch)
        if start >= stop:
            return []
        if self.defer_indices and stop - start > INLINE_INDICES:
            # made a list and JSON a chunk at a time off this thread (replies.indices_json):
            # 65,536 indices per shard, 4 shards a lease, replayed in a loop, held it ~0.1 s each
            return Pending(key, start, stop)
        perm = self.permutations.cached(key)
        if perm is not None:
            return perm[start:stop].tolist()
        if self.defer_indices:
            return Pending(key, start, stop)   # a shuffle of up to 2**26: not on this thread
        return self.permutations.indices(key, start, stop)

    def join(self, name: str, worker: str, token_sha256: str | None = None,
             error: str | None = None, limit: int | None = None,
             leaving: bool = False) -> Joined:
        """Start a new incarnation of `worker`: a new fence; shards of earlier ones go back
        (at most `limit` of them here: the service gives the rest back in steps, give_back).

        Calls carrying an older fence are refused from now on (Fenced), so a hung predecessor
        with the same name can neither ack nor lease after its successor joined. `leaving`
        (a launcher's release): the fence is burnt, FENCED_OFF — no call can use it, nobody
        runs it — and its name has left (see _take_place_of_left) until it joins again; a name
        with no row (never joined, or gave its place) has no incarnation to fence off: nothing
        is stored and the fence is 0 (none).
        """
        check_name(worker, "worker", WORKER_PATTERN)
        with self._tx() as c:
            cfg, _, front = self._config(c, name, token_sha256)
            row = c.execute("SELECT fence, reply FROM workers WHERE dataset=? AND worker=?",
                            (name, worker)).fetchone()
            if row is None and leaving:
                # (a row made for it held the next fence, which a lease then used though no
                # join had handed it out: a name that never joined leased shards)
                return Joined(0, self._release_rows(c, cfg, front, worker, None, True,
                                                    joined_error(worker, 0, error), None, limit))
            if row is not None:
                check_worker_row(name, worker, row[0], 0)
                # (fenced off already: its burnt fence again, so launchers' releases in a loop
                # do not use fences up)
                fence = row[0] if leaving and row[1] == FENCED_OFF else \
                    next_fence(name, worker, row[0])
            else:
                fence = self._new_name_fence(c, name, worker)
            c.execute("INSERT OR REPLACE INTO workers VALUES (?,?,?,NULL,?,0)",
                      (name, worker, fence, FENCED_OFF if leaving else None))
            # The request history belongs to the incarnation: a new one starts without it.
            c.execute("DELETE FROM lease_requests WHERE dataset=? AND worker=?", (name, worker))
            if row is None:   # (a name new to it: its token's workers share less each)
                self._trim_history(c, name)
            released = self._release_rows(c, cfg, front, worker, None, True,
                                          joined_error(worker, fence, error), fence, limit)
        return Joined(fence, released)

    def lease(self, name: str, worker: str, fence: int, count: int = 1,
              request_id: str | None = None, token_sha256: str | None = None,
              gate: Callable[[Pending], None] | None = None) -> LeaseReply:
        """Hand up to `count` shards to `worker` (status "ok"), or none: "wait" or "finished".

        At most MAX_INDICES_PER_REPLY sample indices in all (at least one shard). `gate` is
        shown each range of the reply whose permutation is not in memory (nor its JSON kept),
        before the commit: it may raise (errors.ShufflePaused) to roll the lease back.

        A request id seen before (any of this incarnation's last REQUEST_HISTORY) gets the
        answer of its first attempt again: the same shards (those still held renewed, from
        their current offset; those acked or lost with no indices left), never a new one.
        """
        now = self._clock()
        with self._tx() as c:
            cfg, epochs_created, front0, seq, mark = self._config_fence(c, name, worker, fence,
                                                                        token_sha256)
            front = self._expire(c, cfg, front0, now, (worker, fence))
            if front != front0:
                c.execute("UPDATE datasets SET front=? WHERE name=?", (front, name))
            # (a worker whose lease expired and that calls has not gone, whatever the answer:
            # its retry of a timed-out call, a replay, included; it kept the mark and a new
            # name took its place)
            if mark == EXPIRED:
                c.execute("UPDATE workers SET reply=NULL WHERE dataset=? AND worker=?",
                          (name, worker))
            if request_id is not None:
                seen = c.execute("SELECT status, reply FROM lease_requests WHERE dataset=? AND"
                                 " worker=? AND request_id=?",
                                 (name, worker, request_id)).fetchone()
                if seen is not None:
                    replayed = self._replay(c, cfg, worker, fence, seen, now)
                    _gate(self.permutations, replayed.leases, gate)
                    return replayed
            # Up to MAX_INDICES_PER_REPLY indices in a reply (256 shards of 65,536 made a reply
            # of 16.7M integers, encoded on the event loop): fewer shards, never none.
            count = min(count, max(1, MAX_INDICES_PER_REPLY // cfg.shard_size))
            # (a worker that leased 262,144 shards and joined again held every other job's
            # calls for seconds while they were requeued: past the bound, "wait")
            count = min(count, self.max_held_per_worker - c.execute(
                "SELECT COUNT(*) FROM shards WHERE dataset=? AND worker=? AND state='DOING'",
                (self._key(name), worker)).fetchone()[0])
            leases, epochs_created = self._take(c, cfg, worker, fence, count, epochs_created,
                                                now)
            _gate(self.permutations, leases, gate)
            # (a worker that released and leases again has not left)
            if leases and mark == LEFT:
                c.execute("UPDATE workers SET reply=NULL WHERE dataset=? AND worker=?",
                          (name, worker))
            failed, n_failed = self._failed_report(c, name)
            status: LeaseStatus = "ok"
            if not leases:
                doing = c.execute("SELECT 1 FROM shards WHERE dataset=? AND state='DOING'"
                                  " LIMIT 1", (self._key(name),)).fetchone()
                status = "wait" if doing else "finished"
            if request_id is not None:
                self._remember(c, name, worker, fence, seq, request_id, status, leases)
        return LeaseReply(status, leases, failed, n_failed)

    def _take(self, c: sqlite3.Connection, cfg: DatasetConfig, worker: str, fence: int, want: int,
              epochs_created: int, now: float) -> tuple[list[Lease], int]:
        """Lease up to `want` shards from the queue's head (new epochs as TODO runs out)."""
        leases: list[Lease] = []
        deadline = now + cfg.lease_s
        while len(leases) < want:
            # The queue's head in one statement (RETURNING: SQLite >= 3.35).
            rows = c.execute("UPDATE shards SET state='DOING', worker=?, fence=?,"
                             " lease_until=? WHERE rowid IN (SELECT rowid FROM shards WHERE"
                             " dataset=? AND state='TODO' ORDER BY queue_pos LIMIT ?)"
                             " RETURNING queue_pos, epoch, shard, start, stop, consumed",
                             (worker, fence, deadline, self._key(cfg.name),
                              want - len(leases))).fetchall()
            if rows:
                self._leased_until(cfg.name, deadline)
            try:
                rows.sort()
            except TypeError:   # a damaged queue_pos (text among integers)
                raise damaged(cfg.name, "shard row", "queue_pos is not an integer") from None
            done = 0
            for _, epoch, shard, start, stop, consumed in rows:
                if type(consumed) is int and type(start) is int and type(stop) is int \
                        and consumed == stop - start:
                    # no sample left (an edited row): DONE, not a lease of no indices that
                    # nobody acks, retried until FAILED
                    c.execute("UPDATE shards SET state='DONE', worker=NULL, fence=NULL,"
                              " lease_until=NULL WHERE dataset=? AND epoch=? AND shard=?",
                              (self._key(cfg.name), epoch, shard))
                    done += 1
                    continue
                leases.append(self._lease_of(cfg, epoch, shard, start, stop, consumed))
            if done:
                continue   # TODO rows may be left behind those
            if len(leases) < want:  # no TODO row: write more of the epoch, or a new epoch
                have = self._materialized(c, cfg)
                if have < cfg.num_shards:
                    self._check_rows(c, cfg.name, min(cfg.num_shards - have, EPOCH_CHUNK))
                    self._extend_epoch(c, cfg, epochs_created - 1, have)
                    continue
                # (a data set without an end still ends at MAX_EPOCHS: one epoch more is a
                # state its own read checks and a restore of its snapshot refuse)
                if epochs_created >= (cfg.num_epochs or MAX_EPOCHS):
                    break
                # A new epoch only while the one `ahead` epochs before it has nothing held or
                # queued: a worker leasing in a loop and never acking had a new epoch written
                # whenever the open ones were all held (2**20 epochs of up to 65,536 rows
                # without an end). Past it: "wait", as when peers hold the last shards.
                ahead = max(2, -(-self.max_rows_ahead // cfg.num_shards))
                old = epochs_created - ahead
                if old >= 0 and c.execute(
                        "SELECT 1 FROM shards WHERE dataset=? AND epoch=? AND state IN"
                        " ('TODO', 'DOING') LIMIT 1", (self._key(cfg.name), old)).fetchone():
                    break
                self._check_rows(c, cfg.name, min(cfg.num_shards, EPOCH_CHUNK))
                self._create_epoch(c, cfg, epochs_created)
                epochs_created += 1
        return leases, epochs_created

    def ack(self, name: str, worker: str, fence: int, epoch: int, shard: int, consumed: int,
            token_sha256: str | None = None) -> Acked:
        """Record that `worker` consumed the first `consumed` samples of its shard; renews the lease.

        Idempotent: a repeated or older ack changes nothing, and an ack of a shard this
        incarnation completed answers DONE again.
        """
        return self.ack_progress(name, worker, fence, epoch, shard, consumed, token_sha256)[0]

    def ack_progress(self, name: str, worker: str, fence: int, epoch: int, shard: int,
                     consumed: int, token_sha256: str | None = None) -> tuple[Acked, float]:
        """`ack`, and the share of its shard it moved forward (0: a repeated or older ack)."""
        now = self._clock()
        with self._tx() as c:
            cfg, epochs_created, _, _, mark = self._config_fence(c, name, worker, fence,
                                                                 token_sha256)
            row = c.execute("SELECT state, worker, fence, start, stop, consumed FROM shards"
                            " WHERE dataset=? AND epoch=? AND shard=?",
                            (self._key(name), epoch, shard)).fetchone()
            if row is None:
                if epoch < epochs_created and shard < cfg.num_shards:   # not written yet: TODO
                    raise LeaseLost(f"shard {epoch}/{shard} of '{name}' is TODO, not leased to"
                                    f" {worker} fence {fence}")
                raise InputError("shard service", "shard", f"no shard {epoch}/{shard} in '{name}'")
            state, holder, holder_fence, start, stop, done = row
            check_shard(cfg, epoch, shard, start, stop, done, state)
            if not 0 <= consumed <= stop - start:
                raise InputError("shard service", "consumed",
                                 f"expected 0..{stop - start}, got {consumed}")
            mine = holder == worker and holder_fence == fence
            if state == DONE and mine:
                return Acked(DONE, done), 0
            if state != DOING or not mine:
                raise LeaseLost(f"shard {epoch}/{shard} of '{name}' is {state}"
                                f" (held by {holder}), not leased to {worker} fence {fence}")
            consumed = max(consumed, done)
            new_state = DONE if consumed == stop - start else DOING
            c.execute("UPDATE shards SET consumed=?, state=?, lease_until=? WHERE dataset=? AND"
                      " epoch=? AND shard=?", (consumed, new_state, now + cfg.lease_s,
                                               self._key(name), epoch, shard))
            self._leased_until(name, now + cfg.lease_s)
            if mark is not None:   # (marked gone, a lease expired or released: it acks)
                c.execute("UPDATE workers SET reply=NULL WHERE dataset=? AND worker=?",
                          (name, worker))
        return Acked(new_state, consumed), (consumed - done) / (stop - start)

    def release(self, name: str, worker: str, fence: int | None = None, failure: bool = True,
                error: str | None = None, token_sha256: str | None = None,
                limit: int | None = None) -> Released:
        """Return the DOING shards of `worker` to the front of TODO (a failure counts a retry;
        at most `limit` here: the service gives the rest back in steps, give_back).

        With `fence`, the worker gives back its own shards (and must be current); the name
        has left until it leases again. Without, a launcher that saw the worker die fences off
        every incarnation of it: none is current until the name joins again (`join`, leaving;
        a name that never joined: nothing stored). Either way, once it holds no shard, a new
        name at max_workers_per_dataset may take its place (_take_place_of_left).
        """
        if fence is None:
            reply = self.join(name, worker, token_sha256, released_error(worker, error), limit,
                              leaving=True)
            return Released(reply.released)
        with self._tx() as c:
            cfg, _, front = self._config(c, name, token_sha256)
            self._fence(c, name, worker, fence)
            c.execute("UPDATE workers SET reply=? WHERE dataset=? AND worker=?",
                      (LEFT, name, worker))
            released = self._release_rows(c, cfg, front, worker, fence, failure,
                                          release_error(worker, failure, error), None, limit)
        return Released(released)

    def _new_name_fence(self, c: sqlite3.Connection, name: str, worker: str) -> int:
        """The first fence of a worker name new to data set `name`: one above every fence of
        a name that gave its place or of a deleted data set of its name (1 while none did;
        QuotaExceeded at max_workers_per_dataset, or max_workers_per_token over all the
        owner's data sets, when no name of this one that left holds nothing; Quarantined
        where its floor is damaged, see schema.pin_fence_floor)."""
        # each worker name keeps a row and up to REQUEST_HISTORY lease replies: names
        # invented in a loop would grow the file without bound
        n = c.execute("SELECT COUNT(*) FROM workers WHERE dataset=?", (name,)).fetchone()[0]
        if n >= self.max_workers_per_dataset:
            if not self._take_place_of_left(c, name):
                raise QuotaExceeded(f"data set '{name}' has {n} workers, its limit"
                                    f" (max_workers_per_dataset={self.max_workers_per_dataset}),"
                                    " none of them released holding nothing; join with a name"
                                    " used before, or release one that left")
            owner = None   # (its place taken: the token's count is as it was)
        else:
            owner = c.execute("SELECT token_sha256 FROM datasets WHERE name=?",
                              (name,)).fetchone()
        if owner is not None and owner[0] is not None:
            # (one token's data sets, each under its own limit, added up: 64 x 1,024 names,
            # each with its own allowances; counted only for a name new to its data set)
            mine = c.execute("SELECT COUNT(*) FROM workers w JOIN datasets d ON d.name ="
                             " w.dataset WHERE d.token_sha256=?", (owner[0],)).fetchone()[0]
            if mine >= self.max_workers_per_token and not self._take_place_of_left(c, name):
                raise QuotaExceeded(f"this token's data sets have {mine} workers, its limit"
                                    f" (max_workers_per_token={self.max_workers_per_token}),"
                                    f" none of data set '{name}''s released holding nothing;"
                                    " join with a name used before, or release one that left")
        # (its own floor; a data set of a file that did not pin one at its creation takes the
        # store's into a row of its own here, once)
        return next_fence(name, worker, pin_fence_floor(c, name))

    def _take_place_of_left(self, c: sqlite3.Connection, name: str) -> bool:
        """Delete the longest-joined workers row of `name` that left (LEFT, FENCED_OFF,
        EXPIRED) and holds no shard, with its lease request history: its place of
        max_workers_per_dataset is a new name's (pods named anew at each start kept every place for good, then every join 429).
        False: no such row. The row's fence goes into the data set's fence floor (a row of its
        own, kept across restarts: a restart with a higher limit gave new names fence 1 again),
        which every new name's incarnations start above: no incarnation of the deleted name,
        should it come back, is current again."""
        key = self._key(name)
        row = c.execute("SELECT worker, fence FROM workers w WHERE dataset=? AND reply IN"
                        " (?,?,?) AND NOT EXISTS (SELECT 1 FROM shards INDEXED BY shards_holder WHERE"
                        " dataset=? AND worker=w.worker AND state='DOING') ORDER BY rowid LIMIT 1",
                        (name, LEFT, EXPIRED, FENCED_OFF, key)).fetchone()
        if row is None:
            return False
        raise_fence_floor(c, name, row[1])
        c.execute("DELETE FROM workers WHERE dataset=? AND worker=?", (name, row[0]))
        c.execute("DELETE FROM lease_requests WHERE dataset=? AND worker=?", (name, row[0]))
        return True

    def workers_of(self, token_sha256: str) -> int:
        """Workers joined to the data sets this token owns (each name once a data set)."""
        row = self._read_conn().execute(
            "SELECT COUNT(*) FROM workers w JOIN datasets d ON d.name = w.dataset"
            " WHERE d.token_sha256 = ?", (token_sha256,)).fetchone()
        return int(row[0])

    def status(self, name: str) -> Status:
        """Shard counts per epoch and state, plus the report of FAILED shards (after expiry)."""
        self.expire(name)
        return reads.status_of(self._read_conn(), name)

    def snapshot(self, name: str) -> SnapshotJson:
        """The full shard state, to be saved atomically inside the model checkpoint."""
        snap: SnapshotJson = json.loads(reads.snapshot_bytes(self._read_conn(), name))
        return snap


def joined_error(worker: str, fence: int, error: str | None) -> str:
    """The error a join records on the shards it gives back."""
    return error or f"{worker} restarted (fence {fence})"


def released_error(worker: str, error: str | None) -> str:
    """The error a release without a fence (a join) records on the shards it gives back."""
    return error or f"{worker} released"


def release_error(worker: str, failure: bool, error: str | None) -> str | None:
    """The error a worker's own release records on the shards it gives back."""
    return error or (f"released by {worker}" if failure else None)


def _check_fence(row: Sequence[Any] | None, name: str, worker: str, fence: int) -> int:
    """The request counter (seq) of a current incarnation's workers row (fence, seq, mark),
    else Fenced."""
    if row is None:
        raise Fenced(f"worker '{worker}' has not joined '{name}' (POST .../join first)")
    seq = 0 if row[1] is None else row[1]
    check_worker_row(name, worker, row[0], seq)
    if row[2] == FENCED_OFF:
        raise Fenced(f"worker '{worker}' was released from '{name}' without a fence (its"
                     f" launcher saw it die): fence {fence} and every other of its incarnations"
                     " are fenced off until it joins again (POST .../join)")
    if fence > row[0]:
        raise Fenced(f"worker '{worker}' fence {fence} was never handed out: the current"
                     f" incarnation of it on '{name}' is fence {row[0]} (a join hands out"
                     " fences; POST .../join for one)")
    if row[0] != fence:
        raise Fenced(f"worker '{worker}' fence {fence} is stale: incarnation {row[0]} of"
                     f" it joined '{name}' since; this one must stop")
    return seq


def _gate(perms: Permutations, leases: list[Lease],
          gate: Callable[[Pending], None] | None) -> None:
    """Show `gate` each Pending range of `leases` that needs a shuffle (its permutation not in
    memory, its JSON not kept)."""
    if gate is not None:
        for lease in leases:
            p = lease.indices
            if isinstance(p, Pending) and perms.wanted(p) and perms.cached(p.key) is None:
                gate(p)


def lease_json(store: ShardStore, reply: LeaseReply, perms: dict | None = None) -> bytes:
    """The JSON of a lease reply whose Pending indices are read from their permutations
    (`perms`, by key, computed already; others computed here if needed) and encoded a chunk
    at a time (for a thread of its own)."""
    def json_of(lease):
        pending = lease.indices
        if isinstance(pending, Pending):   # (kept: a replay of it is sent as it was written)
            return store.permutations.json(pending, indices_json,
                                           (perms or {}).get(pending.key))
        return indices_json(pending)

    return lease_reply_json(reply, json_of)
