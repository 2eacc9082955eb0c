"""The data-sharding service: HTTP over ShardStore (group commit) plus the per-job control plane.

Run standalone with `stragglers adapt serve --db FILE`, or embedded in rank 0 with
`EmbeddedServer(db).start()` (a uvicorn server on a daemon thread). Every route reads its body
with a size limit and validates it with a strict model (`requests.py`); every write needs the
owning job's bearer token. Errors are `{"error", "kind", "field"}` with a 4xx status that says
whose fault it is (400 bad field, 401 no token, 403 wrong token, 404 unknown, 409 conflict or
lost lease, 413 body too large, 415 a body not declared JSON) or 503 when the store
itself failed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import json
import logging
import os
import queue
import sqlite3
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from stragglers.adapt import reads
from stragglers.adapt import requests as rq
from stragglers.adapt.claim import Claim, claim
from stragglers.adapt.control import ControlPlane, PacedThread
from stragglers.adapt.controller import Actions, ControlConfig
from stragglers.adapt.dataset import MAX_LEASE_S, MAX_SHARD_SIZE, MIN_LEASE_S, DatasetConfig, \
    check_name
from stragglers.adapt.errors import HTTP_STATUS, BodyTooLarge, BodyTooSlow, Busy, DiskFull, \
    Forbidden, NotFound, Quarantined, RateLimited, ShufflePaused, Unauthorized, \
    UnsupportedMediaType, authorize
from stragglers.adapt.folding import WalFolder
from stragglers.adapt.paced import PacedWriter
from stragglers.adapt.permutations import Pending
from stragglers.adapt.replies import (Acked, Created, Deleted, Health, Joined, LeaseReply,
                                      Released, Requeued, Restored, to_builtins)
from stragglers.adapt.requeues import GIVE_BACK_STEP, RETRY_CHUNK
from stragglers.adapt.restore_parse import SnapshotParser
from stragglers.adapt.shards import INLINE_INDICES, MAX_INDICES_PER_REPLY, ShardStore, \
    joined_error, lease_json, release_error, released_error
from stragglers.adapt.space import Reserve, corrupt_file, io_error, out_of_space
from stragglers.adapt.turns import PacedKeys, TakeTurns
from stragglers.adapt.uploads import CountedBody
from stragglers.adapt.working import WorkCredit
from stragglers.config import Config, setting
from stragglers.errors import EnvironmentFailure, InputError, StragglersError
from stragglers.serving import REQUEST_CLIENT, TOKEN_PATTERN, BodyRefused, base_url, \
    canonical_decimal, declared_length, is_loopback, \
    listen_socket, read_bounded, serve_in_foreground, serve_in_thread, uvicorn_server
from stragglers.serving_guard import ErrorBody, admit_body, park
from stragglers.serving_quota import DEFERRED, AnonymousPace, Backpressure, CpuContention, \
    MintRate, RateLimited as MintRefused, quota_client

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger(__name__)

SERVICE_TOKEN_HEADER = "x-service-token"
MAX_SINCE = 9_999_999_999   # the `since` of GET .../control/actions (an action's sequence number)
# shuffles of more samples run on threads of their own (PacedKeys): at most this many at once
# (a 2**26 one holds 256 MiB while computed), each token paced to this share of one
# (a tenth: ten tokens making new 2**26 epochs in a loop take the one thread all shuffles had
# before, a legitimate job's one an epoch is far below it; the README says what it costs a
# job and why it stays until measured: ServiceConfig.shuffle_share)
BIG_SHUFFLE, SHUFFLE_THREADS, SHUFFLE_SHARE = 1 << 20, 2, 0.1
SHUFFLE_NICE = 10   # their threads' niceness above the service's
LEASE_GATE_TRIES = 3   # a lease's commits at most, big shuffles waited for between them


@dataclass(frozen=True)
class ServiceConfig(Config):
    """How the shard service runs."""

    host: str = setting("127.0.0.1", "address to listen on (non-loopback needs a service token)")
    port: int = setting(8151, "TCP port (0: any free port)", minimum=0, maximum=65535)
    durable: bool = setting(True, "fsync every commit (survives a machine crash)")
    max_body_bytes: int = setting(1 << 20, "largest request body", minimum=1024,
                                  maximum=1 << 26)
    max_restore_bytes: int = setting(1 << 26, "largest snapshot body (restore)", minimum=1024,
                                     maximum=1 << 30)
    busy_timeout_s: float = setting(10.0, "wait for a database lock held by another process",
                                    minimum=0.0, maximum=600.0)
    max_batch: int = setting(256, "calls group-committed in one transaction", minimum=1,
                             maximum=65536)
    keep_alive_s: float = setting(60.0, "idle keep-alive connection timeout", minimum=1.0,
                                  maximum=3600.0)
    max_connections: int = setting(1000, "connections served at once; past it new requests are "
                                   "answered 503 (idle or slow clients cannot take every file "
                                   "descriptor)", minimum=8, maximum=1_000_000)
    stall_s: float = setting(2.0, "a pause of the service longer than this (SIGSTOP, a frozen"
                             " VM) grants held leases a grace period, as a restart does",
                             minimum=0.5, maximum=3600.0)
    max_datasets: int = setting(4096, "data sets the service holds (past it: 429)", minimum=1,
                                maximum=1 << 20)
    max_datasets_per_token: int = setting(64, "data sets one job token may own (past it: 429)",
                                          minimum=1, maximum=1 << 20)
    max_jobs: int = setting(1024, "controllers the service holds (past it: 429)", minimum=1,
                            maximum=1 << 16)
    max_jobs_per_token: int = setting(16, "controllers one job token may own (past it: 429)",
                                      minimum=1, maximum=1 << 16)
    max_jobs_per_client: int = setting(256, "controllers one client address may create, under"
                                       " any tokens (past it: 429; minting tokens does not get"
                                       " one client every slot)", minimum=1, maximum=1 << 16)
    control_idle_s: float = setting(60.0, "a controller with no config or report this long"
                                    " (its agents report every 0.2 s) is idle: a new one that"
                                    " would pass a limit takes its places, longest-idle first",
                                    minimum=1.0, maximum=86400.0)
    max_control_records: int = setting(1 << 24, "step records all controllers may keep"
                                       " (world_size x (min(256, 4 x window) + 10) each,"
                                       " ~100 bytes a record; past it a config is 429)", minimum=1,
                                       maximum=1 << 32)
    max_control_records_per_token: int = setting(1 << 23, "step records one token's"
                                                 " controllers may keep (past it: 429)",
                                                 minimum=1, maximum=1 << 32)
    unused_dataset_s: float = setting(60.0, "a data set that holds nothing (no worker ever"
                                      " joined, every shard to do) this long after its"
                                      " creation is unused: a creation past max_datasets"
                                      " deletes the oldest such one to take its place",
                                      minimum=1.0, maximum=1e9)
    max_datasets_per_client: int = setting(1024, "data sets one client address may create,"
                                           " under any tokens (past it: 429)", minimum=1,
                                           maximum=1 << 20)
    max_workers_per_dataset: int = setting(1024, "worker names one data set keeps (each with"
                                           " up to 256 remembered lease replies; a join of a"
                                           " new name past it: 429)", minimum=1,
                                           maximum=1 << 20)
    max_workers_per_token: int = setting(4096, "worker names all data sets of one job token"
                                         " keep together (each with its own allowances: held"
                                         " shards, remembered replies, work credit; a join of"
                                         " a new name past it: 429)", minimum=1,
                                         maximum=1 << 26)
    max_kept_floors: int = setting(1 << 16, "fence floors kept by name (a data set's, kept"
                                   " past its DELETE: one created again under its name starts"
                                   " its workers' fences above the deleted one's); past it the"
                                   " oldest deleted names' fold into one floor of the store,"
                                   " which every new name then starts above", minimum=0,
                                   maximum=1 << 24)
    max_held_per_worker: int = setting(1024, "shards one worker may hold at once (a lease"
                                       " past it: \"wait\"); its release, or the join of its"
                                       " next incarnation, gives them back 128 a step",
                                       minimum=1, maximum=1 << 20)
    max_rows_ahead: int = setting(1 << 18, "shard rows a data set's epochs may be written"
                                  " ahead of its oldest epoch still held (a new epoch past it:"
                                  " \"wait\"; at least 2 epochs): leases never acked cannot"
                                  " write epochs without end", minimum=1024, maximum=1 << 30)
    max_shard_rows_per_token: int = setting(1 << 22, "shard rows all data sets of one job"
                                            " token hold together in epochs not done (from"
                                            " each one's first epoch with a shard not acked"
                                            " or failed; ~150 bytes each): a creation,"
                                            " restore or lease that would write past it: 429",
                                            minimum=1, maximum=1 << 34)
    # (SQLite's own auto-checkpoint is 1,000 pages, 4 MB: folded as often, but off the commit
    # thread, and the file cut back to it after a reader or a big restore grew it)
    wal_fold_bytes: int = setting(4 << 20, "size of the write-ahead log past which a thread of"
                                  " its own folds it into the database file (the log file is"
                                  " then cut back to it)", minimum=1 << 16, maximum=1 << 34)
    new_tokens_per_minute: float = setting(30.0, "tokens that may create their first data set"
                                           " or controller per minute, in all (past it: 429"
                                           " with Retry-After)", minimum=0.1, maximum=1e6)
    new_tokens_per_client_per_minute: float = setting(6.0, "the same, per client address (a"
                                                      " loopback client has no address quota:"
                                                      " the total above bounds it)",
                                                      minimum=0.1, maximum=1e6)
    restore_share: float = setting(0.25, "share of the commit thread a restore's writes may"
                                   " take (written in small steps, other jobs' calls between"
                                   " them)", minimum=0.01, maximum=1.0)
    shuffle_share: float = setting(SHUFFLE_SHARE, "share of a thread each token's big"
                                   " shuffles (over 2**20 samples) may take: its next one"
                                   " starts no sooner than its last one's CPU time x (1 -"
                                   " share) / share after it", minimum=0.01, maximum=1.0)
    max_restores: int = setting(1, "restores parsed and written at once, their bodies"
                                " arrived (one per token from its head; the others: 503)",
                                minimum=1, maximum=64)
    restore_wait_s: float = setting(60.0, "longest a restore whose body is here waits for"
                                    " a slot of max_restores (first come, first served; past"
                                    " it, 503)", minimum=0.0, maximum=3600.0)
    restore_bytes_held: int = setting(1 << 27, "bytes of restore bodies held at once, counted"
                                      " as they arrive until their restore is answered (past"
                                      " it: 503 to a token over its fair share, this over the"
                                      " tokens holding bytes)", minimum=1024, maximum=1 << 34)
    restore_upload_s: float = setting(300.0, "longest a restore body may take to arrive (it"
                                      " holds its token's restore place meanwhile: past it,"
                                      " 408; 64 MiB then needs 220 KB/s)", minimum=1.0,
                                      maximum=86400.0)
    restore_bytes_per_s: float = setting(float(4 << 20), "slowest a restore body may arrive,"
                                         " after restore_grace_s (it holds its token's restore"
                                         " place: a body of n bytes must arrive within"
                                         " restore_grace_s + n / this, at most"
                                         " restore_upload_s; past it, 408)", minimum=1024.0,
                                         maximum=float(1 << 40))
    restore_grace_s: float = setting(10.0, "time every restore body has before"
                                     " restore_bytes_per_s counts", minimum=0.1,
                                     maximum=3600.0)
    max_snapshot_sends: int = setting(1, "snapshot bodies sent at once to each owner's token,"
                                      " and to strangers in all (the others wait)",
                                      minimum=1, maximum=1024)
    snapshot_bytes_per_s: float = setting(float(256 << 20), "pace of a snapshot body sent to"
                                          " its owner (a 26 MB snapshot: 0.1 s)",
                                          minimum=float(1 << 20), maximum=float(1 << 40))
    stranger_snapshot_bytes_per_s: float = setting(float(16 << 20), "pace of a snapshot body"
                                                   " sent to a caller without the owner's token"
                                                   " (a 26 MB snapshot: 1.6 s; the owner's"
                                                   " sends never wait for these)",
                                                   minimum=float(1 << 16),
                                                   maximum=float(1 << 40))
    send_timeout_s: float = setting(10.0, "longest wait for a client to take the next 256 KiB"
                                    " of a snapshot (then its connection is closed: one that"
                                    " stopped reading held the send slot for good)",
                                    minimum=0.1, maximum=3600.0)
    refusal_delay_s: float = setting(0.25, "pause before answering a request refused as"
                                     " malformed (400, 413, 415): a client looping on bad"
                                     " bodies waits instead of taking the event loop other"
                                     " jobs' leases need", minimum=0.0, maximum=10.0)
    auth_failure_delay_s: float = setting(0.25, "pause before a 401/403 answer", minimum=0.0,
                                          maximum=10.0)
    stranger_snapshot_stale_s: float = setting(5.0, "age up to which a big snapshot (2 MiB+)"
                                               " is served to callers without the owner's token"
                                               " though the data set changed", minimum=0.0,
                                               maximum=3600.0)
    # 4 x 65,536 indices (1.7 MB of JSON) a token may be sent every 1/8 s: a replay of it costs
    # its caller nothing, and five clients replaying theirs in a loop (each reply kept, ~3 ms of
    # the service's CPU and their own to read it) held another job's lease + ack at 5x quiet
    lease_indices_per_token_s: float = setting(float(1 << 21), "pace of the sample indices of"
                                               " big lease replies (those written off the"
                                               " commit thread: shards over 4,096 samples, or"
                                               " an epoch not shuffled yet) sent to one token"
                                               " (without one: one client address), past one second's worth at"
                                               " once: a lease of shards over 4,096 samples"
                                               " past it waits, before it is committed",
                                               minimum=1024.0, maximum=float(1 << 40))
    reads_per_s: float = setting(50.0, "status and snapshot GETs answered per second to each"
                                 " caller (a known token, else a client address; its others"
                                 " wait their turn)", minimum=1.0, maximum=1e6)
    max_read_wait_s: float = setting(10.0, "longest wait for a read's turn (then 503)",
                                     minimum=0.1, maximum=600.0)
    max_queued_reads: int = setting(64, "snapshot/status reads waiting for the reader thread"
                                    " (past it: 503 to a caller at its share)", minimum=1,
                                    maximum=1 << 16)
    control_share: float = setting(0.25, "share of the time control calls (reports, actions,"
                                   " state) may hold the interpreter: each is followed by a"
                                   " pause before the next", minimum=0.01, maximum=1.0)
    max_control_calls_per_token: int = setting(4, "control calls of one token waiting or"
                                               " running (past it: 503, before the body is"
                                               " read)", minimum=1, maximum=1 << 16)
    max_control_calls: int = setting(64, "control calls waiting or running in all (past it:"
                                     " 503, once the body is here)", minimum=1,
                                     maximum=1 << 16)
    free_requests_per_token: int = setting(4, "requests of one token (or, without one, of one"
                                           " client address; all loopback ones together) in"
                                           " progress that never wait; past it each waits its"
                                           " turn at requests_per_token_s", minimum=1,
                                           maximum=1 << 16)
    # A job's workers share its token, so the pace sits above what a big job asks (1,024
    # workers leasing twice a second; the shard benchmark's 256 connections ask ~620 a
    # second): a backstop against a runaway owner, not a share of the service.
    requests_per_token_s: float = setting(2000.0, "pace of a token's requests past"
                                          " free_requests_per_token in progress (one owner"
                                          " looping on 256 connections was answered as fast as"
                                          " it asked, its clients spinning the CPUs other jobs"
                                          " need)", minimum=0.01, maximum=1e7)
    request_burst_per_token: float = setting(4000.0, "turns a token may take at once before"
                                             " requests_per_token_s counts", minimum=1.0,
                                             maximum=1e7)
    # Fair share under contention: one owner's 256 local connections, answered at 600 a second
    # as fast as their own CPU let them ask, kept another job's leases waiting for a CPU
    # 3.7 times as long (adapt_dos owner_flood, attackers at nice 0)
    contended_requests_per_token_s: float = setting(25.0, "pace of a token's requests past"
                                                    " free_requests_per_token in progress while"
                                                    " another token is active and the service"
                                                    " has no CPU to spare (see"
                                                    " cpu_contended_share): its closed-loop"
                                                    " clients sleep, giving the CPU back to jobs"
                                                    " asking a few at a time; 0: never",
                                                    minimum=0.0, maximum=1e7)
    # (under ShardClient's 10 s per try: a turn waited for longer is a timeout and a retry)
    contended_max_turn_wait_s: float = setting(8.0, "longest wait for a turn at"
                                               " contended_requests_per_token_s (past it: 429,"
                                               " answered after that wait: a refusal is an"
                                               " answer its client spends CPU on as on a"
                                               " lease)", minimum=0.1, maximum=600.0)
    contended_refusal_wait_s: float = setting(30.0, "how long a request refused at"
                                              " contended_requests_per_token_s waits before its"
                                              " 429 (it reserves no turn: a client giving up"
                                              " sooner costs nothing, a flooding one is answered"
                                              " that much less often)", minimum=0.1,
                                              maximum=600.0)
    max_waiting_per_token: int = setting(1024, "requests of one token waiting their turns at"
                                         " contended_requests_per_token_s (past it: 429 after"
                                         " max_turn_wait_s)", minimum=1, maximum=1 << 20)
    cpu_contended_share: float = setting(0.25, "share of the time the event loop wanted a CPU"
                                         " that it waited for one, from which the machine has"
                                         " no CPU to spare (Linux schedstat; where unknown:"
                                         " always; 0: always)", minimum=0.0, maximum=1.0)
    max_turn_wait_s: float = setting(5.0, "longest wait for a turn (past it: 429 with"
                                     " Retry-After, answered after that wait)", minimum=0.1,
                                     maximum=600.0)
    http: str = setting("httptools", "HTTP parser (h11: uvicorn's pure-Python one)",
                        choices=("httptools", "h11"))
    loop: str = setting("uvloop", "event loop (asyncio: the standard library's)",
                        choices=("uvloop", "asyncio"))


def _lower_priority(nice: int = SHUFFLE_NICE) -> None:
    """This thread's CPU priority lowered by `nice` (Linux: a thread's own; elsewhere the
    process's, so not there)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                           os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) + nice)


