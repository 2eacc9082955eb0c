"""Reads of the shard state (snapshot, status), off the commit thread.

Anyone may GET a data set's snapshot or status (no token), and a snapshot of 65,536 shards x 10
epochs is 655,360 rows: run on the commit thread, five of them stalled every other job's leases
for seconds. Here they run on a reader thread with its own SQLite connection (WAL: readers never
block the writer, and see a consistent committed state), the JSON is built in chunks (the GIL is
given back between them), a snapshot's bytes are kept while its data set is unchanged (the same
snapshot asked again costs nothing), and the number of queued reads is bounded (503 past it, to
a caller at its share of the bound, never to one with none queued: see ReadSide._admit).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from contextvars import ContextVar
from dataclasses import asdict

import msgspec

from stragglers.adapt.dataset import FAILED, STATES, TODO, DatasetConfig
from stragglers.adapt.errors import Busy, NotFound, Quarantined
from stragglers.adapt.replies import FailedShard, Status
from stragglers.adapt.stored import (check_all_rows, check_dataset_row, check_materialized,
                                     check_rows_key, config_of, first_bad_shard)
from stragglers.adapt.space import corrupt_file
from stragglers.adapt.turns import TakeTurns
from stragglers.errors import EnvironmentFailure

CHUNK_ROWS = 4096
# whose turn a read takes on the reader thread (the service sets it for each request: its
# token, else its client): a job's first lease of a data set reads the data set's limits there,
# and waited for every snapshot build other clients had queued (0.33 s against 3.5 ms)
READ_KEY: ContextVar[Hashable] = ContextVar("stragglers_read_key", default=None)
BIG_SNAPSHOT = 2 << 20   # bytes (about 50,000 shard rows)
MAX_FAILED_IN_STATUS = 1024


def _dataset(conn: sqlite3.Connection, name: str) -> tuple[DatasetConfig, int, int, str]:
    """(config, epochs created, shard rows written of the last epoch, the key its rows are
    stored under), checked."""
    row = conn.execute("SELECT num_samples, shard_size, seed, num_epochs, lease_s, max_retries,"
                       " epochs_created, front, token_sha256, materialized, rows_key FROM"
                       " datasets WHERE name=?", (name,)).fetchone()
    if row is None:
        raise NotFound(f"no data set named '{name}'")
    cfg = config_of(name, row[:6])
    check_dataset_row(name, row[6], row[7], row[8])
    return cfg, row[6], check_materialized(cfg, row[9]), check_rows_key(name, row[10])


def _unwritten(cfg: DatasetConfig, epochs: int, written: int):
    """The snapshot rows of the last epoch's shards not written yet: TODO, in queue order."""
    epoch, n = epochs - 1, cfg.num_shards
    base = epoch * (n + 1) + 1
    return [[epoch, s, "TODO", 0, 0, base + s, None] for s in range(written, n)]


def folded_epochs(conn: sqlite3.Connection, cfg: DatasetConfig, epochs: int, written: int,
                  key: str) -> int:
    """The epochs a snapshot folds: those before the first with a shard TODO or DOING."""
    first = conn.execute("SELECT MIN(epoch) FROM shards WHERE dataset=? AND state IN"
                         " ('TODO','DOING')", (key,)).fetchone()[0]
    last = epochs - 1 if written < cfg.num_shards else epochs   # (unwritten rows: TODO)
    return last if first is None else min(first, last)


def snapshot_bytes(conn: sqlite3.Connection, name: str) -> bytes:
    """The snapshot of data set `name` as JSON bytes (checked first: a damaged row quarantines it)."""
    with _read(conn):
        cfg, epochs, written, key = _dataset(conn, name)
        first_bad_shard(conn, cfg, epochs, written, key)
        # Epochs before the first with a shard to do or held are folded: their DONE rows are
        # not listed (a restore writes them back DONE). Listing every row of every epoch done
        # (~30 bytes each) made a long training's own snapshot pass max_restore_bytes.
        folded = folded_epochs(conn, cfg, epochs, written, key)
        head = json.dumps({"dataset": asdict(cfg), "epochs_created": epochs},
                          separators=(",", ":"))
        parts = [head[:-1].encode(), b',"shards":[']
        cur = conn.execute("SELECT epoch, shard, state, consumed, retries, queue_pos, error"
                           " FROM shards WHERE dataset=? AND (epoch>=? OR state!='DONE')"
                           " ORDER BY epoch, shard", (key, folded))
        first = True
        tail = _unwritten(cfg, epochs, written)
        while rows := cur.fetchmany(CHUNK_ROWS) or tail:
            if rows is tail:
                rows, tail = tail[:CHUNK_ROWS], tail[CHUNK_ROWS:]
            # One chunk per json.dumps call: the C encoder holds the GIL for a whole call.
            text = json.dumps(rows, separators=(",", ":"))[1:-1]
            parts.append(text.encode() if first else b"," + text.encode())
            first = False
        parts.append(b'],"folded_epochs":%d}' % folded)
    return b"".join(parts)


