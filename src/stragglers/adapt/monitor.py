"""AntDT's monitor (`SpeedMonitor`): per-worker batch processing time (BPT) over windows, and
straggler classes (docs/adaptive.md §3)."""

from __future__ import annotations

import bisect
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field

import msgspec

NONE, TRANSIENT, PERSISTENT, DETERMINISTIC = "none", "transient", "persistent", "deterministic"

# A record at most this many steps below its rank's last one is taken for a report sent again
# (its reply lost: up to 10,000 records, one a step) and ignored; further below, the rank's count
# started again (its last step was wild, or it restarted without a new incarnation).
REPLAY_SPAN = 20_000
# A record's step may lie at most as far beyond the job's latest as the job could have run since
# that was reported: (the time since + REPORT_LAG_S) / its fastest step seen, STEP_SLACK times
# over. REPORT_LAG_S: how stale the latest step may have been on arrival (a report retried for
# ShardClient's retry budget, 60 s, plus one try's timeout, 10 s). A step far ahead of the real
# ones made every later record of its rank up to it count as a report sent again (ignored), and
# every action wait for the job to reach it.
REPORT_LAG_S = 70.0
STEP_SLACK = 2.0
# A job's first records (no step known yet) are bounded the same way from the step it started
# at (its config's start_step; else the step a previous incarnation reached, else 0) over the
# time since its controller was configured, the fastest step time of the report itself: one
# wild first step (2**40) counted every later record of its rank up to it as resent.
# and at least this many steps: the controller uses BPT ratios only, so a job reporting them in
# another unit (ms) works, and its reports, a few steps each, must not be refused for it
MIN_AHEAD = 100
# Step records kept per rank: what the windows read (a window's for the per-sample time, four
# for the throughput fit), at most KEEP. A controller holds world_size times that (~100 bytes
# each): the service counts it against its budgets when the job is configured.
KEEP = 256


def records_kept(window: int) -> int:
    """Step records a controller's monitor keeps per rank for windows of `window` steps."""
    return min(KEEP, max(8, 4 * window))


class WorkerClass(msgspec.Struct, frozen=True, rename={"category": "class"}):
    """One worker's verdict at the close of a window (written with the key "class")."""

    ratio: float                    # r_i: its per-sample time over the median worker's
    category: str                   # NONE, TRANSIENT, PERSISTENT or DETERMINISTIC
    per_sample_time: float | None   # median BPT / batch over the window (None: no record)
    windows: int                    # flagged windows in a row


@dataclass
class WorkerStepTime:
    """One worker's compute time for one global step (waiting at the AllReduce excluded)."""

    step: int
    bpt: float
    batch: int


@dataclass
class WorkerHistory:
    """The recent records of one worker and its detection state."""

    records: deque[WorkerStepTime] = field(default_factory=lambda: deque(maxlen=KEEP))
    device: str = ""
    since_eval: int = 0
    flagged_windows: int = 0
    last_ratio: float = 1.0