def token_digest(token: str) -> str:
    """The SHA-256 hex digest the service stores and compares (never the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest()


class GroupCommitter:
    """Runs store calls on one writer thread, committing everything queued meanwhile at once.

    While a commit waits for fsync, the event loop keeps parsing requests; the next batch then
    shares one fsync. Each call still sees a consistent state (savepoints, see run_batch). If
    the transaction itself fails (e.g. "database is locked" while another process writes),
    every call of the batch is answered with that error, and the writer goes on.

    Fair: the calls waiting are kept per key (the caller's token, else its address) and a batch
    takes them in turns, at most `per_key` of one key: one owner looping on 256 connections put
    256 calls in every batch, and another job's lease waited for all of them.

    Heavy keys paced: a key with a call that took `heavy_s` of the commit thread's CPU or wrote
    `heavy_rows` rows or more (a lease of 256 shards, an epoch's next rows, a give-back step:
    1-2 ms and their pages to sync, against ~0.05 ms and a few rows for a lease or an ack) is
    heavy for `heavy_hold_s`: a batch takes one call of one heavy key, and after it, while
    other keys' calls were committed meanwhile, none for (the batch's time, its commit
    included) x (1 - heavy_share) / heavy_share, so heavy calls take at most `heavy_share` of
    the thread and light calls run in the gaps. Five tokens each leasing 1,024 shards and
    giving them back in a loop put five such calls in every batch: another job's lease + ack
    waited for all of them, 5x its quiet latency. Calls run with `paced` (a PacedWriter's
    steps: restores, deletions, give-backs) pace themselves and are never held.
    """

    def __init__(self, store: ShardStore, max_batch: int = 256, stall_s: float = 2.0,
                 per_key: int = 8, heavy_s: float = 0.001, heavy_rows: int = 100,
                 heavy_share: float = 0.25, heavy_hold_s: float = 1.0):
        self.store, self.max_batch, self.per_key = store, max_batch, per_key
        self.heavy_s, self.heavy_rows = heavy_s, heavy_rows
        self.heavy_share, self.heavy_hold_s = heavy_share, heavy_hold_s
        self._heavy: dict[object, float] = {}   # heavy key -> monotonic time it is heavy until
        self._lane_at = 0.0   # no heavy key's call is taken before this (monotonic)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # calls taken from the queue and not yet run, per key, in arrival order (writer only)
        self._waiting: dict[object, collections.deque] = {}
        self.batches = self.calls = self.failed_batches = self.stalls = 0
        self.stall_s = stall_s
        self._fold = False   # a write failed for space: fold the WAL before the next batch
        self._beat, self._wall = time.monotonic(), store._clock()
        self._beat_lock = threading.Lock()
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._loop, name="group-commit", daemon=True),
                         threading.Thread(target=self._heartbeat, name="stall-watch",
                                          daemon=True)]
        for t in self._threads:
            t.start()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the writer (after the calls queued so far) and the heartbeat, and wait for both:
        a stopped service's heartbeat went on granting grace periods to a closed store."""
        self._closed.set()
        self._queue.put(None)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout)

    def _heartbeat(self) -> None:
        while not self._closed.wait(self.stall_s / 4):
            self._check_stall()

    def _check_stall(self) -> None:
        """A gap in the heartbeat means the process did not run (stopped, frozen, starved).

        Both the heartbeat and the writer check, whichever runs first after the pause: the
        writer must not expire leases with requests queued during the pause.
        """
        with self._beat_lock:
            now, wall = time.monotonic(), self.store._clock()
            if now - self._beat > self.stall_s:
                self.stalls += 1
                log.warning("shard service paused for %.1fs: held leases get a grace period",
                            now - self._beat)
                self.store.grant_grace()
            elif (wall - self._wall) - (now - self._beat) > self.stall_s:
                # Lease deadlines are wall-clock times (they outlive the process): a clock
                # stepped forward (NTP, an operator) expired every lease at once, a retry of
                # each used up with no worker failing. Treated like a pause.
                self.stalls += 1
                log.warning("the wall clock jumped %.1fs ahead: held leases get a grace period",
                            (wall - self._wall) - (now - self._beat))
                self.store.grant_grace()
            elif (now - self._beat) - (wall - self._wall) > self.stall_s:
                # stepped back: the kept lower bounds of the next expiry lie in the future
                # now, and no lease was checked until the clock caught up with them (an
                # hour's step: a dead worker's shards held an hour); dropped, the next call
                # scans and cuts every deadline to a full lease from now
                log.warning("the wall clock stepped %.1fs back: lease deadlines are cut to a"
                            " full lease from now", (now - self._beat) - (wall - self._wall))
                self.store.forget_expiries()
            self._beat, self._wall = now, wall

    async def run(self, call, key: object = None, paced: bool = False):
        """Queue `call` (no arguments) and wait until its transaction is durable; `key`: whose
        call it is (its share of the batches; None: the requesting client's address);
        `paced`: a step that paces itself (never held as a heavy key's)."""
        if self._closed.is_set():
            raise Busy("the service is stopping; retry once it is back")
        if key is None:
            key = ("client", REQUEST_CLIENT.get())
        if paced:
            key = ("paced", key)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._queue.put((key, call, future, loop))
        return await future

    def _take_queued(self, block: bool, timeout: float | None = None) -> bool:
        """Move the queued calls into their keys' lines; False once the queue is closed."""
        while True:
            try:
                item = self._queue.get(timeout=timeout) if block else self._queue.get_nowait()
            except queue.Empty:
                return True
            block = False
            if item is None:
                return False
            self._waiting.setdefault(item[0], collections.deque()).append(item[1:])

    def _is_heavy(self, key: object, now: float) -> bool:
        until = self._heavy.get(key)
        if until is not None and now > until:
            del self._heavy[key]
            return False
        return until is not None

    def _held_s(self) -> float:
        """Seconds until a waiting call may be batched: >0 only when every key waiting is heavy
        and their lane is closed."""
        now = time.monotonic()
        if now >= self._lane_at or not all(self._is_heavy(k, now) for k in self._waiting):
            return 0.0
        return self._lane_at - now

    def _next_batch(self) -> list:
        """Up to max_batch (key, call, future, loop), taken in turns from the keys waiting (at
        most per_key each; of the heavy keys, one call of one, once their lane is open); a key
        with calls left goes to the back of the turn order."""
        batch: list = []
        taken: dict[object, int] = {}
        now = time.monotonic()
        lane = now >= self._lane_at
        while len(batch) < self.max_batch and self._waiting:
            progress = False
            for key in list(self._waiting):
                line = self._waiting[key]
                if self._is_heavy(key, now):
                    if not lane or key in taken:
                        continue
                    lane = False   # (one heavy call a batch)
                elif taken.get(key, 0) >= self.per_key:
                    continue
                batch.append((key, *line.popleft()))
                taken[key] = taken.get(key, 0) + 1
                progress = True
                if not line:
                    del self._waiting[key]
                if len(batch) >= self.max_batch:
                    break
            if not progress:
                break
        for key in taken:   # those served this turn queue behind the others next time
            if key in self._waiting:
                self._waiting[key] = self._waiting.pop(key)
        return batch

    def _paced(self, batch: list, costs: list[tuple[float, int]], took: float) -> None:
        """Mark the keys with a heavy call in `batch` (CPU or rows: see the class) heavy, and
        when a heavy key's calls ran beside other keys' calls, close the heavy lane for the
        batch's pause (`took`, its time with its commit: the pages a heavy call wrote are
        written and synced there)."""
        now = time.monotonic()
        keys: set = set()
        heavy = False
        for (key, *_), (cpu, rows) in zip(batch, costs):
            if isinstance(key, tuple) and key[:1] == ("paced",):
                continue
            keys.add(key)
            if cpu >= self.heavy_s or rows >= self.heavy_rows:
                self._heavy[key] = now + self.heavy_hold_s
        heavy = any(key in self._heavy for key in keys)
        others = any(key not in self._heavy for key in keys) or any(
            not self._is_heavy(key, now) for key in self._waiting)
        if heavy and others:
            self._lane_at = now + took * (1 - self.heavy_share) / self.heavy_share

    def _loop(self) -> None:
        open_ = True
        while True:
            if open_:
                # (only heavy calls waiting, their lane closed: until it opens or a call comes)
                held = self._held_s()
                open_ = self._take_queued(block=not self._waiting or held > 0,
                                          timeout=held if self._waiting else None)
            if not self._waiting:
                if not open_:
                    return   # closed, every call queued before it answered
                continue
            batch = self._next_batch()
            if not batch:   # (the lane still closed; once closed, what is left runs now)
                if not open_:
                    self._lane_at = 0.0
                continue
            self._check_stall()
            if self._fold and self.store.fold_wal():
                self._fold = False
            costs = [(0.0, 0)] * len(batch)
            t0 = time.monotonic()
            try:
                results = self._run_batch([_timed(call, self.store, costs, i)
                                           for i, (_, call, _, _) in enumerate(batch)])
            except BaseException as exc:  # noqa: BLE001 - every waiting call must be answered
                self.failed_batches += 1
                log.warning("group commit of %d calls failed: %s", len(batch), exc)
                error = self._storage_error(exc, "transaction failed, nothing of it was"
                                            " committed")
                results = [(False, error)] * len(batch)
            else:
                # a call refused by the database (its savepoint rolled back): its own error
                results = [(ok, self._storage_error(value, "refused, nothing of it was stored")
                            if not ok and isinstance(value, (sqlite3.Error, OSError))
                            else value) for ok, value in results]
            self._paced(batch, costs, time.monotonic() - t0)
            self.batches += 1
            self.calls += len(batch)
            # One wake-up of each event loop per batch, not one per call.
            by_loop: dict = {}
            for (_, _, future, loop), (ok, value) in zip(batch, results):
                by_loop.setdefault(loop, []).append((future, ok, value))
            for loop, settled in by_loop.items():
                try:
                    loop.call_soon_threadsafe(_settle, settled)
                except RuntimeError:
                    pass  # that event loop is gone (server stopping)


    def _run_batch(self, calls: list) -> list:
        """store.run_batch(calls); where one call read a damaged page of the file and SQLite
        ended the transaction for it (every call of the batch rolled back), that call's
        result is its error and the others run again without it. (Before: every job's call
        batched with a call on a damaged data set was 503, nothing of it committed.)"""
        results: list = [None] * len(calls)
        left = list(range(len(calls)))
        while True:
            try:
                out = self.store.run_batch([calls[i] for i in left])
            except sqlite3.Error as exc:
                k = getattr(exc, "batch_call", None)
                if k is None or not corrupt_file(exc):
                    raise   # (a full disk, the file away: the others would fail alike)
                results[left.pop(k)] = (False, exc)
                if left:
                    continue
                return results
            for i, result in zip(left, out):
                results[i] = result
            return results

    def _storage_error(self, exc: BaseException, what: str) -> Exception:
        """The error a caller gets for a write the database refused: DiskFull (507) when its
        storage is seen to be full (the WAL is folded before the next batch: at a file-size
        limit it filled before SQLite's auto-checkpoint and stayed full, every write refused,
        until a restart folded it), else EnvironmentFailure (503)."""
        if io_error(exc):
            self._fold = True
        if out_of_space(exc, self.store.db):
            return DiskFull("shard store", f"its disk is full ({exc}); {what} (retry once"
                            " space is freed)")
        return EnvironmentFailure("shard store", f"{what} ({type(exc).__name__}: {exc})")