def status_of(conn: sqlite3.Connection, name: str) -> Status:
    """Shard counts per epoch and state, and the FAILED report (first MAX_FAILED_IN_STATUS)."""
    with _read(conn):
        cfg, epochs, written, key = _dataset(conn, name)
        counts: dict[int, dict[str, int]] = {}
        for epoch, state, n in conn.execute("SELECT epoch, state, COUNT(*) FROM shards WHERE"
                                            " dataset=? GROUP BY epoch, state", (key,)):
            if state not in STATES or type(epoch) is not int:
                first_bad_shard(conn, cfg, epochs, written, key)
            counts.setdefault(epoch, {s: 0 for s in STATES})[state] = n
        if written < cfg.num_shards:   # the last epoch's shards not written yet are TODO
            last = counts.setdefault(epochs - 1, {s: 0 for s in STATES})
            last[TODO] += cfg.num_shards - written
        rows = conn.execute("SELECT epoch, shard, start, stop, consumed, retries, error FROM"
                            " shards WHERE dataset=? AND state='FAILED' ORDER BY epoch, shard"
                            " LIMIT ?", (key, MAX_FAILED_IN_STATUS)).fetchall()
        total = sum(c[FAILED] for c in counts.values())
        try:
            failed = [FailedShard(e, s, b - a - k, r, err) for e, s, a, b, k, r, err in rows]
        except TypeError:
            first_bad_shard(conn, cfg, epochs, written, key)
            raise
    return Status(cfg, epochs, {str(e): v for e, v in sorted(counts.items())}, failed, total)


def status_bytes(conn: sqlite3.Connection, name: str) -> bytes:
    """status_of as JSON bytes."""
    return msgspec.json.encode(status_of(conn, name))


def check_dataset(conn: sqlite3.Connection, name: str) -> None:
    """The full check of a data set's rows (its first call's, stored.check_all_rows), here off
    the commit thread: Quarantined naming the first damaged row, NotFound where none."""
    with _read(conn):
        cfg, epochs, written, key = _dataset(conn, name)
        check_all_rows(conn, cfg, epochs, written, key)


def has_expired(conn: sqlite3.Connection, name: str, now: float) -> bool:
    """Whether a DOING lease of `name` ended before `now` (then the writer must requeue it);
    NotFound for an unknown data set (answered here, never by the writer)."""
    row = conn.execute("SELECT COALESCE(rows_key, name) FROM datasets WHERE name=?",
                       (name,)).fetchone()
    if row is None:
        raise NotFound(f"no data set named '{name}'")
    row = conn.execute("SELECT 1 FROM shards WHERE dataset=? AND state='DOING' AND"
                       " lease_until<? LIMIT 1", (row[0], now)).fetchone()
    return row is not None


def owner_of(conn: sqlite3.Connection, name: str) -> tuple[bool, str | None]:
    """(exists, owner digest) of a data set."""
    row = conn.execute("SELECT token_sha256 FROM datasets WHERE name=?", (name,)).fetchone()
    if row is None:
        return False, None
    check_dataset_row(name, 0, 0, row[0])
    return True, row[0]


def owner_rows(conn: sqlite3.Connection) -> list[tuple[str, str | None]]:
    """(name, owner digest) of every data set whose stored owner is well-formed."""
    out = []
    for name, owner in conn.execute("SELECT name, token_sha256 FROM datasets"):
        try:
            check_dataset_row(name, 0, 0, owner)
        except Quarantined:
            continue   # (its first call quarantines it)
        out.append((name, owner))
    return out


def owners(conn: sqlite3.Connection) -> list[str]:
    """The token digests that own a data set (no new tokens when they create again)."""
    return [r[0] for r in conn.execute("SELECT DISTINCT token_sha256 FROM datasets"
                                       " WHERE token_sha256 IS NOT NULL")]


def read_only_connection(db, busy_timeout_s: float) -> sqlite3.Connection:
    """A connection that only reads (query_only), waiting up to busy_timeout_s for a lock."""
    conn = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
    conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_s * 1000)}")
    conn.execute("PRAGMA query_only=1")
    return conn


def _incarnation(gen: object) -> object:
    """The incarnation of a generation (ShardStore's); one without is its own."""
    return getattr(gen, "incarnation", gen)