class SpeedMonitor:
    """Collects BPT per worker; each full window yields ratios r_i and straggler classes."""

    def __init__(self, world_size: int, window: int = 5, theta: float = 1.3,
                 persistent_windows: int = 3, warmup_steps: int = 2, clock=time.monotonic,
                 start_step: int = 0, keep: int = KEEP):
        self.world_size = world_size
        self.window = window
        self.theta = theta
        self.persistent_windows = persistent_windows
        self.warmup_steps = warmup_steps
        self.keep = keep
        self.workers = self._fresh()
        self._latest, self._latest_stale = -1, False
        # workers with a full new window: window_ready without a scan of every worker (a scan
        # per record made a report's cost grow with the world size: 66 s per 2,000 reports
        # of a 16,384-rank job, on the service's event loop)
        self.ready = 0
        self.clock = clock
        # the fastest step time recorded (a floor of the job's step time: in lock step no step
        # is faster than its fastest rank's compute) and when the latest step last rose
        self._fastest, self._latest_at = math.inf, 0.0
        self.start_step, self._started_at = start_step, clock()

    def _fresh(self) -> dict[int, WorkerHistory]:
        return {r: WorkerHistory(deque(maxlen=self.keep)) for r in range(self.world_size)}

    def step_bound(self, first_fastest: float = math.inf) -> int | None:
        """The highest step a record may have now (None: no step time known, any may);
        `first_fastest`: the fastest step time of the report asking, used while the job has
        no step yet (from start_step over the time since the monitor started)."""
        latest = self.latest_step
        base, at, fastest = latest, self._latest_at, self._fastest
        if latest < 0:
            base, at, fastest = self.start_step, self._started_at, min(fastest, first_fastest)
        if not fastest < math.inf:
            return None
        since = max(0.0, self.clock() - at) + REPORT_LAG_S
        return base + max(MIN_AHEAD, math.ceil(STEP_SLACK * since / fastest))

    def record(self, rank: int, step: int, bpt: float, batch: int, device: str = "") -> None:
        """Add one step record of `rank` (ignored during warm-up, for an unknown rank, or a step seen)."""
        if rank not in self.workers or step < self.warmup_steps or bpt <= 0:
            return
        w = self.workers[rank]
        recs = w.records
        if recs and step <= recs[-1].step:
            i = bisect.bisect_left(recs, step, key=lambda r: r.step)
            if i < len(recs) and recs[i].step == step:
                return  # a report the agent sent again (its reply was lost): already counted
            if i == 0 and len(recs) == recs.maxlen and step >= recs[-1].step - REPLAY_SPAN:
                return  # older than every record kept: a long report sent again
            # A step the rank never reported, below its last: the records kept above it were
            # wild (a wrong step within the bound, or a counter started again). Kept as
            # replays, a wrong step 15,000 ahead made the rank's next 15,000 records ignored
            # and no window of the job closed meanwhile; far below its last (2**40), every
            # later record of the rank.
            self._drop_from(w, i)
        w.records.append(WorkerStepTime(step, bpt, batch))
        w.since_eval += 1
        if w.since_eval == self.window:
            self.ready += 1
        w.device = device or w.device
        self._fastest = min(self._fastest, bpt)
        if step >= self._latest:
            self._latest_at = self.clock()
        if not self._latest_stale:
            self._latest = max(self._latest, step)

    def _drop_from(self, w: WorkerHistory, i: int) -> None:
        """Forget a rank's records from the i-th kept on (wild steps, or all of them: its steps
        started again); the job's latest step is recomputed when next asked (it may have been
        that rank's wild one)."""
        dropped = len(w.records) - i
        left = 0 if i == 0 else max(0, w.since_eval - dropped)
        if w.since_eval >= self.window > left:
            self.ready -= 1
        for _ in range(dropped):
            w.records.pop()
        w.since_eval = left
        self._latest_stale = True

    @property
    def latest_step(self) -> int:
        """The highest step any rank's kept records reached (-1: none): actions take effect
        after it, so a wild step a rank started again from no longer counts."""
        if self._latest_stale:
            self._latest = max((w.records[-1].step for w in self.workers.values()
                                if w.records), default=-1)
            self._latest_stale = False
        return self._latest

    def window_ready(self) -> bool:
        """True when every worker has a full new window since the last evaluation."""
        return self.ready >= len(self.workers)

    def _recent(self, rank: int, n: int) -> list[WorkerStepTime]:
        recs = self.workers[rank].records
        return [r for r in list(recs)[-n:] if r.batch > 0]

    def per_sample_time(self, rank: int) -> float:
        """Median over the window of BPT / batch: robust to resized batches."""
        recs = self._recent(rank, self.window)
        return statistics.median(r.bpt / r.batch for r in recs) if recs else float("nan")

    def throughput_and_overhead(self, rank: int) -> tuple[float, float]:
        """(v_i samples/s, c_i s/step) from BPT = c + b / v fitted over recent windows."""
        recs = self._recent(rank, 4 * self.window)
        if not recs:
            return float("nan"), 0.0
        # the least-squares line in plain Python: numpy's per-call overhead on these few
        # points was 100 us per rank, 6.5 s per window of a 65,536-rank job (event loop)
        b = [float(r.batch) for r in recs]
        t = [r.bpt for r in recs]
        mean_b = sum(b) / len(b)
        if max(b) - min(b) >= 0.2 * mean_b:
            mean_t = sum(t) / len(t)
            sxx = sum((x - mean_b) ** 2 for x in b)
            slope = sum((x - mean_b) * (y - mean_t) for x, y in zip(b, t)) / sxx
            intercept = mean_t - slope * mean_b
            if slope > 0 and intercept >= 0:
                return 1.0 / slope, float(intercept)
        # Batches too alike to separate c from 1/v: attribute everything to throughput.
        recent = recs[-self.window:]
        return sum(r.batch for r in recent) / sum(r.bpt for r in recent), 0.0

    def evaluate(self) -> dict[int, WorkerClass]:
        """Close the window: r_i = median_W(per-sample BPT_i) / median_j, and each worker's class."""
        times = {r: self.per_sample_time(r) for r in self.workers}
        known = [t for t in times.values() if t == t]
        med = statistics.median(known) if known else float("nan")
        devices = [w.device for w in self.workers.values()]
        common_device = max(set(devices), key=devices.count)
        out: dict[int, WorkerClass] = {}
        self.ready = 0
        for rank, w in self.workers.items():
            w.since_eval = 0
            ratio = times[rank] / med if med == med and med > 0 and times[rank] == times[rank] else 1.0
            w.last_ratio = ratio
            w.flagged_windows = w.flagged_windows + 1 if ratio > self.theta else 0
            if w.flagged_windows == 0:
                cls = NONE
            elif w.flagged_windows < self.persistent_windows:
                cls = TRANSIENT
            elif w.device and w.device != common_device:
                cls = DETERMINISTIC  # stable and tied to a device type unlike the majority's
            else:
                cls = PERSISTENT
            t = times[rank]
            out[rank] = WorkerClass(ratio, cls, t if t == t else None, w.flagged_windows)
        return out

    def reset(self) -> None:
        """Forget all history (a new incarnation of the job)."""
        self.workers = self._fresh()
        self._latest, self._latest_stale = -1, False
        self.ready = 0
        self._fastest, self._latest_at = math.inf, 0.0
        self._started_at = self.clock()