def _timed(call, store: ShardStore, costs: list[tuple[float, int]], i: int):
    """`call`, its CPU time on the commit thread and the rows it wrote kept in costs[i]."""
    def run():
        t0, n0 = time.thread_time(), store._conn.total_changes
        try:
            return call()
        finally:
            costs[i] = (time.thread_time() - t0, store._conn.total_changes - n0)
    return run


def _settle(settled: list) -> None:
    for future, ok, value in settled:
        if not future.done():
            if ok:
                future.set_result(value)
            else:
                future.set_exception(value)


class _ReadPacer:
    """Whole-data-set reads (status, snapshot) and control views at most `rate` per second of
    each caller (its read key: a known token, else its client; reads.READ_KEY), in turn.

    A caller past its rate waits for its turn (sleeping costs nothing), up to `max_wait_s`,
    then 503 Busy: clients polling status in a tight loop sleep instead of spinning the
    machine's CPUs on cheap answers (a lease of another job waits for CPU time, not for these
    reads). Paced per caller as the reader's turns are: one pace for all let four tokens'
    status loops hold a job's own snapshot 2.4-5.2 s (7.6 ms quiet), then 503.
    """

    def __init__(self, rate: float, max_wait_s: float, clock=time.monotonic):
        self.interval, self.max_wait_s, self._clock = 1.0 / rate, max_wait_s, clock
        self._next: dict[object, float] = {}   # caller -> when its next turn is

    async def turn(self) -> None:
        key, now = reads.READ_KEY.get(), self._clock()
        if len(self._next) > 4096:   # (callers whose turn is past are dropped: bounded)
            self._next = {k: t for k, t in self._next.items() if t > now}
        at = max(now, self._next.get(key, now))
        if at - now > self.max_wait_s:
            raise Busy(f"more than {1 / self.interval:g} status/snapshot reads per second are"
                       " asked by this caller; retry in a moment")
        self._next[key] = at + self.interval
        if at > now:
            await asyncio.sleep(at - now)


class _IndexPace:
    """Sample indices of big lease replies sent per key (a token) and second, past a burst of
    one second's worth: a reply over it sleeps first (its JSON not yet written, so a sleeping
    reply holds neither memory nor CPU)."""

    def __init__(self, per_s: float, max_wait_s: float, clock=time.monotonic,
                 sleep=asyncio.sleep):
        self.per_s, self.max_wait_s, self._clock, self._sleep = per_s, max_wait_s, clock, sleep
        self._due: dict[object, float] = {}   # key -> when its indices so far are paid for

    def _charge(self, key: object, n: int, now: float) -> float:
        """When `key`'s indices are paid for with `n` more charged."""
        if len(self._due) > 4096:   # (keys paid up are dropped: no entry per token for good)
            self._due = {k: t for k, t in self._due.items() if t > now - 1.0}
        due = self._due[key] = max(self._due.get(key, now - 1.0), now - 1.0) + n / self.per_s
        return due

    def admit(self, key: object, most: int, within: float | None = None) -> _Reserved:
        """`most` indices (the most the lease can send) reserved for `key`, checked in the same
        step: RateLimited (before anything is leased) when its reply would wait more than
        max_wait_s (or `within`, where less), unless nothing of `key` is paid for past its
        burst. Checked and reserved at once, a herd arriving together is refused past the
        bound (checked here and charged after its commit, all of one passed before any was
        charged)."""
        now = self._clock()
        bound = self.max_wait_s if within is None else min(within, self.max_wait_s)
        base = max(self._due.get(key, now - 1.0), now - 1.0)
        over = base + most / self.per_s - now - bound
        if over > 0 and base > now - 1.0:
            raise RateLimited(f"big lease replies asked past lease_indices_per_token_s"
                              f" ({self.per_s:g} a second): this one would wait"
                              f" {over + bound:.3g} s, at most {bound:.3g} s (the data set's"
                              " lease_s / 2, contended_max_turn_wait_s); retry later",
                              min(over, base - now + 1.0))
        return _Reserved(key, most, self._charge(key, most, now))

    def refund(self, held: _Reserved, n: int = 0) -> None:
        """Give back what `held` reserved past the `n` indices its reply sends (all of it: a
        lease refused or failed after admit)."""
        if held.key in self._due:   # (else paid up and dropped: nothing to give back)
            self._due[held.key] -= (held.most - n) / self.per_s
        held.until -= (held.most - n) / self.per_s
        held.most = n

    async def wait(self, held: _Reserved, n: int) -> None:
        """Sleep until `n` of the indices `held` reserved are paid for, the rest refunded (a
        lease of big shards, before its commit: its lease then runs from when it is sent)."""
        self.refund(held, n)
        now, until = self._clock(), held.until
        if n and until > now:   # (a reply with nothing paced waits for no one's)
            await self._sleep(until - now)