class _read:
    """One read transaction: every query inside sees the same committed state."""

    def __init__(self, conn: sqlite3.Connection):
        self.conn = conn

    def __enter__(self):
        self.conn.execute("BEGIN")

    def __exit__(self, typ, exc, tb) -> None:
        try:
            self.conn.execute("COMMIT" if typ is None else "ROLLBACK")
        finally:
            # (a read of a damaged page failed, then its COMMIT too: the connection stayed
            # in that transaction, every later read on it saw that old state)
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")


def read_failed(db: str, exc: sqlite3.Error) -> EnvironmentFailure:
    """The 503 of a read the database refused: a page of the file damaged (a torn write, a bad
    block), no descriptor for the reader's connection, an I/O error. (Each was a 500 on every
    read of it: a status, a snapshot, a data set's first lease.)"""
    if corrupt_file(exc):
        return EnvironmentFailure("shard store", f"{db} is damaged ({exc}): what is stored"
                                  " there cannot be read; restore the data sets from their"
                                  " snapshots into a new file")
    return EnvironmentFailure("shard store", f"a read of {db} failed ({type(exc).__name__}:"
                              f" {exc}); retry later")


class _Flight:
    """A status or snapshot build its callers share: run in the turn of whichever caller's
    comes first (`turns`, one a caller's key), its bytes (or error) in `result`."""

    def __init__(self):
        self.result: asyncio.Future = asyncio.get_running_loop().create_future()
        self.turns: dict[Hashable, asyncio.Task] = {}
        self.started = False   # (set on the reader thread: the build runs once)


