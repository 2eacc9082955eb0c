"""The control plane: one Controller per job, owned by the token that configured it.

Agents post step records and read actions (in memory: a restarted service forgets the
controllers, and each job's rank 0 configures its controller again at every incarnation).
A controller with no config or report for `idle_s` is idle: a new one that would pass a limit
takes the places of the longest-idle ones that free it (its owner may also DELETE it).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import TypeVar

from stragglers.adapt.controller import Actions, ControlConfig, Controller, ControllerView
from stragglers.adapt.errors import Busy, Conflict, NotFound, QuotaExceeded, authorize
from stragglers.adapt.monitor import records_kept
from stragglers.adapt.replies import Configured, ControlDeleted
from stragglers.errors import InputError
from stragglers.serving_quota import KeyedLimits, LimitExceeded, RequestLimits

T = TypeVar("T")
K = TypeVar("K")

MAX_JOBS = 1024
MAX_JOBS_PER_TOKEN = 16
MAX_JOBS_PER_CLIENT = 256
# step records the controllers may keep (world_size x records_kept(window) each, ~100 bytes a
# record, and RANK_COST more per rank): one token's 16 controllers of 65,536 ranks kept 28 GB
MAX_RECORDS = 1 << 24
MAX_RECORDS_PER_TOKEN = 1 << 23
# An agent reports every 0.2 s (agent.Agent.poll_s), records or none: a minute without a
# report is a job whose agents are gone. Without it a controller kept its places until the
# service stopped: one local process minting tokens took all 1,024 in 70 s, for good.
IDLE_S = 60.0


class ControlPlane:
    """Per-job controllers; a job's token must accompany every write on it."""

    def __init__(self, max_jobs: int = MAX_JOBS, max_jobs_per_token: int = MAX_JOBS_PER_TOKEN,
                 max_jobs_per_client: int = MAX_JOBS_PER_CLIENT,
                 max_records: int = MAX_RECORDS, max_records_per_token: int = MAX_RECORDS_PER_TOKEN,
                 idle_s: float = IDLE_S, clock: Callable[[], float] = time.monotonic):
        self._lock = threading.Lock()
        self.idle_s, self._clock = idle_s, clock
        self.max_records, self.max_records_per_token = max_records, max_records_per_token
        self._kept: dict[str | None, int] = {}   # step records kept per owner digest
        self._kept_total = 0
        # by last config or report, oldest first; the time of it, and the creating client
        self._jobs: OrderedDict[str, tuple[str | None, Controller]] = OrderedDict()
        self._touched: dict[str, tuple[float, str | None]] = {}
        self._owned: dict[str | None, int] = {}  # controllers per owner digest
        self._created: dict[str, int] = {}       # controllers per creating client address
        self.max_jobs, self.max_jobs_per_token = max_jobs, max_jobs_per_token
        self.max_jobs_per_client = max_jobs_per_client

    def configure(self, job: str, cfg: ControlConfig, token_sha256: str | None,
                  client: str | None = None) -> Configured:
        """Start the job's controller, or a new one for a later incarnation of the job.

        The same config again is a no-op (a retried request); an older incarnation, or another
        config for the same incarnation, is refused (Conflict).
        """
        resumed_from = 0
        with self._lock:
            have = self._jobs.get(job)
            freed = 0
            if have is not None:
                owner, ctl = have
                authorize(owner, token_sha256, f"job '{job}'")
                if cfg == ctl.config:
                    self._touch(job, self._touched[job][1])
                    return Configured(False, cfg.incarnation)
                if cfg.incarnation <= ctl.config.incarnation:
                    raise Conflict(f"job '{job}' incarnation {ctl.config.incarnation} is"
                                   f" configured; a different config needs a later incarnation,"
                                   f" got {cfg.incarnation}")
                token_sha256 = owner
                resumed_from = max(0, ctl.monitor.latest_step)   # resumed at or before it
                freed = _kept(ctl.config)
                self._check_records(token_sha256, _kept(cfg) - freed)
            else:
                self._make_room_or_refuse(token_sha256, client, _kept(cfg))
                self._owned[token_sha256] = self._owned.get(token_sha256, 0) + 1
                if client is not None:
                    self._created[client] = self._created.get(client, 0) + 1
            self._jobs[job] = (token_sha256, Controller(cfg, resumed_from))
            self._touch(job, client if have is None else self._touched[job][1])
            self._kept[token_sha256] = self._kept.get(token_sha256, 0) + _kept(cfg) - freed
            self._kept_total += _kept(cfg) - freed
        return Configured(True, cfg.incarnation)

    def report(self, job: str, rank: int, records: Sequence[tuple[int, float, int]], device: str,
               incarnation: int, since: int, token_sha256: str | None) -> Actions:
        """Feed step records [[step, bpt, batch], ...] of one rank; reply with actions >= since.

        All records are checked before any is applied (a refusal changes nothing); records
        of an earlier incarnation (an agent of a killed incarnation still flushing) are
        ignored, a later incarnation than the controller's is refused.
        """
        with self._lock:
            ctl = self._controller(job, token_sha256, write=True)
            self._touch(job, self._touched[job][1])
            if not 0 <= rank < ctl.config.world_size:
                raise InputError("control report", "rank",
                                 f"expected 0..{ctl.config.world_size - 1}, got {rank}")
            if incarnation > ctl.config.incarnation:
                # (its rank 0 configures the controller before any agent reports)
                raise InputError("control report", "incarnation",
                                 f"expected at most {ctl.config.incarnation}, the controller's"
                                 f" (a later incarnation configures it first), got {incarnation}")
            if incarnation == ctl.config.incarnation:
                _check_records(ctl, rank, records)
                for step, bpt, batch in records:
                    ctl.observe(rank, step, bpt, batch, device)
            return ctl.actions_since(since)

    def delete(self, job: str, token_sha256: str | None) -> ControlDeleted:
        """Drop the job's controller (its owner's token): its places are free at once."""
        with self._lock:
            self._controller(job, token_sha256, write=True)
            self._drop(job)
        return ControlDeleted(job)

    def _touch(self, job: str, client: str | None) -> None:
        self._touched[job] = (self._clock(), client)
        self._jobs.move_to_end(job)

    def _drop(self, job: str) -> None:
        """Forget `job`'s controller and give back its places (service's, token's, client's)."""
        owner, ctl = self._jobs.pop(job)
        _, client = self._touched.pop(job)
        kept = _kept(ctl.config)
        self._kept_total -= kept
        _less(self._owned, owner, 1)
        _less(self._kept, owner, kept)
        if client is not None:
            _less(self._created, client, 1)

    def _make_room_or_refuse(self, token_sha256: str | None, client: str | None,
                             more: int) -> None:
        """A new controller of `more` records: idle ones dropped for it (_make_room) and every
        limit checked; refused (QuotaExceeded), nothing is dropped. (A creation refused for
        its own records, past max_control_records, dropped every idle controller of other
        jobs first: their owners' next report 404, their step history gone.)"""
        before = (self._jobs.copy(), self._touched.copy(), self._owned.copy(),
                  self._created.copy(), self._kept.copy(), self._kept_total)
        try:
            self._make_room(token_sha256, client, more)
            self._check_quota(token_sha256, client)
            self._check_records(token_sha256, more)
        except QuotaExceeded:
            (self._jobs, self._touched, self._owned, self._created, self._kept,
             self._kept_total) = before
            raise

    def _make_room(self, token_sha256: str | None, client: str | None, more: int) -> None:
        """Drop the longest-idle controllers (idle_s without a config or report) whose places
        a new controller of `more` records needs: the service's, its token's or client's."""
        idle_before = self._clock() - self.idle_s
        for job in list(self._jobs):   # oldest first
            touched, by = self._touched[job]
            if touched > idle_before:
                return   # (the rest are newer)
            owner = self._jobs[job][0]
            mine = token_sha256 is not None and owner == token_sha256
            needed = (len(self._jobs) >= self.max_jobs
                      or self._kept_total + more > self.max_records
                      or (client is not None and by == client
                          and self._created.get(client, 0) >= self.max_jobs_per_client)
                      or (mine and (self._owned.get(owner, 0) >= self.max_jobs_per_token
                                    or self._kept.get(owner, 0) + more
                                    > self.max_records_per_token)))
            if needed:
                self._drop(job)

    def _check_quota(self, token_sha256: str | None, client: str | None = None) -> None:
        """A new controller: within the service's limit, this client's (under any tokens: one
        client minting tokens cannot take every slot) and this token's (QuotaExceeded: 429)."""
        if len(self._jobs) >= self.max_jobs:
            raise QuotaExceeded(f"the service holds {len(self._jobs)} controllers, its limit"
                                f" (max_jobs={self.max_jobs})")
        theirs = self._created.get(client, 0) if client is not None else 0
        if theirs >= self.max_jobs_per_client:
            raise QuotaExceeded(f"client {client} already created {theirs} controllers (under"
                                f" any tokens), its limit (max_jobs_per_client="
                                f"{self.max_jobs_per_client})")
        mine = self._owned.get(token_sha256, 0)
        if token_sha256 is not None and mine >= self.max_jobs_per_token:
            raise QuotaExceeded(f"this token already owns {mine} controllers, its limit"
                                f" (max_jobs_per_token={self.max_jobs_per_token})")

    def _check_records(self, token_sha256: str | None, more: int) -> None:
        """`more` step records kept: within the service's budget and the token's (429)."""
        if more <= 0:
            return
        if self._kept_total + more > self.max_records:
            raise QuotaExceeded(f"the controllers would keep {self._kept_total + more} step"
                                " records (world_size x (min(256, 4 x window) + 10) each), more than"
                                f" the service's limit (max_control_records={self.max_records})")
        mine = self._kept.get(token_sha256, 0) + more
        if token_sha256 is not None and mine > self.max_records_per_token:
            raise QuotaExceeded(f"this token's controllers would keep {mine} step records"
                                " (world_size x (min(256, 4 x window) + 10) each), more than its limit"
                                f" (max_control_records_per_token={self.max_records_per_token})")

    def check_writer(self, job: str, token_sha256: str | None, exists: bool = False) -> bool:
        """Whether `job` has a controller, Forbidden when `token_sha256` is not its owner's
        (NotFound when it has none and `exists`): a write judged from its head."""
        with self._lock:
            have = self._jobs.get(job)
        if have is None:
            if exists:
                self._controller(job)   # (its NotFound)
            return False
        authorize(have[0], token_sha256, f"job '{job}'")
        return True

    def has(self, job: str) -> bool:
        """Whether `job` has a controller."""
        with self._lock:
            return job in self._jobs

    def actions(self, job: str, since: int) -> Actions:
        """Every action with seq >= since."""
        with self._lock:
            return self._controller(job).actions_since(since)

    def state(self, job: str) -> ControllerView:
        """The controller's view (config, classes, batch sizes, actions)."""
        with self._lock:
            return self._controller(job).state()

    def _controller(self, job: str, token_sha256: str | None = None,
                    write: bool = False) -> Controller:
        """The job's controller; a write must carry the job's token (`token_sha256`)."""
        have = self._jobs.get(job)
        if have is None:
            raise NotFound(f"no controller for job '{job}' (POST /jobs/{job}/control/config first)")
        if write:
            authorize(have[0], token_sha256, f"job '{job}'")
        return have[1]