@dataclass
class _Reserved:
    """Indices a lease reserved at admit: `most` of `key`'s, paid for at `until`."""

    key: object
    most: int
    until: float


def _lease_limits(conn: sqlite3.Connection, name: str) -> tuple[int, float] | None:
    """Shard size and lease_s of data set `name` (None where none, or not ones a data set may
    have)."""
    row = conn.execute("SELECT shard_size, lease_s FROM datasets WHERE name=?",
                       (name,)).fetchone()
    ok = row is not None and type(row[0]) is int and 0 < row[0] <= MAX_SHARD_SIZE \
        and type(row[1]) in (int, float) and MIN_LEASE_S <= row[1] <= MAX_LEASE_S
    return (row[0], float(row[1])) if ok else None


class _SendSlots:
    """At most `n` big bodies (snapshots) being sent at once to each key (an owner's token;
    strangers' sends share one key); the others wait their turn, up to `wait_s` (then 503),
    and a client that takes no chunk for `timeout_s` loses its slot. (One pool for all owners
    let one owner reading its 8 MB snapshot a chunk every 9 s hold every other owner's
    checkpoints' snapshots 503 for minutes.)"""

    def __init__(self, n: int, bytes_per_s: float, wait_s: float = 10.0, timeout_s: float = 10.0):
        self.n, self.bytes_per_s, self.wait_s, self.timeout_s = n, bytes_per_s, wait_s, timeout_s
        # key -> (its slots, sends holding or waiting for one): dropped when none is (so at
        # most one entry per key with a send under way; created on the serving event loop)
        self._slots: dict[object, tuple[asyncio.Semaphore, list[int]]] = {}

    @contextlib.asynccontextmanager
    async def hold(self, key: object) -> AsyncIterator[None]:
        """One of `key`'s slots for the block; Busy past wait_s."""
        sem, users = self._slots.setdefault(key, (asyncio.Semaphore(self.n), [0]))
        users[0] += 1
        try:
            try:
                await asyncio.wait_for(sem.acquire(), self.wait_s)
            except asyncio.TimeoutError:
                raise Busy(f"snapshots are being sent to other clients for more than"
                           f" {self.wait_s:g} s; retry in a moment") from None
            try:
                yield
            finally:
                sem.release()
        finally:
            users[0] -= 1
            if not users[0]:
                del self._slots[key]


class _SharedSend(Response):
    """A big JSON body sent in chunks, each after the client took the previous one, holding one
    of its key's send slots: anonymous clients asking for a 26 MB snapshot in a loop keep one
    transfer going, not one per connection (each costs both ends CPU time); a body of one
    chunk is sent without one (as any other reply)."""

    # (a chunk is copied and written on the event loop: 256 KiB keeps each step short)
    CHUNK = 1 << 18

    def __init__(self, body: bytes, slots: _SendSlots, key: object = None):
        super().__init__(b"", 200, media_type="application/json")
        self.payload, self.slots, self.key = body, slots, key
        self.headers["content-length"] = str(len(body))

    async def __call__(self, scope, receive, send) -> None:
        if len(self.payload) <= self.CHUNK:
            await self._send(send)
            return
        try:
            async with self.slots.hold(self.key):
                await self._send(send)
        except Busy as busy:   # (raised before anything was sent)
            await _error(busy)(scope, receive, send)

    async def _send(self, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        view, start = memoryview(self.payload), time.monotonic()
        for i in range(0, max(len(view), 1), self.CHUNK):
            try:
                await asyncio.wait_for(send({
                    "type": "http.response.body", "body": bytes(view[i:i + self.CHUNK]),
                    "more_body": i + self.CHUNK < len(view)}), self.slots.timeout_s)
            except asyncio.TimeoutError:
                # a client that stopped reading held the slot for good (every stranger's
                # snapshot waited): the response ends unfinished, uvicorn closes the socket
                log.info("snapshot: the client took no data for %.0f s; dropped",
                         self.slots.timeout_s)
                return
            ahead = (i + self.CHUNK) / self.slots.bytes_per_s - (time.monotonic() - start)
            if ahead > 0 and i + self.CHUNK < len(view):
                await asyncio.sleep(ahead)   # paced: a loop of snapshots is not a CPU hog


def _internal_error() -> Response:
    return _json({"error": "internal error (see the service log)", "kind": "InternalError",
                  "field": None}, 500)


def _json(payload: dict[str, Any] | msgspec.Struct, status: int = 200) -> Response:
    if isinstance(payload, msgspec.Struct):
        payload = to_builtins(payload)
    # The stdlib encoder directly: a lease reply is mostly a list of ints.
    return Response(json.dumps(payload, separators=(",", ":"), allow_nan=False), status,
                    media_type="application/json")


def _error(exc: StragglersError) -> Response:
    status = next((code for cls, code in HTTP_STATUS if isinstance(exc, cls)), 400)
    body = {"error": str(exc), "kind": type(exc).__name__, "field": getattr(exc, "field", None)}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    if isinstance(exc, RateLimited):
        headers = {"Retry-After": str(max(1, round(exc.retry_after_s + 0.5)))}
    resp = _json(body, status)
    if headers:
        resp.headers.update(headers)
    return resp


def check_media_type(request: Request) -> None:
    """UnsupportedMediaType (415) unless a request with a body declares it JSON in UTF-8.

    A form or text/plain body was parsed as JSON: a body is taken only as what it says it is
    (an empty one may say nothing), with no content coding: a body declared gzip was parsed as
    plain JSON when it was one (and a gzip one refused as bad JSON)."""
    coding = request.headers.get("content-encoding")
    if coding is not None and coding.strip().lower() != "identity":
        raise UnsupportedMediaType("request", "Content-Encoding", f"expected none (or identity),"
                                   f" got {coding[:60]!r}: bodies are taken as plain JSON")
    given = request.headers.get("content-type")
    if given is None:
        empty = request.headers.get("content-length", "") == "0" or (
            "content-length" not in request.headers
            and "transfer-encoding" not in request.headers)
        if empty:
            return
        raise UnsupportedMediaType("request", "Content-Type", "missing; expected "
                                   "application/json for a request body")
    media, *params = (p.strip().lower() for p in given.split(";"))
    charsets = [p.partition("=")[2].strip('"') for p in params if p.startswith("charset=")]
    if media != "application/json" or any(c not in ("utf-8", "utf8") for c in charsets):
        raise UnsupportedMediaType("request", "Content-Type", f"expected application/json"
                                   f" (UTF-8), got {given[:60]!r}")


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes without reading the rest, and
    (415) unless it is declared JSON."""
    try:
        declared_length(request, limit)
        check_media_type(request)
        return await read_bounded(request, limit)
    except BodyRefused as refused:
        if refused.kind == "bad_length":
            raise InputError("request", "Content-Length",
                             f"expected a byte count, got "
                             f"{request.headers.get('content-length')!r:.30}") from None
        if refused.kind == "client_gone":
            raise InputError("request body", None,
                             f"the client hung up after {refused.size} bytes") from None
        raise BodyTooLarge("request body", None, f"{refused.declared} bytes; at most {limit} "
                           "accepted" if refused.declared is not None
                           else f"more than {limit} bytes") from None


def client_of(request: Request) -> str | None:
    """The key of a request's per-client quotas: its address, None from loopback (every local
    process is the same address there; serving_quota.quota_client)."""
    return quota_client(request.client.host if request.client else None)


def _bearer_or_none(request: Request) -> str | None:
    """_bearer, or None when the request carries no well-formed bearer token."""
    try:
        return _bearer(request)
    except Unauthorized:
        return None


def _bearer(request: Request) -> str:
    """SHA-256 of the request's bearer token; Unauthorized when absent or malformed."""
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not TOKEN_PATTERN.fullmatch(token.strip()):
        raise Unauthorized("expected 'Authorization: Bearer <token>' (16-512 characters"
                           " of [A-Za-z0-9._~+/=-]) on every write")
    return token_digest(token.strip())


# the pace of requests without a token, as the monitor's (serving_quota.AnonymousPace)
ANONYMOUS_PER_S, ANONYMOUS_BURST, ANONYMOUS_MAX_WAIT_S = 32.0, 64.0, 8.0
ANONYMOUS_PER_S_IN_ALL = 128.0