class ReadSide:
    """A reader thread with its own connection, a snapshot cache and a bound on queued reads;
    the service's reads (`read`, `snapshot`, `status`) taken in turns by READ_KEY (TakeTurns).

    `generation(name)` must change after every commit that touched `name` (ShardStore does it
    after the COMMIT returned), so a cached snapshot is never older than what a caller saw
    acknowledged; its `incarnation` (where it has one) must change when the data set is deleted
    or created again: a stale body is served only within one incarnation.
    """

    def __init__(self, db: str, generation, max_queued: int = 64,
                 cache_bytes: int = 256 << 20, busy_timeout_s: float = 10.0):
        self.db, self.generation = db, generation
        self.max_queued, self.cache_bytes = max_queued, cache_bytes
        self.busy_timeout_s = busy_timeout_s
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shard-reads")
        self._turns = TakeTurns(self._pool)
        self._local = threading.local()
        self._conns: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._queued = 0
        self._by_key: dict[Hashable, int] = {}   # queued reads by READ_KEY
        self._cache: OrderedDict[tuple, tuple[object, bytes, float]] = OrderedDict()
        self._flights: dict[tuple, _Flight] = {}
        self.computed = 0  # snapshots built (not served from the cache)
        self.threads_used: set[str] = set()  # names of the threads reads ran on (tested)

    def _conn(self) -> sqlite3.Connection:
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = read_only_connection(self.db, self.busy_timeout_s)
            self._local.conn = conn
            with self._lock:
                self._conns.append(conn)
        return conn

    def submit(self, fn, *args) -> Future:
        """Run fn(conn, *args) on the reader thread now, in no turn (a start's own reads);
        Busy past the bound on queued reads (see _admit)."""
        key = READ_KEY.get()
        self._admit(key)
        try:
            fut = self._pool.submit(self._run, fn, args)
        except BaseException:
            self._done(key)
            raise
        fut.add_done_callback(lambda _: self._done(key))
        return fut

    async def read(self, fn, *args):
        """fn(conn, *args) on the reader thread in READ_KEY's turn (from the event loop); Busy
        past the bound on queued reads (see _admit)."""
        key = READ_KEY.get()
        self._admit(key)
        try:
            return await self._turns.run(key, self._run, fn, args)
        finally:
            self._done(key)   # (a read whose caller left while it waited is counted out too)

    def idle(self) -> bool:
        """Whether no read is queued or running (one asked now runs at once)."""
        with self._lock:
            return self._queued == 0

    def _run(self, fn, args):
        self.threads_used.add(threading.current_thread().name)
        try:
            return fn(self._conn(), *args)
        except sqlite3.Error as exc:
            raise read_failed(self.db, exc) from exc

    def _admit(self, key: Hashable) -> None:
        """Count a read of `key` in, or Busy: past max_queued reads in all, a caller is refused
        only at its share of them (max_queued over the callers with reads queued), and one
        with no read queued always gets a place (callers are bounded: known tokens, client
        addresses). One bound for all made one client's queued GETs refuse another job's first
        lease; refusing everyone past twice the bound let a client and a few tokens of its own,
        each within its share, refuse a job's first read (503 though it had none queued)."""
        with self._lock:
            mine = self._by_key.get(key, 0)
            if self._queued >= self.max_queued and mine:
                share = self.max_queued // len(self._by_key)
                if mine >= share:
                    raise Busy(f"{self._queued} reads are queued, {mine} of them this"
                               " caller's; retry in a moment")
            self._queued += 1
            self._by_key[key] = mine + 1

    def _done(self, key: Hashable) -> None:
        with self._lock:
            self._queued -= 1
            left = self._by_key[key] - 1
            if left:
                self._by_key[key] = left
            else:
                del self._by_key[key]

    async def snapshot(self, name: str, stale_s: float = 0.0) -> bytes:
        """The snapshot bytes: from the cache while the data set is unchanged.

        `stale_s`: a big cached snapshot (BIG_SNAPSHOT bytes or more) built less than that
        long ago is served even if the data set changed since (callers that do not own it:
        a stranger polling the snapshot of a data set in training cannot make the reader
        rebuild 655,360 rows after every commit).
        """
        return await self._cached("snapshot", name, snapshot_bytes, stale_s)

    async def status(self, name: str) -> bytes:
        """The status JSON bytes: from the cache while the data set is unchanged."""
        return await self._cached("status", name, status_bytes)

    async def _cached(self, kind: str, name: str, build, stale_s: float = 0.0) -> bytes:
        gen = self.generation(name)
        key = (kind, name)
        with self._lock:
            hit = self._cache.get(key)
            # (stale: only of this incarnation; a deleted data set's snapshot was served as
            # the one created again under its name, another owner's, for stale_s)
            if hit is not None and (hit[0] == gen or (
                    len(hit[1]) >= BIG_SNAPSHOT and time.monotonic() - hit[2] < stale_s
                    and _incarnation(hit[0]) == _incarnation(gen))):
                self._cache.move_to_end(key)
                return hit[1]
            flight = self._flights.get((key, gen))
            if flight is None:   # (else the same read is under way: shared)
                flight = self._flights[(key, gen)] = _Flight()
                flight.result.add_done_callback(lambda _: self._forget_flight(key, gen))
        caller = READ_KEY.get()
        if caller not in flight.turns:
            # a turn of this caller's that builds it unless another caller's came first: in
            # the first caller's turn alone, a job's GET of its own snapshot joining a build
            # another client had queued behind its own reads waited for all of them
            flight.turns[caller] = asyncio.ensure_future(
                self._turn(flight, caller, key, gen, build))
        # (shielded: one caller gone does not cancel the build the others wait for)
        return await asyncio.shield(flight.result)

    async def _turn(self, flight: _Flight, caller: Hashable, key: tuple, gen, build) -> None:
        """One caller's turn at a shared build: built here if no other turn built it first,
        the flight's result set (its error: the build's, or Busy where no turn is left)."""
        try:
            body = await self.read(self._fly, flight, key, gen, build)
        except asyncio.CancelledError:
            raise
        except Busy as exc:   # (this caller past its share: another caller's turn may build)
            if flight.started or any(not t.done() for k, t in flight.turns.items()
                                     if k != caller):
                return
            if not flight.result.done():
                flight.result.set_exception(exc)
            return
        except BaseException as exc:  # noqa: BLE001 - every caller gets the build's error
            if not flight.result.done():
                flight.result.set_exception(exc)
            return
        if body is not None and not flight.result.done():
            flight.result.set_result(body)
        if flight.result.done():   # the other callers' turns are no longer needed
            for other, turn in flight.turns.items():
                if other != caller and not turn.done():
                    turn.cancel()

    def _fly(self, conn: sqlite3.Connection, flight: _Flight, key: tuple, gen, build):
        """The shared build, on the reader thread, unless a turn built it already (None)."""
        if flight.started:
            return None
        flight.started = True
        return self._build(conn, key, gen, build)

    def forget(self, name: str) -> None:
        """Drop the cached bodies of data set `name` (deleted: they are no one's now)."""
        with self._lock:
            for kind in ("snapshot", "status"):
                self._cache.pop((kind, name), None)

    def _forget_flight(self, key: tuple, gen) -> None:
        with self._lock:
            self._flights.pop((key, gen), None)

    def _build(self, conn: sqlite3.Connection, key: tuple, gen, build) -> bytes:
        body = build(conn, key[1])
        if key[0] == "snapshot":
            self.computed += 1
        with self._lock:
            if len(body) <= self.cache_bytes // 4:
                self._cache[key] = (gen, body, time.monotonic())
                self._cache.move_to_end(key)
                while sum(len(b) for _, b, _ in self._cache.values()) > self.cache_bytes:
                    self._cache.popitem(last=False)
        return body

    def close(self) -> None:
        """Stop the reader threads and close their connections (the last one to close folds
        the write-ahead log back into the file)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            conn.close()
