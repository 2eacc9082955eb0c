"""What every cause detector shares: the job context, worker identities and the candidate record."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import numpy as np

from stragglers.trace.model import OPTYPE_CODES as C, Trace
from stragglers.whatif.config import DiagnosisConfig
from stragglers.whatif.grid import BWD, BWW, FWD
from stragglers.whatif.metrics import WhatIf
from stragglers.whatif.result import CapacityOption, Where, WorkerRef

OPT = C["optimizer"]
# An effect whose steps without a spike keep at least this share of the spikes' size is there on
# every step: persistent, with spikes (steps_where).
PERSISTENT_SHARE = 0.25
BUSY = (FWD, BWD, BWW, OPT)  # a worker's own compute (what a slow GPU or CPU stretches)


@dataclass
class Rows:
    """A fix's values on the template ops it changes: the job's [N, D, T] array with rows
    `nodes` replaced by `values` (a candidate holds these, not a copy of the job's grid)."""

    nodes: np.ndarray            # int [k] template ops the fix changes
    values: np.ndarray           # [k, D, T] their values once fixed

    @classmethod
    def of(cls, fixed: np.ndarray, base: np.ndarray) -> "Rows":
        """The rows of `fixed` [N, D, T] that differ from `base` (NaN equal to NaN)."""
        changed = np.zeros(len(base), dtype=bool)
        for lo in range(0, len(base), _ROWS_AT_ONCE):     # a few rows at a time: no full temp
            a, b = fixed[lo:lo + _ROWS_AT_ONCE], base[lo:lo + _ROWS_AT_ONCE]
            same = (a == b) | (np.isnan(a) & np.isnan(b))
            changed[lo:lo + _ROWS_AT_ONCE] = ~same.reshape(len(a), -1).all(axis=1)
        nodes = np.flatnonzero(changed)
        return cls(nodes, fixed[nodes])

    @classmethod
    def on(cls, base: np.ndarray, nodes: np.ndarray) -> "Rows":
        """Rows `nodes` (bool [N] or indices) of `base`, copied: a detector then edits them."""
        index = np.flatnonzero(nodes) if nodes.dtype == bool else np.asarray(nodes)
        return cls(index, base[index])

    def at(self, nodes: np.ndarray) -> np.ndarray:
        """Positions in `values` of the template ops `nodes` (bool [N]; each one of the rows)."""
        return np.searchsorted(self.nodes, np.flatnonzero(nodes))

    def steps(self, base: np.ndarray, sl: slice) -> np.ndarray:
        """base[:, :, sl] with the fix applied (a copy of those steps only)."""
        out = base[:, :, sl].copy()
        out[self.nodes] = self.values[:, :, sl]
        return out

    def whole(self, base: np.ndarray) -> np.ndarray:
        """The job's array with the fix applied (a copy of `base`)."""
        return self.steps(base, slice(None))


# Rows compared at once by Rows.of (a bounded temporary, whatever the job's size).
_ROWS_AT_ONCE = 64


@dataclass
class Candidate:
    """A cause found in the trace, with the costs and launch delays it would leave when fixed.

    `cost` / `delay`: the job's [N, D, T] costs / launch delays with only this cause's own
    share removed, as a whole array or as the rows it changes (`Rows`; the diagnosis keeps
    only those); None: unchanged. The diagnosis replays them for the prediction.
    """

    cause: str
    where: Where
    evidence: str
    cost: np.ndarray | Rows | None = None
    delay: np.ndarray | Rows | None = None
    upper_bound: bool = False
    # Its detector's own test already separates it from noise (worker_fault with the outlier
    # test over five workers or more; gc: recorded or outlier pauses; sequence_imbalance: its
    # correlation test): the diagnosis then asks of its gain only that it be
    # positive (interval above 1) and at least min_gain (point), not the interval's lower end.
    established: bool = False
    # expert_imbalance: what each capacity factor buys at the measured routing (reported)
    capacity_factor: dict[str, CapacityOption] | None = None
    strata: np.ndarray | None = None   # bool [T]: the steps of an intermittent cause
    # Costs with the cause's slowness gone where its fix leaves some (a slow group re-split:
    # its stages at their workers' summed speed): what a cause hidden behind it is priced
    # after (diagnosis._after_others); None: `cost`
    cleared: np.ndarray | Rows | None = None


@dataclass
class Context:
    """The analysed job as the detectors see it."""

    w: WhatIf
    trace: Trace
    cfg: DiagnosisConfig
    ranks: np.ndarray     # [D, pp] global rank of each worker (-1 unknown)
    hosts: dict[int, str]  # global rank → host name
    _waits: tuple | None = field(default=None, repr=False)
    _balanced: tuple | None = field(default=None, repr=False)
    _seq: tuple | None = field(default=None, repr=False)
    _shared: tuple | None = field(default=None, repr=False)
    _paused: tuple | None = field(default=None, repr=False)
    _pause_free: np.ndarray | None = field(default=None, repr=False)
    _arrivals: tuple | None = field(default=None, repr=False)
    _experts: tuple | None = field(default=None, repr=False)
    _duration: np.ndarray | None = field(default=None, repr=False)
    _cost: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def build(cls, w: WhatIf, trace: Trace, cfg: DiagnosisConfig) -> "Context":
        """Global ranks from the trace's rank column, hosts from its layout metadata."""
        g = w.grid
        ranks = np.full((len(g.dp_ranks), g.pp_size), -1, dtype=np.int64)
        rank_col = trace.ops["rank"]
        for p in range(g.pp_size):
            nodes = np.flatnonzero(g.node_stage == p)
            rows = g.row[nodes, :, 0]                        # [n, D]
            for d in range(len(g.dp_ranks)):
                present = rows[:, d][rows[:, d] >= 0]
                if len(present):
                    ranks[d, p] = int(rank_col[present[0]])
        hosts = {}
        for entry in trace.meta.extra.get("layout") or []:
            if isinstance(entry, dict) and entry.get("host") is not None and "rank" in entry:
                hosts[int(entry["rank"])] = str(entry["host"])
        return cls(w, trace, cfg, ranks, hosts)

    @property
    def left_out(self) -> np.ndarray:
        """bool [D, P]: workers whose computes the ideal left out (metrics.unexplained: timed
        shorter than their work): no peer's norm, never named for their computes or gaps."""
        g, cells = self.w.grid, self.w.computes_left_out
        if cells is None:
            return np.zeros((len(g.dp_ranks), g.pp_size), dtype=bool)
        return np.stack([cells[g.node_stage == p].any(axis=0) for p in range(g.pp_size)],
                        axis=1)

    @property
    def duration(self) -> np.ndarray:
        """[N, D, T] durations as the detectors read them: the computes left out of the ideal
        (metrics.unexplained) at the median of the same op's on the stage's other workers,
        step by step (timed at 0 on one DP rank, they read every microbatch of its other
        stages as load-free, and its healthy worker there ×2.7e10 slow)."""
        cells = self.w.computes_left_out
        if cells is None:
            return self.w.grid.duration
        if self._duration is None:
            self._duration = self._as_peers(self.w.grid.duration, cells)
        return self._duration

    @property
    def cost(self) -> np.ndarray:
        """[N, D, T] measured costs as the detectors price work with them: the computes left
        out of the ideal at their stage peers' (as `duration`); the measured job elsewhere."""
        cells = self.w.computes_left_out
        if cells is None:
            return self.w.cost
        if self._cost is None:
            self._cost = self._as_peers(self.w.cost, cells)
        return self._cost

    def _as_peers(self, values: np.ndarray, cells: np.ndarray) -> np.ndarray:
        """`values` [N, D, T] (a copy) with `cells` (bool [N, D]: the computes left out of the
        ideal) at the median of the same op's values on the stage's other workers where they
        ran, step by step."""
        g = self.w.grid
        out = values.copy()
        for n in np.flatnonzero(cells.any(axis=1) & ~cells.all(axis=1)):
            peers = np.where(g.present[n, ~cells[n]], values[n, ~cells[n]], np.nan)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)   # no peer ran it: kept
                typical = np.nanmedian(peers, axis=0)             # [T]
            mine = cells[n][:, None] & g.present[n] & np.isfinite(typical)[None, :]
            out[n] = np.where(mine, typical[None, :], out[n])
        return out

    @property
    def cpu_waits(self) -> np.ndarray | None:
        """[D, P, T] s each worker's process waited for a CPU per step (None: not recorded)."""
        if self._waits is None:
            from stragglers.whatif.causes.contention import cpu_wait
            self._waits = (cpu_wait(self),)
        return self._waits[0]

    @property
    def seq_balanced(self) -> np.ndarray | None:
        """[N, D, T] costs with the share Σs² explains taken out (None: no Σs² in the trace)."""
        if self._balanced is None:
            from stragglers.whatif.causes.sequence import balanced_by_attn_cost
            self._balanced = (balanced_by_attn_cost(self),)
        return self._balanced[0]

    @property
    def seq_pattern(self):
        """(stages, corr, cv, fit) of the sequences' microbatch pattern (None: not there)."""
        if self._seq is None:
            from stragglers.whatif.causes.sequence import detect
            self._seq = (detect(self),)
        return self._seq[0]

    @property
    def seq_shared(self) -> np.ndarray | None:
        """[N, D, T] durations with each microbatch's load divided out, where the trace has no
        Σs² but its compute shows the sequences' pattern (else None)."""
        if self._shared is None:
            from stragglers.whatif.causes.sequence import without_sequence_load
            shared = None
            if self.seq_balanced is None and self.seq_pattern is not None:
                shared = without_sequence_load(self)
            self._shared = (shared,)
        return self._shared[0]

    @property
    def expert_load(self):
        """The MoE dispatches whose expert compute follows the rows received (None: none)."""
        if self._experts is None:
            from stragglers.whatif.causes.experts import expert_load
            self._experts = (expert_load(self, self.duration),)
        return self._experts[0]

    @property
    def own_durations(self) -> np.ndarray:
        """[N, D, T] durations with the shares uneven work explains taken out (Σs² of the
        sequences, or without Σs² each microbatch's load; rows routed to experts) and
        the GC pauses found inside compute: what a worker's own speed is judged on."""
        # Without Σs² the sequences' share is each microbatch's load, which its ops on the
        # DP rank's other stages show (sequence.without_sequence_load)
        for balanced in (self.seq_balanced, self.seq_shared):
            if balanced is not None:
                return self._own(balanced)
        return self._own(self.duration)

    @property
    def own_measured(self) -> np.ndarray | None:
        """[N, D, T] own durations without the sequences' load read from the DP rank's other
        stages (None where none was: then they are `own_durations`)."""
        if self.seq_balanced is not None or self.seq_shared is None:
            return None
        return self._own(self.duration)

    def _own(self, own: np.ndarray) -> np.ndarray:
        """`own` less the GC pauses found inside compute, with the rows routed to experts
        balanced."""
        found = self.compute_pauses
        if found:
            # A pause is the collector's time, not the worker's speed: left in, a worker that
            # drew more pauses looks slow (named beside a slow one as a slow group, whose
            # re-split then claimed the pauses too), and a slow worker's ratio to its peers
            # moves with their pauses step by step (its fix copied them onto it)
            paused = found[0].cost
            rows = paused if isinstance(paused, Rows) else Rows.of(paused, self.w.cost)
            own = own.copy()
            own[rows.nodes] = np.maximum(
                own[rows.nodes] - (self.w.cost[rows.nodes] - rows.values), 0.0)
        if self.expert_load is None:
            return own
        from stragglers.whatif.causes.experts import balanced_costs
        return balanced_costs(self.expert_load, own)

    @property
    def compute_pauses(self) -> list:
        """The GC pauses found inside compute from the duration pattern ([] or [Candidate])."""
        if self._paused is None:
            from stragglers.whatif.causes.gc import pauses_in_compute
            self._paused = (pauses_in_compute(self),)
        return self._paused[0]

    @property
    def pause_free(self) -> np.ndarray:
        """[N, D, T] durations of compute ops with the pauses found inside them taken out."""
        found = self.compute_pauses
        if not found:
            return self.duration
        if self._pause_free is None:    # one copy, read by every stage's pattern test
            cost = found[0].cost
            self._pause_free = cost.whole(self.w.cost) if isinstance(cost, Rows) else cost
            left = self.w.computes_left_out
            if left is not None:   # read as their peers' (`duration`)
                self._pause_free = self._as_peers(self._pause_free, left)
        return self._pause_free

    @property
    def arrivals(self) -> "Arrivals | None":
        """Who arrives last at the collectives that synchronise all DP ranks (None: none)."""
        if self._arrivals is None:
            self._arrivals = (arrival_order(self.w),)
        return self._arrivals[0]

    @property
    def steps(self) -> int:
        return len(self.w.grid.steps)

    def spread(self, lo: float, hi: float, fmt: str = ".2f", scale: float = 1.0) -> str:
        """' (lo–hi)' for an interval over steps; '' from one step (no interval to give)."""
        if self.steps < 2:
            return ""
        return f" ({scale * lo:{fmt}}–{scale * hi:{fmt}})"

    def where_workers(self, workers: list[tuple[int, int]], steps: list[int] | None = None,
                      optypes: list[str] | None = None) -> Where:
        """A `Where` naming (dp index, stage) workers by DP rank, stage, global rank and host;
        `workers` keeps the order given (the causes give the most severe first)."""
        g = self.w.grid
        listed = []
        for d, p in workers:
            rank = int(self.ranks[d, p])
            listed.append(WorkerRef(int(g.dp_ranks[d]), int(p), rank if rank >= 0 else None,
                                    self.hosts.get(rank)))
        return Where(dp=sorted({x.dp for x in listed}), pp=sorted({x.pp for x in listed}),
                     ranks=sorted({x.rank for x in listed if x.rank is not None}),
                     hosts=sorted({x.host for x in listed if x.host is not None}),
                     workers=listed, steps=list(steps or []), optypes=list(optypes or []))

    def name(self, d: int, p: int) -> str:
        """'(dp 3, pp 1, rank 7 on node-2)' for evidence texts."""
        rank = int(self.ranks[d, p])
        text = f"(dp {int(self.w.grid.dp_ranks[d])}, pp {p}"
        if rank >= 0:
            text += f", rank {rank}"
            if rank in self.hosts:
                text += f" on {self.hosts[rank]}"
        return text + ")"

    def step_mask(self, steps: list[int] | None) -> np.ndarray | None:
        """bool [T] of the named steps (None when the cause is persistent or on every step)."""
        if not steps or len(steps) >= len(self.w.grid.steps):
            return None
        return np.isin(self.w.grid.steps, steps)

    def steps_where(self, per_step: np.ndarray) -> list[int] | None:
        """The steps of an intermittent effect (per_step [T] near its max); None if persistent.

        A fault present on (nearly) every step is persistent even when a few steps spike far
        above it: the steps below the spikes still carry PERSISTENT_SHARE of the spikes' size
        (an intermittent effect leaves them near nothing)."""
        top = per_step.max()
        hit = per_step >= self.cfg.intermittent_step_share * top if top > 0 \
            else np.zeros_like(per_step, bool)
        if hit.mean() >= self.cfg.intermittent_fraction:
            return None
        if hit.any() and (~hit).any() and np.median(per_step[~hit]) >= \
                PERSISTENT_SHARE * np.median(per_step[hit]):
            return None
        return [int(s) for s in self.w.grid.steps[hit]]