def create_app(store: ShardStore, config: ServiceConfig | None = None,
               service_token: str | None = None) -> _FastPath:
    """The HTTP API; see README.md for the protocol.

    `service_token`: when given, creating a data set or a job's controller also needs it in
    the X-Service-Token header (a job's own token then guards every write on it).
    """
    config = config or ServiceConfig()
    control = ControlPlane(config.max_jobs, config.max_jobs_per_token, config.max_jobs_per_client,
                           config.max_control_records, config.max_control_records_per_token,
                           config.control_idle_s)
    commit = GroupCommitter(store, config.max_batch, config.stall_s)
    folder = WalFolder(store, config.wal_fold_bytes)
    # restores written a chunk at a time (and the rows they replaced deleted so), paced
    paced = PacedWriter(commit, store, config.restore_share, 1, config.max_restores,
                        config.restore_bytes_held)
    parser = SnapshotParser(config.max_restores)
    garbage = [store.has_garbage()]   # left by restores of an earlier process: deleted soon
    service_digest = token_digest(service_token) if service_token else None
    # Heavy work that must not run on the commit thread: reads of whole data sets (snapshot,
    # status) on a reader thread with its own connection, and epoch shuffles (up to 2**26
    # samples, seconds each) on their own threads.
    store.defer_indices = True
    reader = reads.ReadSide(store.db, store.generation, max_queued=config.max_queued_reads,
                            busy_timeout_s=config.busy_timeout_s)
    # Two shuffle threads: small epochs (up to 2**20 samples, milliseconds) never queue behind
    # big ones (seconds each), and big ones together use at most one core.
    # Control calls on a thread of their own, paced (PacedThread), their number bounded
    controlling = PacedThread(config.control_share, config.max_control_calls_per_token,
                              config.max_control_calls)
    # Each thread's calls in turns by token (turns.py): one token's queue of shuffles made
    # every other job's lease on that thread wait for all of it.
    shuffles = {False: ThreadPoolExecutor(1, thread_name_prefix="shard-shuffles-small"),
                True: ThreadPoolExecutor(1, thread_name_prefix="shard-shuffles-big")}
    shuffle_turns = {big: TakeTurns(pool) for big, pool in shuffles.items()}
    # Big shuffles (over 2**20 samples: up to 2**26, 5 s of a core) are no turn of those
    # threads: computed beside each other's, one a token at a time, each token paced to
    # shuffle_share of a thread (turns.PacedKeys says why not in pieces); the threads above
    # then only write JSON (a turn: milliseconds) or shuffle small epochs (tens of ms)
    # (at a lower CPU priority: two of them beside each other took twice the CPU one did, and
    # on a loaded machine the event loop and commit thread serving other jobs' leases waited
    # for it, adapt_dos shuffle 2.46x against 1.12x; nice, they take the cores those leave)
    computing = PacedKeys(ThreadPoolExecutor(SHUFFLE_THREADS,
                                             thread_name_prefix="shard-shuffles-compute",
                                             initializer=_lower_priority),
                          config.shuffle_share)
    # Each owner's snapshot sends and strangers' have slots of their own; strangers' are paced
    # slowly: five anonymous clients looping on a 26 MB snapshot at the owner's pace received
    # 256 MB/s, and their CPU (and the service's sends) on the same cores slowed other jobs'
    # leases 1.5-3.3x.
    sending = {mine: _SendSlots(config.max_snapshot_sends, rate, config.max_read_wait_s,
                                config.send_timeout_s)
               for mine, rate in ((True, config.snapshot_bytes_per_s),
                                  (False, config.stranger_snapshot_bytes_per_s))}
    pacer = _ReadPacer(config.reads_per_s, config.max_read_wait_s)
    index_pace = _IndexPace(config.lease_indices_per_token_s, config.contended_max_turn_wait_s)
    credits = WorkCredit()   # a worker's requests free of the shared pace (see worker_turn)
    full_since: dict[str, int] = {}   # data set -> writes done when its status said "disk full"
    # New tokens per minute, per client address and in all: without a service token anyone
    # on the machine may create, and each new token brings a fresh per-token quota. Tokens
    # that own a data set already are no new ones.
    mints = MintRate("token", config.new_tokens_per_client_per_minute,
                     config.new_tokens_per_minute)
    for owner in reader.submit(reads.owners).result():
        mints.know(owner)

    @contextlib.contextmanager
    def minting(digest: str, request: Request) -> Iterator[None]:
        """Count `digest` as a new token of this client unless it is known (429 past a rate),
        for a creation that runs inside: refunded when that creation fails."""
        client = client_of(request)
        try:
            new = mints.admit(digest, client)
        except MintRefused as exc:
            raise RateLimited(f"{exc.what}; retry later (new_tokens_per_minute)",
                              exc.retry_after_s) from None
        try:
            yield
        except BaseException:
            if new:
                mints.refund(digest, client)
            raise

    def handler(fn):
        async def endpoint(request: Request) -> Response:
            if garbage[0]:
                garbage[0] = False
                paced.collect()
            try:
                if request.method not in ("GET", "HEAD") and request.scope.get("query_string"):
                    # a write's fields are its body's: `?fence=99` or `?worker=x` beside them
                    # was ignored and the write done (which of two values counts is a guess);
                    # every write, not only POST (`DELETE ...?dry_run=1` deleted)
                    raise InputError("request target", "query", "a write takes no query"
                                     " string (its fields are in the JSON body), got"
                                     f" {request.url.query[:60]!r}")
                result = await fn(request)
                return result if isinstance(result, Response) else _json(result)
            except StragglersError as exc:
                response = _error(exc)
                await unsettled(request)
                # (a restore refused Busy: its unread body is up to 64 MiB, like a 401's)
                # (and a control report refused Busy: up to 1 MiB, unread)
                busy_restore = isinstance(exc, Busy) and request.url.path.endswith(
                    ("/restore", "/control/report"))
                if isinstance(exc, InputError) and config.refusal_delay_s:
                    # (sleeping costs nothing; three clients looping on refused bodies took
                    # the event loop from every job's leases, 3 ms -> 0.1-0.5 s each)
                    await asyncio.sleep(config.refusal_delay_s)
                elif (response.status_code in (401, 403, 404) or busy_restore) \
                        and config.auth_failure_delay_s:
                    # A refused token is answered after a pause (sleeping costs nothing): a
                    # client retrying 64 MB uploads with a stranger's token in a loop waits
                    # instead of spinning the machine's CPUs (and guessing tokens is slower).
                    # So is a write to a data set or job that does not exist: with a new token
                    # on each connection (no token's turn to wait for) such a loop was
                    # answered as fast as it asked.
                    await asyncio.sleep(config.auth_failure_delay_s)
                if response.status_code in (401, 403, 408, 413) or busy_restore:
                    # The body may be unread (refused from the head): close rather than read
                    # up to 64 MiB only to throw it away (the sender would spin sending it).
                    response.headers["connection"] = "close"
                return response
            except Exception:  # noqa: BLE001 - a bug must not leak a traceback to clients
                log.exception("shard service: %s %s failed", request.method, request.url.path)
                return _internal_error()
        return endpoint

    async def read(fn, *args):
        return await reader.read(fn, *args)   # (in its caller's turn: reads.READ_KEY)

    async def big_shuffle(token: object, key: tuple[int, int, int]):
        """A big epoch's permutation, computed beside other tokens' (PacedKeys) in `token`'s
        turn, after its pause; taken as it is where a call made it while this one waited (no
        pause then, no charge)."""
        return await computing.run(token, store.permutations.get, key,
                                   ready=lambda: store.permutations.cached(key))

    def shuffle_gate(token: object) -> Callable[[Pending], None]:
        """A lease's gate (ShardStore.lease, on the commit thread): a big shuffle its token
        may not start now rolls the lease back (ShufflePaused), to be waited for first."""
        def gate(p: Pending) -> None:
            if p.key[0] > BIG_SHUFFLE and computing.paused(token):
                raise ShufflePaused(p.key)
        return gate

    async def with_indices(reply: LeaseReply, held: _Reserved,
                           perms: dict) -> LeaseReply | Response:
        """A lease reply; one with Pending indices is made JSON on a shuffle thread (not the
        writer, not the event loop: the shuffle, and the list and JSON of up to 262,144
        indices, a chunk at a time) in its token's turn (turns.py), charged to its token's
        pace of such indices (`held`: what the lease reserved of it and waited for before its
        commit, the rest refunded; never a wait here: its lease runs from its commit). A big
        epoch's shuffle not in memory is computed first (big_shuffle); one its token had to
        wait for was waited for and made before the commit (`perms`: those, see lease)."""
        pending = [x.indices for x in reply.leases if isinstance(x.indices, Pending)]
        index_pace.refund(held, sum(p.stop - p.start for p in pending))
        if not pending:
            return reply
        big = max(p.key[0] for p in pending) > 1 << 20 or \
            sum(p.stop - p.start for p in pending) > 1 << 16
        perms = dict(perms)   # the big permutations it needs, held (the LRU may drop them)
        for p in pending:
            if p.key[0] > BIG_SHUFFLE and p.key not in perms \
                    and store.permutations.wanted(p):
                perms[p.key] = store.permutations.cached(p.key)
                if perms[p.key] is None:
                    perms[p.key] = await big_shuffle(held.key, p.key)
        body = await shuffle_turns[big].run(held.key, lease_json, store, reply, perms)
        return Response(body, 200, media_type="application/json")

    def route(path: str, fn, methods=("POST",)) -> Route:
        return Route(path, handler(fn), methods=list(methods))

    async def parsed(request: Request, model, limit: int | None = None):
        return rq.parse(model, await _body(request, limit or config.max_body_bytes))

    def name_of(request: Request, key: str = "name") -> str:
        return check_name(request.path_params[key], key)

    def may_create(request: Request) -> bool:
        if service_digest is None:
            return True
        given = request.headers.get(SERVICE_TOKEN_HEADER, "")
        return hmac.compare_digest(token_digest(given), service_digest)

    def creator(request: Request) -> str:
        digest = _bearer(request)
        if not may_create(request):
            raise Forbidden(f"creating needs this service's token in {SERVICE_TOKEN_HEADER}")
        return digest

    # owner digests of data sets, read once (none is deleted, and a restore keeps the owner):
    # every write is judged from its head, before its body is read
    owners: dict[str, str | None] = dict(reader.submit(reads.owner_rows).result())

    async def owned(request: Request, name: str, quarantined: bool = False) -> str:
        """The request's token digest once it may write data set `name` (Unauthorized,
        Forbidden or NotFound from the head), its body admitted (see admit_body).
        `quarantined`: the call may go on with a quarantined data set (its DELETE)."""
        digest = _bearer(request)
        if not quarantined:
            store.raise_if_quarantined(name)
        owner = store.owner_digest(name) or owners.get(name)
        if owner is None and name not in owners:
            # not seen yet: the stored row decides (an owner, once stored, never changes; the
            # commit thread checks it again with the call)
            exists, owner = await read(reads.owner_of, name)
            if not exists:
                raise NotFound(f"no data set named '{name}'")
            owners[name] = owner
        authorize(owner, digest, f"data set '{name}'")
        if not quarantined and name not in store._verified:
            # the owner's own first call since the file was opened: its rows checked on the
            # reader (in its turn) before its write, not by that write on the commit thread
            # (a 655,360-row data set: 0.8 s of every other job's calls, and a token's 64
            # after a restart ~50 s)
            await verify(name, write=True)
        admit_body(request.scope)
        return digest

    async def health(request: Request) -> Health:
        return Health(ok=True, commit_batches=commit.batches, commit_calls=commit.calls,
                      failed_batches=commit.failed_batches, stalls=commit.stalls)

    async def create_dataset(request: Request) -> Created:
        digest = creator(request)   # the tokens before the body: no parsing for strangers
        with minting(digest, request):
            admit_body(request.scope)
            body = await parsed(request, rq.CreateDataset)
            cfg = DatasetConfig(**body.model_dump())
            client = client_of(request)
            created = await commit.run(lambda: store.create_dataset(cfg, digest, client),
                                       digest)
        reclaimed = store.reclaimed()   # (unused data sets deleted to make room)
        for name in reclaimed:
            owners.pop(name, None)
            drop_limits(name)
            reader.forget(name)
        if reclaimed:
            paced.collect()
        owners.setdefault(cfg.name, digest)
        return created

    @contextlib.asynccontextmanager
    async def worker_turn(request: Request, who: tuple[str, str, str], joining: bool = False):
        """The turn of a request whose head was DEFERRED (a worker's, under contention): free
        when `who` (token digest, data set, worker) has a credit earned by its work, else the
        token's shared turn (429 past the longest wait, answered after it). A worker is known
        to its credits once a request of it is done (`joining`: a join, which may draw its own
        credit for a name not known yet)."""
        scope: Any = request.scope
        key = scope.pop(DEFERRED_KEY, None)
        if key is None:
            yield
            credits.known(who)
            return
        free, done = credits.take(who, joining), False
        try:
            try:
                wait = pressure.settle(key, free)
            except MintRefused as exc:
                park_s = exc.park_s or pressure.max_wait_s
                if await park(scope, park_s):
                    raise RateLimited(exc.what, exc.retry_after_s - park_s) from None
                raise Busy("the connection closed while its request waited") from None
            if wait and not await park(scope, wait):
                raise Busy("the connection closed while its request waited")  # (nothing done)
            yield
            credits.known(who)
            done = True
        finally:
            if free:
                credits.leave(who, done)

    async def unsettled(request: Request) -> None:
        """A DEFERRED request refused before its worker was known (a bad body, a stranger's
        token) waits the shared turn it would have had: refusals of a token's many joined
        workers' requests were answered free of it."""
        scope: Any = request.scope
        key = scope.pop(DEFERRED_KEY, None)
        if key is not None:
            try:
                wait = pressure.settle(key, False)
            except MintRefused as exc:
                wait = exc.park_s or pressure.max_wait_s
            if wait:
                await park(scope, wait)

    async def join(request: Request) -> Joined:
        name = name_of(request)
        digest, body = await owned(request, name), await parsed(request, rq.Join)
        async with worker_turn(request, (digest, name, body.worker), joining=True):
            joined = await commit.run(
                lambda: store.join(name, body.worker, digest, None, GIVE_BACK_STEP), digest)
        joined.released += await given_back(name, body.worker, None, joined.fence, True,
                                            joined_error(body.worker, joined.fence, None),
                                            digest, len(joined.released))
        return joined

    async def given_back(name: str, worker: str, fence: int | None, keep: int | None,
                         failure: bool, error: str | None, digest: str, first: int) -> list:
        """The rest of a release or join whose own call gave back a whole step (`first`
        shards): paced steps of GIVE_BACK_STEP, other jobs' calls between them (1,024 held
        given back in one call held the calls batched with it ~11 ms; see requeues.py)."""
        rest: list = []
        step = first
        while step >= GIVE_BACK_STEP:
            more = await paced.step(lambda: store.give_back(
                name, worker, fence, keep, failure, error, GIVE_BACK_STEP, digest))
            rest += more
            step = len(more)
        return rest

    def pace_key(digest: str | None) -> object:
        return digest or ("client", REQUEST_CLIENT.get())

    # shard size and lease_s of each data set (read once; dropped with the data set): what a
    # lease may reserve of its token's index pace before it is committed, and wait for
    lease_limits: dict[str, tuple[int, float]] = {}
    limits_reads: dict[str, asyncio.Future] = {}   # data set -> the read of its limits
    drops = [0]   # data sets deleted (or reclaimed) so far: their limits dropped

    def drop_limits(name: str) -> None:
        lease_limits.pop(name, None)
        drops[0] += 1

    async def read_limits(name: str) -> tuple[int, float] | None:
        before = drops[0]
        try:
            limits = await read(_lease_limits, name)
        except (StragglersError, sqlite3.Error):   # (Busy: a later lease reads them again)
            return None
        finally:
            limits_reads.pop(name, None)
        # (kept only where no data set was deleted meanwhile: a read of the deleted one kept
        # its shard size for good, for the one created again under its name)
        if limits and drops[0] == before:
            lease_limits[name] = limits
        return limits

    async def limits_of(name: str) -> tuple[int, float] | None:
        """A data set's lease limits; where not known, read on the reader thread in the
        caller's turn, waited for only when that thread has no read queued or running: a job's
        first lease waited there behind other clients' reads (and was 503 past the bound on
        queued reads). Not waited for, the lease goes on with them unknown (charged what it
        sends, as small shards' leases, never held before its commit); its next lease has them."""
        limits = lease_limits.get(name)
        if limits is not None:
            return limits
        idle = reader.idle()
        flight = limits_reads.get(name)
        if flight is None:
            flight = limits_reads[name] = asyncio.ensure_future(read_limits(name))
        return await asyncio.shield(flight) if idle else None

    async def lease(request: Request) -> LeaseReply | Response:
        name = name_of(request)
        digest, body = await owned(request, name), await parsed(request, rq.Lease)
        limits = await limits_of(name)

        async def reserve(limits: tuple[int, float] | None) -> _Reserved:
            # where not known (not read yet, or none: then the lease is refused by its commit,
            # all refunded) the most a shard may hold is reserved, and nothing waited for
            size, lease_s = limits or (MAX_SHARD_SIZE, None)
            # Reserved before the commit, in the step that checks the pace (_IndexPace.admit):
            # the most a reply sends (store.lease's cap; count x shard_size reserved up to 64x
            # that, and a job's second count=256 lease was 429 for 7 s), its wait bounded by
            # half the lease (a caller waiting cannot renew the shards it holds: a
            # ShardBatcher acks the one it finished after the step that follows its lease)
            most = min(body.count, max(1, MAX_INDICES_PER_REPLY // size)) * size
            held = index_pace.admit(pace_key(digest), most, lease_s and lease_s / 2)
            if limits and size > INLINE_INDICES:
                # every shard of its reply is paced: waited for before the commit, so the
                # reply carries a lease of lease_s from its commit (a wait after it sent
                # leases already expired, requeued to another worker, their acks 409);
                # smaller shards are paced only while their epoch is not shuffled yet, not
                # known before the commit: charged what they send, never held
                try:
                    await index_pace.wait(held, most)
                except BaseException:
                    index_pace.refund(held)
                    raise
            return held

        held = await reserve(limits)
        try:
            # A big shuffle its token may not start yet (its pause, shuffle_share; or one of
            # its shuffles running) is waited for, and made, before the commit: waited for
            # after it, a token's second 2**26 epoch within 45 s of its first was answered up
            # to 50 s after its commit, its lease (30 s) expired and requeued. Tried again
            # after it; the last try is not gated (the LRU may have dropped what was made).
            perms: dict = {}
            gate: Callable[[Pending], None] | None = shuffle_gate(held.key)
            for tries in range(LEASE_GATE_TRIES, 0, -1):
                try:
                    async with worker_turn(request, (digest, name, body.worker)):
                        reply = await commit.run(
                            lambda gate=gate: store.lease(name, body.worker, body.fence,
                                                          body.count, body.request_id, digest,
                                                          gate), digest)
                    break
                except ShufflePaused as paused:
                    perms[paused.key] = await big_shuffle(held.key, paused.key)
                    if tries == 2:
                        gate = None   # (the last try is not held)
                # The retry paced by the data set as it is now: one deleted and created again
                # with another shard_size meanwhile was paced by the old one's
                now = await limits_of(name)
                if now != limits:
                    index_pace.refund(held)
                    limits, held = now, await reserve(now)
        except BaseException:
            index_pace.refund(held)   # (refused or failed: nothing sent, nothing charged)
            raise
        return await with_indices(reply, held, perms)

    async def ack(request: Request) -> Acked:
        name = name_of(request)
        digest, b = await owned(request, name), await parsed(request, rq.Ack)
        who = (digest, name, b.worker)
        async with worker_turn(request, who):
            acked, moved = await commit.run(
                lambda: store.ack_progress(name, b.worker, b.fence, b.epoch, b.shard,
                                           b.consumed, digest), digest)
        credits.worked(who, moved)   # (the share of its shard moved: its next requests)
        return acked

    async def release(request: Request) -> Released:
        name = name_of(request)
        digest, b = await owned(request, name), await parsed(request, rq.Release)
        async with worker_turn(request, (digest, name, b.worker)):
            if b.fence is None:   # (a launcher's: a join, every incarnation fenced off)
                error: str | None = released_error(b.worker, b.error)
                joined = await commit.run(lambda: store.join(name, b.worker, digest, error,
                                                             GIVE_BACK_STEP, leaving=True),
                                          digest)
                fence, keep, error = None, joined.fence, joined_error(b.worker, joined.fence,
                                                                       error)
                released = joined.released
            else:
                released = (await commit.run(lambda: store.release(
                    name, b.worker, b.fence, b.failure, b.error, digest, GIVE_BACK_STEP),
                    digest)).released
                fence, keep, error = b.fence, None, release_error(b.worker, b.failure, b.error)
        failure = b.failure or b.fence is None
        return Released(released + await given_back(name, b.worker, fence, keep, failure,
                                                    error, digest, len(released)))

    async def delete_dataset(request: Request) -> Deleted:
        # its owner's: gives its places of max_datasets (and of the token's and client's
        # quotas) back; created data sets held them for good, and after max_datasets in the
        # service's life every creation was 429. Its rows are deleted in paced steps.
        # A quarantined one too (its owner's, or the service token's where its owner column
        # is what is damaged): its places were held for good, every call on it 503.
        name = name_of(request)
        operator = service_digest is not None and may_create(request)
        if operator:   # (the store judges: a data set not quarantined is still its owner's)
            digest = _bearer(request)
            admit_body(request.scope)
        else:
            digest = await owned(request, name, quarantined=True)
        await parsed(request, rq.Empty)
        deleted = await commit.run(lambda: store.delete_dataset(name, digest, operator), digest)
        owners.pop(name, None)
        drop_limits(name)
        reader.forget(name)
        paced.collect()
        return deleted

    async def retry_failed(request: Request) -> Requeued:
        name = name_of(request)
        digest, _ = await owned(request, name), await parsed(request, rq.Empty)
        # in paced steps (65,536 x 4 FAILED shards requeued in one call held every other
        # job's calls for seconds); each step sees the state the last one left
        requeued: list = []
        while True:
            step = await paced.step(
                lambda: store.retry_failed(name, digest, RETRY_CHUNK))
            requeued += step.requeued
            if len(step.requeued) < RETRY_CHUNK:
                return Requeued(requeued)

    async def status(request: Request) -> Response:
        # Read on the reader thread; the writer only requeues expired leases, when there are.
        name = name_of(request)
        await pacer.turn()
        store.raise_if_quarantined(name)
        if name not in store._verified:
            await verify(name)
        expired = await read(reads.has_expired, name, store._clock())   # 404 from the reader
        if expired:
            try:
                await commit.run(lambda: store.expire(name))
            except DiskFull as exc:
                # reads are answered on a full disk: the stored state, an expired shard still
                # leased until a write can requeue it (said once a data set until a write
                # fits: a line per status request flooded the log)
                if full_since.get(name) != commit.batches - commit.failed_batches:
                    full_since[name] = commit.batches - commit.failed_batches
                    log.warning("status of %s without requeueing its expired leases (said"
                                " once until a write fits): %s", name, exc)
        body = await reader.status(name)
        return Response(body, 200, media_type="application/json")

    verifying: dict[str, asyncio.Future] = {}   # data set -> its check under way (shared)

    async def verify(name: str, write: bool = False) -> None:
        """The first call on a data set since the file was opened checks all its rows, on the
        reader (in its first caller's turn; the calls meanwhile wait for the same check), only
        its result recorded by the writer (store.checked; a write checks it there where that
        result came too late, or where the reader is `Busy` for a `write`)."""
        flight = verifying.get(name)
        if flight is None:
            flight = verifying[name] = asyncio.ensure_future(checking(name))
            flight.add_done_callback(lambda f: checked(name, f))
        try:
            await asyncio.shield(flight)
        except Busy:
            if not write:
                raise

    def checked(name: str, flight: asyncio.Future) -> None:
        verifying.pop(name, None)
        if not flight.cancelled():
            flight.exception()   # (read here too: every caller may have left)

    async def checking(name: str) -> None:
        seen = store.generation(name)
        try:
            await read(reads.check_dataset, name)   # (NotFound: 404)
            damage = None
        except Quarantined as exc:
            damage = exc
        try:
            await commit.run(lambda: store.checked(name, seen, damage))
        except DiskFull:
            pass   # (nothing recorded: the next call checks again)
        if damage is not None:
            raise damage

    async def snapshot(request: Request) -> Response:
        name = name_of(request)
        await pacer.turn()
        store.raise_if_quarantined(name)
        owner = store.owner_digest(name)
        if owner is None:   # none, or not seen by a call since the file was opened: read it
            owner = (await read(reads.owner_of, name))[1]
        digest = _bearer_or_none(request)
        owns = owner is not None and digest is not None and hmac.compare_digest(owner, digest)
        stale_s = 0.0 if owner is None or owns else config.stranger_snapshot_stale_s
        body = await reader.snapshot(name, stale_s)
        return _SharedSend(body, sending[owns], owner if owns else None)

    async def restore(request: Request) -> Restored:
        name = name_of(request)
        digest = _bearer(request)   # before up to 64 MiB of JSON is read and parsed
        allowed, client = may_create(request), client_of(request)
        # Ownership, the right to create and the quota, all before the body is read; and a
        # quarantined data set, as every other write's (its restore is refused at the switch:
        # before, its body was read, parsed in the child and its reserve allocated first)
        store.raise_if_quarantined(name)
        await read(lambda conn: store.may_restore(name, digest, allowed, conn, client))
        with minting(digest, request):   # (the owner of an existing data set is known)
            admit_body(request.scope)
            # while its body arrives, a restore holds its token's place (one at a time) and
            # the bytes it sent (paced.bodies); the service's slot (max_restores) is taken once
            # the body is here: taken from the head, one socket sending no body held every
            # owner's restores 503 for restore_grace_s, again and again
            slot = paced.hold(digest)
            try:
                # (a body trickled at the serving layer's minimum rate held its place for
                # hours) bounded by its size: a 64 MiB body at 220 KB/s held it 300 s (a body
                # without Content-Length counts as the largest)
                try:
                    size = declared_length(request, config.max_restore_bytes)
                except BodyRefused:
                    size = None   # (refused by _body below, with its error)
                paced.bodies.check(digest, size or 0)
                paced.check_writing()
                within = min(config.restore_upload_s, config.restore_grace_s + (
                    config.max_restore_bytes if size is None else size)
                    / config.restore_bytes_per_s)
                body = CountedBody(request, paced.bodies, digest)
                try:
                    try:
                        raw = await asyncio.wait_for(_body(body, config.max_restore_bytes),
                                                     within)
                    except asyncio.TimeoutError:
                        raise BodyTooSlow("request body", None, f"not received within"
                                          f" {within:.3g} s (restore_grace_s + its size /"
                                          " restore_bytes_per_s, at most restore_upload_s)"
                                          ) from None
                    # (its head found a slot free: one taken since is waited for, in turn)
                    writing = await paced.writing(config.restore_wait_s)
                    try:
                        # parsed and validated in a child process (seconds of Python that, on
                        # a thread here, held the GIL the event loop and the commit thread
                        # need); written on the commit thread in paced chunks
                        checked = await parser.prepare(raw, name)
                        del raw
                        restored = await paced.restore(checked, digest, allowed, client)
                        # (its owner, as a creation's: one restored as new was read again on
                        # the reader by its owner's next write, behind other callers' reads)
                        owners[name] = digest
                        return restored
                    finally:
                        writing.close()
                finally:
                    body.release()
            finally:
                slot.close()

    async def controlled(fn, *args, place=None, token: str | None = None) -> Response:
        """fn(*args) of the control plane and its JSON, on the control thread (paced: see
        PacedThread): a window of a 65,536-rank job (its classes, its split) or its state is
        seconds of Python, which on the event loop held every job's leases. `place`: the
        call's place on that thread, taken already (else taken here: 503 past the bounds);
        `token`: whose call it is (a long call's pause beyond max_pause_s is that token's)."""
        place = place or controlling.hold(None)
        try:
            def call() -> Response:
                return _json(fn(*args))
            return await asyncio.wrap_future(controlling.submit(call, token))
        finally:
            place.close()

    async def control_config(request: Request) -> Response:
        job = name_of(request, "job")
        digest = _bearer(request)
        # the token judged from the head (the body is read after): the owner's, or one that
        # may create a controller
        creating = not control.check_writer(job, digest)
        if creating and service_digest is not None:
            digest = creator(request)
        with minting(digest, request) if creating else contextlib.nullcontext():
            admit_body(request.scope)
            body = await parsed(request, rq.ControlConfigBody)
            cfg = ControlConfig.from_mapping(body.model_dump(), "control config")
            return await controlled(control.configure, job, cfg, digest, client_of(request),
                                    place=controlling.hold(digest), token=digest)

    async def not_found(request: Request, exc: HTTPException) -> Response:
        if config.refusal_delay_s:
            # (an unknown path or method: a client looping on it waits, see handler)
            await asyncio.sleep(config.refusal_delay_s)
        headers = dict(exc.headers or {})
        body = {"error": f"{request.method} {request.url.path[:200]}: {exc.detail}",
                "kind": {404: "NotFound", 405: "MethodNotAllowed"}.get(exc.status_code,
                                                                       "HTTPError"),
                "field": None}
        resp = _json(body, exc.status_code)
        resp.headers.update(headers)
        return resp

    async def crashed(request: Request, exc: Exception) -> Response:
        log.error("shard service: %s %s failed: %s", request.method, request.url.path[:200],
                  exc)
        return _internal_error()

    async def control_report(request: Request) -> Response:
        job, digest = name_of(request, "job"), _bearer(request)
        control.check_writer(job, digest, exists=True)   # from the head: 404, 403
        # its token's place before the body is read (503 past it), the service's once the
        # body is here (a body that never comes holds no other token's calls)
        place = controlling.hold(digest, shared=False)
        admit_body(request.scope)
        try:
            raw = await _body(request, config.max_body_bytes)
            controlling.admit(place)
        except BaseException:
            place.close()
            raise

        def report() -> Actions:
            # parsed on the control thread: 10,000 record rows are milliseconds of Python,
            # paced with the call
            b = rq.parse(rq.Report, raw)
            return control.report(job, b.rank, b.records, b.device, b.incarnation, b.since,
                                  digest)
        return await controlled(report, place=place, token=digest)

    async def control_delete(request: Request) -> Response:
        # its owner's: gives its places back at once (an idle one's are taken when needed)
        job, digest = name_of(request, "job"), _bearer(request)
        control.check_writer(job, digest, exists=True)   # from the head: 404, 403
        place = controlling.hold(digest, shared=False)   # (the service's: see control_report)
        admit_body(request.scope)
        try:
            await parsed(request, rq.Empty)
            controlling.admit(place)
        except BaseException:
            place.close()
            raise
        return await controlled(control.delete, job, digest, place=place, token=digest)

    async def control_actions(request: Request) -> Response:
        job = name_of(request, "job")
        given = request.query_params.getlist("since")
        if len(given) > 1:   # (one reader takes the first, another the last)
            raise InputError("query", "since", f"given {len(given)} times; expected once")
        raw = given[0] if given else "0"
        since = canonical_decimal(raw, MAX_SINCE)
        if since is None:
            raise InputError("query", "since", f"expected an integer 0..{MAX_SINCE} in decimal"
                             f" (no sign, space or leading zero), got {raw!r:.30}")
        await pacer.turn()   # anonymous, and up to 16 splits of world_size ints each
        return await controlled(control.actions, job, since)

    async def control_state(request: Request) -> Response:
        job = name_of(request, "job")
        await pacer.turn()   # anonymous, and a class per rank
        return await controlled(control.state, job)

    routes = [
        route("/health", health, ("GET",)),
        route("/datasets", create_dataset),
        route("/datasets/{name}", delete_dataset, ("DELETE",)),
        route("/datasets/{name}/join", join),
        route("/datasets/{name}/lease", lease),
        route("/datasets/{name}/ack", ack),
        route("/datasets/{name}/release", release),
        route("/datasets/{name}/retry-failed", retry_failed),
        route("/datasets/{name}/status", status, ("GET",)),
        route("/datasets/{name}/snapshot", snapshot, ("GET",)),
        route("/datasets/{name}/restore", restore),
        route("/jobs/{job}/control", control_delete, ("DELETE",)),
        route("/jobs/{job}/control/config", control_config),
        route("/jobs/{job}/control/report", control_report),
        route("/jobs/{job}/control/actions", control_actions, ("GET",)),
        route("/jobs/{job}/control/state", control_state, ("GET",)),
    ]
    handlers: dict[Any, Callable[[Request, Any], Awaitable[Response]]] = {
        HTTPException: not_found, Exception: crashed}
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.router.redirect_slashes = False   # a 307 with no body; unknown paths answer 404 JSON
    app.state.commit, app.state.reader, app.state.store = commit, reader, store
    app.state.parser, app.state.paced = parser, paced
    app.state.shuffling = computing
    app.state.index_pace = index_pace
    app.state.controlling = controlling
    app.state.folder = folder

    def close() -> None:
        """Stop every thread and child process of the app (the server has stopped)."""
        reader.close()
        parser.close()
        commit.close()
        folder.close()
        controlling.close()
        paced.close()
        for pool in (*shuffles.values(), computing.pool):
            pool.shutdown(wait=True, cancel_futures=True)

    app.state.close = close
    pressure = Backpressure("token", config.free_requests_per_token,
                            config.requests_per_token_s, config.request_burst_per_token,
                            config.max_turn_wait_s,
                            shared_rate=config.contended_requests_per_token_s or None,
                            contended=CpuContention(config.cpu_contended_share),
                            shared_max_wait_s=config.contended_max_turn_wait_s,
                            max_waiting=config.max_waiting_per_token,
                            shared_refusal_wait_s=config.contended_refusal_wait_s,
                            allowance=WorkerAllowance(store, config.free_requests_per_token),
                            # (anonymous requests, a /health probe, are no other job)
                            counts=lambda key: isinstance(key, str))
    def known(key: object) -> bool:
        """Whether a pressure key is the token of a data set's or controller's owner, or the
        service's (a made-up token is no credential: a new one per request went free)."""
        return isinstance(key, str) and (key in mints.known or key == service_digest)

    def credentialed(scope) -> bool:
        """A request with a known token (see known)."""
        return known(_pressure_key(scope))

    def read_key(scope) -> object:
        """Whose turn a request's reads take on the reader thread: its token where known, else
        its client's (status and snapshot GETs need no token: one client sending each with a
        new made-up token was a caller of its own each time, a job's lease behind all)."""
        key = _pressure_key(scope)
        return key if known(key) else _client_key(scope)

    # every other request, whatever its route (/health, a 404, a refusal, a first creation),
    # waits its client address's turn in the serving layer before anything is done of it (the
    # token pace above let 4 of an address's in progress go free, and a cheap handler never
    # yields: each request of a flood found none in progress)
    app.state.anonymous_pace = AnonymousPace(credentialed, ANONYMOUS_PER_S, ANONYMOUS_BURST,
                                             max_wait_s=ANONYMOUS_MAX_WAIT_S,
                                             per_s_in_all=ANONYMOUS_PER_S_IN_ALL)
    return _FastPath(app, {"lease": handler(lease), "ack": handler(ack)}, pressure, read_key)


class WorkerAllowance:
    """Requests in progress a token may have at its own pace under contention, for those
    bounded per token or in all elsewhere (control calls, status and snapshot reads): two per
    worker joined to its data sets (a worker asks one at a time; its ack and next lease may
    overlap), at least `free`; read from the store at most once a second per token. A
    worker's own writes are settled by its credit instead (WorkCredit: joined workers alone
    made a flood on as many connections a big job's).

    A big job's workers share its token: held to the shared pace past 4 in progress, 48
    workers of 50-200 ms steps made 10 steps a second instead of 150, and 800 saw their joins
    fail. A flood on many connections from few workers is still paced."""

    def __init__(self, store: ShardStore, free: int, ttl_s: float = 1.0, clock=time.monotonic):
        self.store, self.free, self.ttl_s, self.clock = store, free, ttl_s, clock
        self._known: dict[str, tuple[int, float]] = {}

    def __call__(self, key: object) -> int:
        if not isinstance(key, str):
            return self.free
        now = self.clock()
        known = self._known.get(key)
        if known is None or now - known[1] > self.ttl_s:
            if len(self._known) >= 4096:   # (tokens seen: forget the stale ones)
                self._known = {k: v for k, v in self._known.items() if now - v[1] <= self.ttl_s}
            try:
                workers = self.store.workers_of(key)
            except sqlite3.Error:   # (the store busy or away: no allowance beyond free)
                workers = 0
            known = self._known[key] = (max(self.free, 2 * workers), now)
        return known[0]


class _FastPath:
    """ASGI app: POST /datasets/{name}/lease and /ack straight to their endpoints, the rest to Starlette.

    Those two are nearly every request of a training job; Starlette's middleware and its regex
    route matching cost about as much CPU as the store call itself. The endpoint (validation,
    token, errors) is the very one the Starlette route runs.
    """

    def __init__(self, app: Starlette, hot: dict, pressure: Backpressure,
                 read_key: Callable[[Any], object]):
        self.app, self.hot, self.state, self.pressure = app, hot, app.state, pressure
        self.read_key = read_key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # every request waits its token's (else its client's) turn first: a flood of one
        # owner's writes, or of cheap anonymous ones (/health, unknown paths, refused
        # writes), is answered at a pace, never as fast as it comes
        key = _pressure_key(scope)
        # (its reads take their turns on the reader thread by its known token, else client)
        reads.READ_KEY.set(self.read_key(scope))
        deferrable, allowed = _turn_kind(scope)
        try:
            wait = self.pressure.turn(key, deferrable, allowed)
        except MintRefused as exc:
            # answered after the longest wait, not at once (a refusal at once is a loop that
            # spins), its connection closable meanwhile
            park_s = exc.park_s or self.pressure.max_wait_s
            if await park(scope, park_s):
                refused = RateLimited(exc.what, exc.retry_after_s - park_s)
                await _error(refused)(scope, receive, send)
            return
        try:
            if wait == DEFERRED:
                scope[DEFERRED_KEY] = key   # the endpoint settles it (worker_turn)
            elif wait and not await park(scope, wait):
                return   # closed while it waited (its client, a connection cap): nothing done
            await self._serve(scope, receive, send)
        finally:
            self.pressure.leave(key)

    async def _serve(self, scope, receive, send) -> None:
        if scope["method"] == "POST":
            parts = scope["path"].split("/")
            if len(parts) == 4 and parts[1] == "datasets" and parts[2] and parts[3] in self.hot:
                scope["path_params"] = {"name": parts[2]}
                response = await self.hot[parts[3]](Request(scope, receive))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


DEFERRED_KEY = "stragglers.deferred"   # scope: the key of a turn a worker's credit settles
# the writes that name a worker in their body (a deferred turn: see worker_turn)
WORKER_WRITES = frozenset(("join", "lease", "ack", "release"))


def _turn_kind(scope) -> tuple[bool, bool]:
    """(deferrable, allowed) of a request's turn: a write naming a worker is settled by that
    worker's credit; control calls and reads, bounded per token or in all elsewhere, may use
    the token's allowance; anything else (retry-failed, creations, restores, unknown paths)
    takes the shared pace past the free requests (a token's many workers made a flood of
    those free)."""
    parts = scope.get("path", "").split("/")
    if len(parts) == 4 and parts[1] == "datasets":
        if scope.get("method") == "POST":
            return parts[3] in WORKER_WRITES, parts[3] in WORKER_WRITES
        return False, parts[3] in ("status", "snapshot")
    return False, len(parts) == 5 and parts[1] == "jobs" and parts[3] == "control"


def _pressure_key(scope) -> object:
    """Whose turn a request waits for: its bearer token's digest, else its client's address
    (None for every loopback one: see quota_client)."""
    for name, value in scope.get("headers") or ():
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            token = token.strip()
            if scheme.lower() == "bearer" and TOKEN_PATTERN.fullmatch(token):
                return token_digest(token)
            break
    return _client_key(scope)


def _client_key(scope) -> tuple[str, str | None]:
    """A request's client's key (None for every loopback one: see quota_client)."""
    return ("client", quota_client((scope.get("client") or (None,))[0]))


# the kind named by an error of the layers below the app (the serving guard's), by status
GUARD_KINDS = {400: "InputError", 404: "NotFound", 405: "MethodNotAllowed",
               408: "RequestTimeout", 413: "BodyTooLarge", 431: "HeadTooLarge",
               500: "InternalError", 503: "Busy", 507: "DiskFull"}


def error_shape(status: int, message: str) -> ErrorBody:
    """The service's error body `{"error", "kind", "field"}` for the serving layer's refusals
    (a Host or target not allowed, a header twice, timeouts): the same shape as the app's."""
    return {"error": message, "kind": GUARD_KINDS.get(status, "HTTPError"), "field": None}


def _uvicorn_server(app, config: ServiceConfig):
    return uvicorn_server(app, max_connections=config.max_connections,
                          keep_alive_s=config.keep_alive_s, http=config.http, loop=config.loop,
                          error_shape=error_shape, gate_bodies=True)


def _check_exposure(host: str, service_token: str | None) -> None:
    if not is_loopback(host) and not service_token:
        raise InputError("--host", "host", f"{host} is reachable from other machines; serving"
                         " there needs a service token (--token-file)")


def serve(db: str | Path, config: ServiceConfig | None = None,
          service_token: str | None = None, announce=None) -> None:
    """Run the service in the foreground until interrupted; `announce(url)` is called once the
    store is open and the socket bound (the URL carries the port a `port=0` got)."""
    config = config or ServiceConfig()
    _check_exposure(config.host, service_token)
    store, held = open_claimed(db, config)
    Reserve.sweep(str(db))   # (left by a process killed while it restored)
    app = None
    try:
        sock = listen_socket(config.host, config.port)
        if announce is not None:
            announce(base_url(config.host, sock.getsockname()[1]))
        app = create_app(store, config, service_token)
        serve_in_foreground(_uvicorn_server(app, config), sock)
    finally:
        if app is not None:
            app.state.close()
        store.close()
        held.close()


def open_claimed(db: str | Path, config: ServiceConfig) -> tuple[ShardStore, Claim]:
    """The service's store and its claim on the file, claimed before it is opened: a start
    refused for a file another service serves writes nothing to it (opened first, a schema-6
    file was upgraded to 7 under the older service serving it, which then refused it 'start a
    new file'). A path that is no file yet is opened first (created, or refused in one line:
    ':memory:', a directory): it holds nobody's schema."""
    if not os.path.isfile(db):
        store = open_store(db, config)
        try:
            return store, claim(db)
        except BaseException:
            store.close()
            raise
    held = claim(db)
    try:
        return open_store(db, config), held
    except BaseException:
        held.close()
        raise


def open_store(db: str | Path, config: ServiceConfig) -> ShardStore:
    """The ShardStore of a service with this config (durability, lock wait, quotas)."""
    return ShardStore(db, durable=config.durable, busy_timeout_s=config.busy_timeout_s,
                      max_datasets=config.max_datasets,
                      max_datasets_per_token=config.max_datasets_per_token,
                      max_datasets_per_client=config.max_datasets_per_client,
                      max_workers_per_dataset=config.max_workers_per_dataset,
                      max_rows_ahead=config.max_rows_ahead,
                      max_held_per_worker=config.max_held_per_worker,
                      unused_dataset_s=config.unused_dataset_s,
                      max_kept_floors=config.max_kept_floors,
                      max_workers_per_token=config.max_workers_per_token,
                      max_shard_rows_per_token=config.max_shard_rows_per_token)


class EmbeddedServer:
    """The service on a daemon thread of this process (rank 0 in embedded mode)."""

    def __init__(self, db: str | Path, host: str = "127.0.0.1", port: int = 0,
                 durable: bool = True, service_token: str | None = None,
                 config: ServiceConfig | None = None):
        self.db = db
        self.config = (config or ServiceConfig()).replace(host=host, port=port, durable=durable)
        self.service_token = service_token
        self.host, self.port = host, port
        self._server: uvicorn.Server | None = None
        self.app: _FastPath | None = None
        self._thread: threading.Thread | None = None
        self._claim: Claim | None = None

    @property
    def url(self) -> str:
        """Base URL of the running server."""
        return base_url(self.host, self.port)

    def start(self, timeout: float = 60.0) -> "EmbeddedServer":
        """Bind (port 0 picks a free one), start serving, return once requests are answered."""
        _check_exposure(self.host, self.service_token)
        store, self._claim = open_claimed(self.db, self.config)
        try:
            Reserve.sweep(str(self.db))   # (left by a process killed while it restored)
            sock = listen_socket(self.host, self.port)
        except BaseException:
            if self._claim is not None:
                self._claim.close()
            self._claim = None
            store.close()
            raise
        self.port = sock.getsockname()[1]
        self.app = create_app(store, self.config, self.service_token)
        self._server = _uvicorn_server(self.app, self.config)
        self._thread = serve_in_thread(self._server, sock, "shard-service",
                                       f"shard service on {self.url}", timeout)
        return self

    def stop(self) -> None:
        """Ask uvicorn to exit, wait for the thread, close the store (its write-ahead log
        folded into the file: the file alone then holds every acknowledged call), then give
        up the claim on the file."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self.app is not None:
            self.app.state.close()
            # (was left open: the WAL stayed beside a 4 KiB file holding none of the data, and
            # a copy of the file alone, or a read-only open of it, had nothing acknowledged)
            self.app.state.store.close()
            self.app = None
        if self._claim is not None:
            self._claim.close()
            self._claim = None
