"""The fast detector: a per-rank change in step time, seen from the parts as they arrive.

The window analysis needs a whole window of steps on every rank before it can say anything;
this runs on every ingested part. A rank's *busy time* in a step is the time of its compute ops
(forward, backward, optimizer, GC): its step time less the time it waited for the others, which
in a synchronous job every rank shares. Computes run on one stream, so each counts until it
ended or the rank's next compute started (GC pauses, the host's, beside them): computes stated
to overlap count their overlap once (their sum read a healthy rank 3x slow); a part's last
compute is cut by the rank's next part's first (carried until it comes). Once every rank reported a step (or half of them are
`SETTLE_LAG` steps past it: a dead rank holds nothing up), each rank's log busy time is taken
relative to the median of its peers in that step (its stage's ranks when every stage has at
least 3, else the whole job), which removes what all ranks share (a longer batch, a slower
step of the whole job). That value is compared with the rank's own baseline — the median and
MAD of its last `change_baseline_steps` values — by a one-sided CUSUM (Page 1954) on the
standardised value, each step counted at most `CLIP` σ so that one spike (a GC pause, a
preemption) cannot alert on its own. When the CUSUM crosses `change_threshold` the change point
is estimated (where the run's values, less half the least change, sum highest), and the rank
alerts only if it was at least `change_min_ratio` slower in 3 of 4 steps since (the lower
quartile; the alert reports the median): a noisy rank whose CUSUM wanders up by chance, or a
cluster of GC pauses, does not alert, and a small lasting drift is taken into the baseline
instead. The alert resolves once the median of the rank's last `change_baseline_steps // 4`
values is back below √min_ratio (half the least change, in log) of the baseline it fired
against.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stragglers.monitor.fast_state import FiredState
from stragglers.trace.model import COMPUTE_OPTYPES, OPTYPE_CODES

log = logging.getLogger(__name__)

GC_CODE = OPTYPE_CODES["gc"]
COMPUTE_CODES = np.array(sorted(OPTYPE_CODES[n] for n in COMPUTE_OPTYPES), dtype=np.int8)
K = 0.5            # CUSUM reference value (σ): no drift below half a σ accumulates
CLIP = 4.0         # a step adds at most this many σ (one spike never alerts alone)
MIN_SIGMA = 0.005  # σ floor (log units): a very steady rank is not judged on noise of 0.1 %
MIN_PEERS = 3      # ranks a step's peer median needs
SETTLE_LAG = 8     # steps half the ranks may be past a step before it is judged without the rest
MIN_RUN = 4        # least steps a change is estimated from
MAX_PENDING = 256  # steps held waiting for ranks (half the job silent cannot fill memory)
RECENT = 64        # values kept per rank for the change estimate


@dataclass(frozen=True)
class PartBusy:
    """One part's busy time per step, its last compute on the device's stream aside: that one
    runs until it ended or the rank's next compute started, which the rank's next part tells
    (RankChangeDetector.add carries it over to then)."""

    steps: np.ndarray
    busy: np.ndarray                 # per step, `last` not counted
    first_start: float | None        # the part's first compute's start (cuts the one before)
    last: tuple[int, float, float] | None   # (step, start, its own time) of its last compute


def part_busy(step: np.ndarray, compute: np.ndarray, start: np.ndarray, duration: np.ndarray,
              gc: np.ndarray | None = None) -> PartBusy:
    """The busy time per step of one rank's rows (`compute`: which rows are compute ops): the
    time its compute stream was busy. One stream runs one compute at a time: each compute
    counts from its start until it ended or the rank's next compute started, whichever came
    first, so computes stated to overlap (a duration running on through the rank's next
    computes) count their overlap once; the part's last one is set aside (PartBusy.last).
    GC pauses (`gc`: which rows) are the host's, beside the stream: cut at the next pause
    only (the part's last pause at its own time)."""
    gc = np.zeros(int(compute.sum()), bool) if gc is None else gc[compute]
    step, start, duration = step[compute], start[compute], duration[compute]
    if not len(step):
        return PartBusy(np.zeros(0, np.int64), np.zeros(0), None, None)
    ordered = (start[1:] >= start[:-1]).all() and not gc.any()   # (a recorder's rows are)
    if not ordered:
        order = np.lexsort((start, gc))   # the device's computes, then the host's pauses
        step, start, duration, gc = step[order], start[order], duration[order], gc[order]
    # each cut at the next one's start on its stream
    room = np.full(len(start), np.inf)
    room[:-1] = np.where(gc[1:] == gc[:-1], start[1:] - start[:-1], np.inf)
    busy = np.minimum(np.maximum(duration, 0.0), room)
    first_start, last = None, None
    device = np.flatnonzero(~gc)
    if len(device):
        j = int(device[-1])
        first_start = float(start[device[0]])
        last = (int(step[j]), float(start[j]), float(busy[j]))
        busy[j] = 0.0
    first = step[0]
    if (step == first).all():   # a part of one step (1 step/s, a part a second): no sort
        return PartBusy(np.array([first], np.int64), np.array([busy.sum()]), first_start, last)
    steps, inverse = np.unique(step, return_inverse=True)
    return PartBusy(steps.astype(np.int64), np.bincount(inverse, weights=busy), first_start,
                    last)


def busy_per_step(step: np.ndarray, compute: np.ndarray, start: np.ndarray,
                  duration: np.ndarray, gc: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """(steps, busy seconds) of one rank's rows alone (part_busy, its last compute at its own
    time: no later part of the rank is known here)."""
    return _whole(part_busy(step, compute, start, duration, gc))


def _whole(p: PartBusy) -> tuple[np.ndarray, np.ndarray]:
    """A part's (steps, busy) with its last compute counted at its own time."""
    if p.last is None:
        return p.steps, p.busy
    busy = p.busy.copy()
    busy[np.searchsorted(p.steps, p.last[0])] += p.last[2]
    return p.steps, busy


def is_compute(optype: np.ndarray) -> np.ndarray:
    """Which rows of an op-type code column are compute ops."""
    return np.isin(optype, COMPUTE_CODES)


# dictionary names → their kind (KIND_*), for the last dictionaries seen (a job's parts
# share a few): np.isin over object arrays was a tenth of a part's read
_COMPUTE_NAMES: dict[tuple, np.ndarray] = {}
_NAMES_KEPT = 64
KIND_OTHER, KIND_COMPUTE, KIND_GC = 0, 1, 2   # (a GC pause is a compute op of the host's)


def _kinds_of(names: np.ndarray) -> np.ndarray:
    """KIND_* of each op type name."""
    return np.where(names == "gc", KIND_GC,
                    np.isin(names, COMPUTE_OPTYPES).astype(np.int8)).astype(np.int8)


def _compute_names(names: list) -> np.ndarray:
    """The KIND_* of these op type names (cached per list of names)."""
    key = tuple(names)
    got = _COMPUTE_NAMES.get(key)
    if got is None:
        got = _kinds_of(np.asarray(names, dtype=object))
        if len(_COMPUTE_NAMES) >= _NAMES_KEPT:
            _COMPUTE_NAMES.clear()
        _COMPUTE_NAMES[key] = got
    return got


def _compute_rows(column: pa.ChunkedArray) -> np.ndarray:
    """The KIND_* of each row of a Parquet op-type column (names, as a dictionary or not; by
    the dictionary's few names, not row by row; unknown names are the window's to refuse)."""
    out = []
    for chunk in column.chunks:
        if pa.types.is_dictionary(chunk.type):
            names = _compute_names(chunk.dictionary.to_pylist())
            out.append(names[chunk.indices.to_numpy(zero_copy_only=False)])
        else:
            out.append(_kinds_of(np.asarray(chunk.to_pylist(), dtype=object)))
    return np.concatenate(out) if out else np.zeros(0, np.int8)


def read_busy(path: Path, step: int | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """busy_per_step of a stored part file (read_part_busy, its last compute at its own
    time)."""
    got = read_part_busy(path, step)
    return None if got is None else _whole(got)


def read_part_busy(path: Path, step: int | None = None) -> PartBusy | None:
    """part_busy of a stored part file (3 or 4 of its columns read; `step`: the part's one
    step, known from its footer, so its step column is not read); None if it cannot be read
    (the window that reads it says why)."""
    try:
        # column by column on this thread (no table assembled, no hand-off to pyarrow's
        # threads: more than decoding a few rows costs) and the op type as a dictionary (its
        # names looked at once): ~0.25 ms a small part, was ~0.6 ms (the start column, read
        # for overlapping computes since round 13, adds 0.03-0.05 ms of CPU: 0.11 -> 0.16 ms a
        # one-step part, 0.17 -> 0.20 ms a four-step one, side by side)
        f = pq.ParquetFile(path, read_dictionary=["optype"])
        reader = f.reader

        def column(name: str) -> pa.ChunkedArray:
            return reader.read_column(reader.column_name_idx(name))

        kind = _compute_rows(column("optype"))
        duration = column("duration").to_numpy()
        start = column("start_ts").to_numpy()
        steps = np.full(len(duration), step, np.int64) if step is not None \
            else column("step").to_numpy()
    except (OSError, KeyError, ValueError, pa.ArrowException) as exc:
        log.debug("change detector: %s not read (%s)", path, exc)
        return None
    return part_busy(steps, kind > KIND_OTHER, start, duration, kind == KIND_GC)


@dataclass(frozen=True)
class ChangeSettings:
    """How sure and how large a change must be before a rank alerts."""

    min_ratio: float = 1.2      # least slowdown (busy time relative to peers, vs baseline)
    threshold: float = 16.0     # CUSUM decision interval h (σ)
    baseline_steps: int = 60    # values in a rank's baseline (median, MAD)
    warmup_steps: int = 20      # values a rank needs before it is judged


@dataclass(frozen=True)
class Change:
    """A rank's change: firing (its busy time rose `ratio`× from `since_step`), or resolved."""

    rank: int
    status: str        # firing | resolved
    ratio: float       # busy time relative to peers, over the rank's baseline
    since_step: int    # the estimated change point
    at_step: int       # the step whose arrival decided it


class RankChangeDetector:
    """One job's ranks: step values gathered as parts arrive, judged once a step settles."""

    def __init__(self, ranks: list[int], stages: dict[int, int], settings: ChangeSettings):
        self.ranks = sorted(ranks)
        self.index = {r: i for i, r in enumerate(self.ranks)}
        self.s = settings
        n, b = len(self.ranks), settings.baseline_steps
        by_stage: dict[int, int] = {}
        for r in self.ranks:
            by_stage[stages.get(r, 0)] = by_stage.get(stages.get(r, 0), 0) + 1
        per_stage = len(by_stage) > 1 and min(by_stage.values()) >= MIN_PEERS
        self.groups = np.array([stages.get(r, 0) if per_stage else 0 for r in self.ranks])
        self.pending: dict[int, np.ndarray] = {}   # step → busy per rank (NaN: not yet)
        self.reported = np.full(n, -1, np.int64)   # last step each rank reported
        self.settled = -1                          # last step judged
        self.base = np.full((n, b), np.nan)        # in-control values (ring)
        self.base_n = np.zeros(n, np.int64)
        self.recent = np.full((n, RECENT), np.nan)  # every value (ring), for estimates
        self.recent_n = np.zeros(n, np.int64)
        self.cusum = np.zeros(n)
        self.run = np.zeros(n, np.int64)           # steps since the CUSUM was last 0
        self.firing: dict[int, Change] = {}        # rank → its change while it fires
        self.fired_at = np.zeros(n, np.int64)      # recent_n when it fired
        self.frozen = np.zeros(n)                  # the baseline median it fired against
        # rank → its latest part's last compute (step, start, own time), counted once its next
        # part's first compute is known (cut there), or its step is judged without it
        self.carry: dict[int, tuple[int, float, float]] = {}

    def fired_state(self, rank: int) -> FiredState:
        """What a firing rank fired against (kept in the store: fast_state.py)."""
        i, c = self.index[rank], self.firing[rank]
        count = int(min(self.base_n[i], self.s.baseline_steps))
        return FiredState(frozen=float(self.frozen[i]), base=self.base[i, :count].tolist(),
                          ratio=c.ratio, since_step=c.since_step, at_step=c.at_step)

    def resume(self, rank: int, state: FiredState) -> None:
        """A rank firing when this detector was built (a restart, another instance taking
        the job): judged against the baseline it fired against, not one learnt from its
        slow steps (which resolved the alert while the rank stayed slow)."""
        i = self.index.get(rank)
        base = np.asarray(state.base, float)[:self.s.baseline_steps]
        if i is None or len(base) < self.s.warmup_steps or not np.isfinite(state.frozen) \
                or not np.isfinite(base).all():
            return   # (learnt anew, as before)
        self.base[i], self.base_n[i] = np.nan, len(base)
        self.base[i, :len(base)] = base
        self.frozen[i], self.fired_at[i] = state.frozen, self.recent_n[i]
        self.cusum[i], self.run[i] = 0.0, 0
        self.firing[rank] = Change(rank, "firing", state.ratio, state.since_step,
                                   state.at_step)

    def warm(self) -> set[int]:
        """Ranks judged by now (a baseline learnt): their alerts can be decided."""
        return {r for r, i in self.index.items() if self.base_n[i] >= self.s.warmup_steps}

    def add(self, rank: int, steps: np.ndarray, busy: np.ndarray,
            first_start: float | None = None,
            last: tuple[int, float, float] | None = None) -> None:
        """One part's busy time per step (steps already judged are late and left out); with
        its first compute's start and its last compute set aside (PartBusy): the rank's last
        compute carried from its part before is cut at this part's first (computes run on one
        stream: a part's last, stated to run on past the next step's start, was counted
        whole), and this part's last is carried to the rank's next part."""
        i = self.index.get(rank)
        if i is None or not len(steps):
            return
        held = self.carry.get(rank)
        if held is not None and int(steps.min()) >= held[0] and first_start is not None:
            step, start, own = self.carry.pop(rank)   # this part follows the carried one
            # (a part whose clock restarted, its first compute before the carried one's
            # start, says nothing of when that one ended: its own time)
            self._put(i, step, min(own, first_start - start) if first_start >= start else own)
        for step, value in zip(steps.tolist(), busy.tolist()):
            self._put(i, step, value)
        if last is not None:
            if rank in self.carry and last[0] <= self.carry[rank][0]:
                self._put(i, last[0], last[2])   # (a part come late: its next is not known)
            else:
                if rank in self.carry:   # (a later part with no compute before it)
                    self._put(i, *self.carry.pop(rank)[::2])
                self.carry[rank] = last
        self.reported[i] = max(self.reported[i], int(steps.max()))

    def _put(self, i: int, step: int, value: float) -> None:
        """Add `value` to rank index i's busy time in `step` (a step judged: late, left out)."""
        if step <= self.settled or not value > 0:
            return
        row = self.pending.get(step)
        if row is None:
            row = self.pending[step] = np.full(len(self.ranks), np.nan)
        row[i] = value if np.isnan(row[i]) else row[i] + value

    def close_through(self, step: int) -> None:
        """Steps up to `step` will have no later part (their window closed): the computes
        carried at them count at their own time, so their steps can be judged."""
        for rank in [r for r, c in self.carry.items() if c[0] <= step]:
            self._put(self.index[rank], *self.carry.pop(rank)[::2])

    def carried_from(self) -> int | None:
        """The earliest step a compute is carried at (None: none)."""
        return min((c[0] for c in self.carry.values()), default=None)

    def settle(self) -> list[Change]:
        """Judge every step all ranks reported (or half are SETTLE_LAG past); the changes. A
        rank's step whose last compute is carried is not reported yet (its next part cuts it)."""
        if not self.pending:
            return []
        done = self.reported.copy()
        for rank, c in self.carry.items():
            i = self.index[rank]
            done[i] = min(done[i], c[0] - 1)
        through = max(int(done.min()), int(np.median(done)) - SETTLE_LAG)
        if len(self.pending) > MAX_PENDING:   # most ranks silent: judge the oldest with the rest
            through = max(through, sorted(self.pending)[-MAX_PENDING - 1])
        self.close_through(through)   # (judged without their next parts: their own time)
        out: list[Change] = []
        for step in sorted(s for s in self.pending if s <= through):
            out.extend(self._judge(step, self._relative(self.pending.pop(step))))
            self.settled = step
        return out

    def _relative(self, busy: np.ndarray) -> np.ndarray:
        """log busy time less its peers' median (NaN where a rank or its peers are missing)."""
        y = np.log(busy)
        if len(self.ranks) < MIN_PEERS:
            return y   # no peers: the rank's own baseline alone
        out = np.full(len(y), np.nan)
        for g in np.unique(self.groups):
            members = self.groups == g
            values = y[members]
            if np.count_nonzero(~np.isnan(values)) >= MIN_PEERS:
                out[members] = values - np.nanmedian(values)
        return out

    def _judge(self, step: int, y: np.ndarray) -> list[Change]:
        seen = ~np.isnan(y)
        warm = seen & (self.base_n >= self.s.warmup_steps)
        h, out = self.s.threshold, []
        mu, sigma = self._baseline(warm)
        rows = np.flatnonzero(seen)
        self.recent[rows, self.recent_n[rows] % RECENT] = y[rows]
        self.recent_n[rows] += 1
        firing = self._firing_mask()
        for i in np.flatnonzero(warm & firing):
            change = self._maybe_resolved(int(i), step)
            if change is not None:
                out.append(change)
        judged = warm & ~firing
        z = np.clip((y - mu) / sigma, -CLIP, CLIP)
        self.cusum[judged] = np.maximum(0.0, self.cusum[judged] + z[judged] - K)
        self.run[judged] = np.where(self.cusum[judged] > 0, self.run[judged] + 1, 0)
        for i in np.flatnonzero(judged & (self.cusum >= h)):
            change = self._maybe_fired(int(i), step, mu[i])
            if change is not None:
                out.append(change)
        # the baseline learns in-control values only (not a change being accumulated)
        learn = seen & ((self.base_n < self.s.warmup_steps)
                        | ((self.cusum < h / 2) & ~self._firing_mask()))
        rows = np.flatnonzero(learn)
        self.base[rows, self.base_n[rows] % self.s.baseline_steps] = y[rows]
        self.base_n[rows] += 1
        return out

    def _baseline(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Median and σ (1.4826 MAD, floored) of the chosen ranks' baselines."""
        n = len(self.ranks)
        mu, sigma = np.zeros(n), np.full(n, MIN_SIGMA)
        if rows.any():
            base = self.base[rows]
            counts = np.minimum(self.base_n[rows], self.s.baseline_steps)
            mu[rows] = _row_medians(base, counts)
            mad = _row_medians(np.abs(base - mu[rows][:, None]), counts)
            sigma[rows] = np.maximum(1.4826 * mad, MIN_SIGMA)
        return mu, sigma

    def _last(self, i: int, count: int) -> np.ndarray:
        count = int(min(count, self.recent_n[i], RECENT))
        idx = (self.recent_n[i] - 1 - np.arange(count)) % RECENT
        return self.recent[i, idx]

    def _maybe_fired(self, i: int, step: int, mu: float) -> Change | None:
        # the change point: where the run's values, less half the least change, sum highest
        # from (the run itself may have begun on noise before the onset, which would dilute
        # the estimate); the change: the median from there, over at least MIN_RUN values
        values = self._last(i, int(self.run[i]))[::-1]   # oldest first
        tail = np.cumsum((values - mu - math.log(self.s.min_ratio) / 2)[::-1])[::-1]
        start = min(int(np.argmax(tail)), max(len(values) - MIN_RUN, 0))
        since_change = values[start:]
        shift = float(np.median(since_change)) - mu
        since = step - (len(since_change)) + 1
        # at least min_ratio slower in 3 of 4 steps since: a cluster of GC pauses is not
        if float(np.quantile(since_change, 0.25)) - mu < math.log(self.s.min_ratio):
            # sure of a change, but too small to matter: the baseline takes it in (else a
            # lasting 5 % drift would keep the CUSUM up and the baseline from learning)
            self.cusum[i], self.run[i] = 0.0, 0
            return None
        self.frozen[i], self.fired_at[i] = mu, self.recent_n[i]
        change = Change(self.ranks[i], "firing", math.exp(shift), since, step)
        self.firing[self.ranks[i]] = change
        return change

    def _maybe_resolved(self, i: int, step: int) -> Change | None:
        window = max(self.s.baseline_steps // 4, 3)
        if self.recent_n[i] - self.fired_at[i] < window:
            return None
        shift = float(np.median(self._last(i, window))) - self.frozen[i]
        if shift >= math.log(self.s.min_ratio) / 2:
            return None
        fired = self.firing.pop(self.ranks[i])
        self.cusum[i], self.run[i] = 0.0, 0
        return Change(self.ranks[i], "resolved", math.exp(shift), fired.since_step, step)

    def _firing_mask(self) -> np.ndarray:
        mask = np.zeros(len(self.ranks), bool)
        for r in self.firing:
            mask[self.index[r]] = True
        return mask


def _row_medians(a: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The median of each row's first `counts` values (the rest NaN; np.nanmedian on rows
    goes through masked arrays, 50× slower)."""
    ordered = np.sort(a, axis=1)   # NaN sort last
    rows = np.arange(len(a))
    return (ordered[rows, (counts - 1) // 2] + ordered[rows, counts // 2]) / 2