@dataclass
class Arrivals:
    """Arrival order at the job's synchronising collectives, per worker (the measured starts).

    A collective ends only once its last member arrived: the last one holds up the others by
    the time between its arrival and the one before it (`gating`), the others wait. Arriving
    early and waiting is evidence that a worker is not the straggler, whatever its own
    compute or gaps look like.
    """

    gating: np.ndarray     # [D, P, T] s this worker, arriving last, held the others up
    lateness: np.ndarray   # [D, P] mean of (its arrival − the group's median arrival), s
    groups: int            # synchronising collectives per step


def arrival_order(w: WhatIf) -> Arrivals | None:
    """The arrival order at every collective that synchronises all DP ranks (None: none)."""
    g = w.grid
    d, t = len(g.dp_ranks), len(g.steps)
    groups = [(m, parts) for m, sync, parts in zip(w.model.groups, w.model.group_dp_sync,
                                                    w.model.group_parts) if sync]
    if d < 2 or not groups:
        return None
    gating = np.zeros((d, g.pp_size, t))
    late = np.zeros((d, g.pp_size))
    count = np.zeros((d, g.pp_size))
    for members, parts in groups:
        # each process group of the collective is a race of its own (all DP ranks: one race)
        for cols in ([np.arange(d)] if parts is None else
                     [np.flatnonzero(parts == label) for label in np.unique(parts)]):
            if len(cols) > 1:
                _race(g, members, cols, t, gating, late, count)
    if not count.any():
        return None
    return Arrivals(gating, late / np.maximum(count, 1), len(groups))