class PacedThread:
    """The control thread: runs control calls one at a time, each followed by a pause, so that
    they hold the interpreter at most `share` of the time; at most `per_token` calls of one
    token (the others: Busy, before their body is read) and `in_all` in all wait or run (the
    others: Busy, once their body is here).

    A call's Python holds the GIL the event loop and the commit thread need: five clients
    posting 10,000-record reports in a loop kept this thread busy all the time, and another
    job's lease + ack took 52x its quiet latency. The pause follows the call (its reply is
    not delayed) and is measured in wall time, which bounds the time the GIL was held.

    The pause every call waits for is at most `max_pause_s`; the rest of a long call's pause is
    its token's alone (that token's next call waits for it, the others run meanwhile, oldest
    token first): a 65,536-rank job's window (3-12 s) paused every job's control calls 9-36 s.
    A long call needs many paced calls before it (a window's reports), so the share holds.
    """

    def __init__(self, share: float = 0.25, per_token: int = 4, in_all: int = 64,
                 name: str = "shard-control", max_pause_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < share <= 1:
            raise InputError("PacedThread", "share", f"expected 0 < share <= 1, got {share}")
        self.share, self.max_pause_s, self._clock = share, max_pause_s, clock
        self.by_token = KeyedLimits("token", per_token, 1 << 62)
        self.in_all = KeyedLimits("service", in_all, 1 << 62)
        self._wake = threading.Condition()
        self._calls: list[tuple[object, Callable[[], object], Future]] = []   # in arrival order
        self._closing = False
        self._not_before = 0.0                      # every call's
        self._token_not_before: dict[object, float] = {}   # a token's own (past entries dropped)
        # what the thread did: calls run, seconds they took, seconds paused after them
        self.calls, self.busy_s, self.paused_s = 0, 0.0, 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def hold(self, token: str | None, shared: bool = True) -> RequestLimits:
        """A call's place (its token's and, `shared`, the service's; close it when answered);
        Busy when either is full. A call whose body is still to come takes its token's alone,
        and the service's once the body is here (admit): stalled bodies of 16 tokens held every
        job's control calls 503 for body_grace_s, again and again."""
        pairs: list[tuple[KeyedLimits, object]] = [(self.by_token, token)]
        if shared:
            pairs.append((self.in_all, None))
        try:
            return RequestLimits(pairs)
        except LimitExceeded as exc:
            raise Busy(f"too many control calls are waiting ({exc.what}); retry later") \
                from None

    def admit(self, place: RequestLimits) -> None:
        """Add the service's place to `place` (hold(token, shared=False)); Busy when full
        (`place` then kept as it was: its caller closes it)."""
        try:
            self.in_all.enter(None)
        except LimitExceeded as exc:
            raise Busy(f"too many control calls are waiting ({exc.what}); retry later") \
                from None
        place.pairs.append((self.in_all, None))

    def submit(self, fn: Callable[[], T], token: object = None) -> Future[T]:
        """Run fn() on the control thread after the pauses its previous calls earned (every
        call's, and those of `token`'s own)."""
        future: Future[T] = Future()
        with self._wake:
            if self._closing:
                future.cancel()
                return future
            self._calls.append((token, fn, future))
            self._wake.notify()
        return future

    def _next(self) -> tuple[object, Callable[[], object], Future] | None:
        """The oldest call whose token owes no pause, once every call's pause is over; None
        when closing."""
        with self._wake:
            while True:
                if self._closing:
                    return None
                now = self._clock()
                wait: float | None = self._not_before - now
                if wait is not None and wait <= 0:
                    soonest: float | None = None
                    for i, (token, _, _) in enumerate(self._calls):
                        mine = self._token_not_before.get(token, 0.0) - now
                        if mine <= 0:
                            self._token_not_before.pop(token, None)
                            return self._calls.pop(i)
                        soonest = mine if soonest is None else min(soonest, mine)
                    wait = soonest
                self._wake.wait(wait)   # None: until a call comes (the GIL is free meanwhile)

    def _run(self) -> None:
        while (item := self._next()) is not None:
            token, fn, future = item
            if not future.set_running_or_notify_cancel():
                continue
            t0 = self._clock()
            try:
                result = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                future.set_exception(exc)
            else:
                future.set_result(result)
            end = self._clock()
            spent = end - t0
            pause = spent * (1 - self.share) / self.share
            with self._wake:
                self.calls += 1
                self.busy_s += spent
                self.paused_s += min(pause, self.max_pause_s)
                self._not_before = end + min(pause, self.max_pause_s)
                if pause > self.max_pause_s:
                    self._token_not_before[token] = end + pause

    def close(self) -> None:
        """Stop the thread (calls not started are cancelled)."""
        with self._wake:
            self._closing = True
            calls, self._calls = self._calls, []
            self._wake.notify_all()
        for _, _, future in calls:
            future.cancel()
        self._thread.join()


def _check_records(ctl: Controller, rank: int, records: Sequence[tuple[int, float, int]]
                   ) -> None:
    """InputError naming the first record of `rank` the job cannot have run: a step further
    ahead than it could have run since, a batch past the most the controller handed the rank,
    a step given twice in the report with another time or batch."""
    bound = ctl.monitor.step_bound(min((r[1] for r in records), default=math.inf))
    if bound is not None and ctl.monitor.latest_step < 0:
        # a first record: also any step up to those the job said it runs
        bound = max(bound, ctl.config.total_steps)
    most = ctl.most[rank]
    seen: dict[int, tuple[int, float, int]] = {}
    for i, (step, bpt, batch) in enumerate(records):
        if bound is not None and step > bound:
            # refused whole: no record of it applied (see REPORT_LAG_S)
            raise InputError("control report", f"records[{i}][0]",
                             f"step {step} is implausible: the job's latest is"
                             f" {ctl.monitor.latest_step}, and it cannot have run past"
                             f" {bound} since")
        if batch > most:
            raise InputError("control report", f"records[{i}][2]",
                             f"expected at most {most} samples, the most this job's"
                             f" controller handed rank {rank} a step (global_batch"
                             f" {ctl.config.global_batch}), got {batch}")
        first = seen.setdefault(step, (i, bpt, batch))
        if first[1:] != (bpt, batch):
            raise InputError("control report", f"records[{i}][0]",
                             f"step {step} is given twice with another time or batch (also"
                             f" records[{first[0]}]); expected one record a step")


# what a rank costs before any record, in records (its history and deque: ~960 bytes): an
# empty controller of 65,536 ranks held 63 MB, and 1,024 of them 64 GB
RANK_COST = 10


def _less(counts: dict[K, int], key: K, n: int) -> None:
    """counts[key] -= n, the key dropped at 0."""
    left = counts.get(key, 0) - n
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _kept(cfg: ControlConfig) -> int:
    """The memory a controller of `cfg` holds at most, in step records."""
    return cfg.world_size * (records_kept(cfg.window) + RANK_COST)