def _race(g, members: list[int], cols: np.ndarray, t: int, gating, late, count) -> None:
    """One collective's arrivals among the DP ranks `cols`: the last one's hold-up, and every
    member's arrival against the median (added into gating, late, count)."""
    arrive = g.start[members][:, cols]                                  # [m, c, T]
    if np.isfinite(arrive).all():
        stage = np.repeat(g.node_stage[members], len(cols))             # [m·c]
        dp = np.tile(cols, len(members))
        flat = arrive.reshape(-1, t)                                    # [m·c, T]
        order = np.argsort(flat, axis=0)
        last, second = order[-1], order[-2]
        steps = np.arange(t)
        np.add.at(gating, (dp[last], stage[last], steps),
                  flat[last, steps] - flat[second, steps])
        np.add.at(late, (dp, stage), (flat - np.median(flat, axis=0)).mean(axis=1))
        np.add.at(count, (dp, stage), 1)


def per_worker_sum(values: np.ndarray, node_stage: np.ndarray, nodes: np.ndarray,
                   pp: int) -> np.ndarray:
    """Sum of values [N, D, T] over the selected nodes (bool [N]) of each stage: [D, pp, T]."""
    out = np.zeros((values.shape[1], pp, values.shape[2]))
    for p in range(pp):
        sel = nodes & (node_stage == p)
        if sel.any():
            out[:, p, :] = values[sel].sum(axis=0)
    return out


def fmt_steps(steps: list[int]) -> str:
    """'3, 7, 9' (at most 8 shown)."""
    shown = ", ".join(map(str, steps[:8]))
    return shown + (f", … ({len(steps)} in all)" if len(steps) > 8 else "")
