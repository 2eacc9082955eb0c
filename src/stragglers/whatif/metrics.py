"""What-if metrics (docs/whatif.md §7): S, per-step S, attribution by group, worker scores, M_W, M_S."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from stragglers.trace.model import COMPUTE_OPTYPES, OPTYPE_CODES, OPTYPES
from stragglers.whatif.config import DECOMPOSE_SLOWDOWN, DEFAULT
from stragglers.whatif.dependencies import DependencyModel, build_dependencies
from stragglers.whatif.grid import GC, OpGrid
from stragglers.whatif.idealise import ideal_costs
from stragglers.whatif.result import WorkerScore
from stragglers.whatif._replay import CHUNK_BYTES, ReplayPlan, compile_plan, replay
from stragglers.whatif.timing import (base_step_times, host_gaps, launch_delays, measured_costs,
                                      step_starts)

DECOMPOSE_THRESHOLD = DECOMPOSE_SLOWDOWN  # attribution from this S on (docs/whatif.md §7)
TOP_WORKER_PERCENT = 3
COMPUTE_CODES = [OPTYPE_CODES[o] for o in COMPUTE_OPTYPES]
# Send and recv of one direction are one thing to fix (docs/whatif.md §7).
MERGED_OPTYPE = {"forward-send": "forward-pp-comm", "forward-recv": "forward-pp-comm",
                 "backward-send": "backward-pp-comm", "backward-recv": "backward-pp-comm"}


@dataclass
class WhatIf:
    """A job's grid, dependency model and the replays the metrics are built from."""

    grid: OpGrid
    model: DependencyModel
    cost: np.ndarray            # measured cost [N, D, T]
    ideal: np.ndarray           # ideal cost [N, 1, 1]
    ideal_values: dict[str, float]
    step_start: np.ndarray
    t_base: np.ndarray
    t_replay: np.ndarray
    t_nodelay: np.ndarray
    t_ideal: np.ndarray
    launch_delay: np.ndarray
    # the launch delays read as their workers' host-side gaps (timing.host_gaps, computed once:
    # metrics.unexplained and the host_stall detector read them; `launch_delay` itself where
    # there is no rare row)
    host_gap: np.ndarray
    plan: ReplayPlan
    progress: Callable[[str], None] = field(default=lambda _msg: None)
    # fix_fraction answers by mask: diagnosis asks again for masks the metrics already replayed
    _fixes: dict = field(default_factory=dict, repr=False)
    # noise.noise_floor by (draws, seed): a detector and the verdict both ask for it
    _floors: dict = field(default_factory=dict, repr=False)
    # bool [N, D]: the compute cells left out of the ideal (`unexplained`), which the cause
    # detectors read as their stage peers' (causes/base.py Context; None: none)
    computes_left_out: np.ndarray | None = field(default=None, repr=False)

    @classmethod
    def build(cls, grid: OpGrid, dsp_size: int = 1, progress=None) -> "WhatIf":
        """Build the model and run the three top-level replays."""
        tick = progress or (lambda _msg: None)
        model, plan, cost, delay, gaps, start, ideal, values, left = model_and_costs(
            grid, dsp_size, tick)
        tick("replay with launch delays")
        t_replay = replay(plan, cost, start, delay)
        tick("replay without launch delays")
        t_nodelay = replay(plan, cost, start)
        tick("ideal replay")
        t_ideal = replay(plan, ideal, start)
        return cls(grid, model, cost, ideal, values, start, base_step_times(grid), t_replay,
                   t_nodelay, t_ideal, delay, gaps, plan, tick, computes_left_out=left)

    # --- top-level numbers -------------------------------------------------------------
    @property
    def slowdown(self) -> float:
        """S = mean T_nodelay / mean T_ideal."""
        return float(self.t_nodelay.mean() / self.t_ideal.mean())

    @property
    def launch_slowdown(self) -> float:
        """mean T_base / mean T_nodelay: what CPU-side launch gaps cost."""
        return float(self.t_base.mean() / self.t_nodelay.mean())

    @property
    def sim_error(self) -> float:
        """|mean T_replay − mean T_base| / mean T_base."""
        return float(abs(self.t_replay.mean() - self.t_base.mean()) / self.t_base.mean())

    def step_slowdown(self) -> dict[int, float]:
        """S per step."""
        return {int(s): float(a / b) for s, a, b in zip(self.grid.steps, self.t_nodelay, self.t_ideal)}

    # --- attribution -------------------------------------------------------------------
    def restored(self, nodes: np.ndarray) -> float:
        """S_g: ideal everywhere except `nodes` (bool [N]) keep their measured cost."""
        cost = np.broadcast_to(self.ideal, self.cost.shape).copy()
        cost[nodes] = self.cost[nodes]
        return float(replay(self.plan, cost, self.step_start).mean() / self.t_ideal.mean())

    def by_optype(self) -> dict[str, float]:
        """S_t per op type, send and recv merged per direction."""
        names = np.array([MERGED_OPTYPE.get(OPTYPES[c], OPTYPES[c]) for c in self.grid.node_optype])
        out = {}
        for name in sorted(set(names)):
            self.progress(f"attribution: {name}")
            out[name] = self.restored(names == name)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def by_stage(self) -> dict[int, float]:
        """S per pipeline stage."""
        out = {}
        for s in range(self.grid.pp_size):
            self.progress(f"attribution: stage {s}")
            out[s] = self.restored(self.grid.node_stage == s)
        return out

    def by_dp_rank(self) -> dict[int, float]:
        """S per DP rank: rank d measured next to one ideal replica (docs/whatif.md §9), all in one pass."""
        self.progress(f"attribution: {len(self.grid.dp_ranks)} dp ranks")
        n, d, t = self.cost.shape
        pairs = np.empty((n, d, 2, t))
        pairs[:, :, 0, :] = self.cost
        pairs[:, :, 1, :] = self.ideal
        times = replay(self.plan, pairs.reshape(n, 2 * d, t), self.step_start, jobs=d)
        ratio = np.reshape(times, (d, t)).mean(axis=1) / self.t_ideal.mean()
        return {int(r): float(v) for r, v in zip(self.grid.dp_ranks, ratio)}

    def worker_scores(self, by_dp: dict[int, float],
                      by_stage: dict[int, float]) -> list[WorkerScore]:
        """S_w(d, p) = min(S_dp(d), S_pp(p)) for every worker."""
        return [WorkerScore(d, p, min(sd, sp))
                for d, sd in by_dp.items() for p, sp in by_stage.items()]

    def fix_fraction(self, mask: np.ndarray) -> tuple[float, float]:
        """(M_X, mean T_rem): X's ops (bool [N, D]) ideal, everything else measured."""
        key = mask.tobytes()
        if key not in self._fixes:
            n, d, t = self.cost.shape
            span = max(1, CHUNK_BYTES // max(1, n * d * 8))
            times = []
            for lo in range(0, t, span):   # a step slice's copy at a time, not the job's
                cost = self.cost[:, :, lo:lo + span].copy()
                cost[mask] = np.broadcast_to(self.ideal, cost.shape)[mask]
                times.append(replay(self.plan, cost, self.step_start[lo:lo + span]))
            t_rem = float(np.concatenate(times).mean())
            t_nd, t_id = float(self.t_nodelay.mean()), float(self.t_ideal.mean())
            m = 0.0 if t_nd - t_id <= 1e-12 else (t_nd - t_rem) / (t_nd - t_id)
            self._fixes[key] = (m, t_rem)
        return self._fixes[key]

    def mean_step_time(self, cost: np.ndarray) -> float:
        """Mean step time of a replay with the given op costs [N, D, T] and no launch delays."""
        return float(replay(self.plan, cost, self.step_start).mean())

    def ops_mask(self, nodes: np.ndarray) -> np.ndarray:
        """bool [N, D] selecting the template ops `nodes` (bool [N]) on every DP rank."""
        mask = np.zeros(self.cost.shape[:2], dtype=bool)
        mask[nodes] = True
        return mask

    def top_workers(self, scores: list[WorkerScore]) -> list[tuple[int, int]]:
        """The top ⌈3%⌉ workers by S_w (ties: lower rank first)."""
        k = max(1, math.ceil(len(scores) * TOP_WORKER_PERCENT / 100))
        ranked = sorted(scores, key=lambda w: (-w.score, w.pp * 10**6 + w.dp))
        return [(w.dp, w.pp) for w in ranked[:k]]

    def worker_mask(self, workers: list[tuple[int, int]]) -> np.ndarray:
        """bool [N, D] selecting all ops of the given (dp, pp) workers."""
        mask = np.zeros(self.cost.shape[:2], dtype=bool)
        dp_index = {int(d): i for i, d in enumerate(self.grid.dp_ranks)}
        for d, p in workers:
            mask[self.grid.node_stage == p, dp_index[d]] = True
        return mask

    def m_w(self, scores: list[WorkerScore]) -> tuple[float, list[tuple[int, int]]]:
        """M_W: fix only the top ⌈3%⌉ workers."""
        top = self.top_workers(scores)
        return self.fix_fraction(self.worker_mask(top))[0], top

    def m_s(self) -> float:
        """M_S: fix only the last stage."""
        return self.fix_fraction(self.ops_mask(self.grid.node_stage == self.grid.pp_size - 1))[0]


def model_and_costs(grid: OpGrid, dsp_size: int, tick) -> tuple:
    """(model, plan, cost, launch delay, host gaps, step starts, ideal cost, ideal values, the
    computes left out of the ideal or None) of a grid: what every replay of the job starts
    from (in one process or by step partition)."""
    model = build_dependencies(grid, dsp_size)
    plan = compile_plan(model)
    cost = measured_costs(grid, model)
    tick("launch delays")
    delay = launch_delays(grid, model)
    start = step_starts(grid)
    # judged on the workers' own gaps: a rare row's wait on its guessed place is none
    gaps = host_gaps(grid, delay)
    cells = unexplained(grid, plan, cost, gaps, start)
    ideal, values = ideal_costs(grid, cost, model.no_op, cells)
    return model, plan, cost, delay, gaps, start, ideal, values, cells if cells.any() else None


# A worker whose launch delays fill at least this share of the job's step is mostly unexplained
# time: more of its step is gap than anything its rows account for.
UNEXPLAINED_SHARE = 0.5
# ... and whose delays, replayed on their own, cost the job less than the least a host stall
# is named for (stall_min_fraction of the step, docs/whatif.md §7) is not host-stalled: nobody
# waits on its gaps, so they are its own work, timed short (not a launch late).
UNWAITED_COST = DEFAULT.stall_min_fraction
# A suspect whose recorded computes are under this share of its stage peers' median is judged
# against its gaps' length too (`unexplained`): a host-stalled rank computes as much as its
# peers, a real straggler's honest peer a half or a fifth as much (beside a ×2 worker of a
# dp 2 job, 0.498×: read short it was left out and S fell 1.33 → 1.25), a units slip (/1000,
# ms written as s) or a recorder timing launches orders of magnitude less.
SHORT_BUSY = 0.1
# ... and is not waited on while its gaps, replayed alone, cost the job less than this share of
# their length (a stall is waited on nearly whole: 0.56 of the step for gaps of 0.80)
SHORT_WAITED = 0.5
# the words of the warning naming such a worker (the monitor copies it to a window's notes)
IDEAL_LEFT_OUT = "left out of the ideal"
_ROWS_AT_ONCE = 64


def unexplained(grid: OpGrid, plan: ReplayPlan, cost: np.ndarray, delay: np.ndarray,
                start: np.ndarray) -> np.ndarray:
    """bool [N, D]: the compute cells of workers whose stated computes cannot be their work,
    left out of the ideal (idealise.ideal_costs), each named in a grid warning.

    Such a worker's step is mostly launch delay, yet replaying the job with its delays alone
    costs next to nothing: its peers never wait on its gaps, so the gaps are work its rows
    timed short (a recorder timing a kernel's launch, not its run), and its computes would set
    the ideal its stage peers are judged against (an honest peer read ×1.3 and worker_fault;
    red team round 13, finding 1). A real host stall is waited on (×1.56 on the same job)."""
    left = np.zeros(cost.shape[:2], dtype=bool)
    step = float(base_step_times(grid).sum())
    if not step > 0:
        return left
    share = np.zeros((cost.shape[1], grid.pp_size))                           # [D, P]
    for lo in range(0, len(delay), _ROWS_AT_ONCE):   # a few rows at a time: no stage's copy
        rows = slice(lo, lo + _ROWS_AT_ONCE)
        np.add.at(share.T, grid.node_stage[rows], delay[rows].sum(axis=2))
    share /= step
    suspects = np.argwhere(share >= UNEXPLAINED_SHARE)
    if not len(suspects):
        return left
    t_nodelay = _mean_step(plan, cost, start, delay, None)
    if not t_nodelay > 0:   # (no work at all replayed: nothing to judge against; the trace's
        return left         # zero durations are refused where they are read)
    work = np.isin(grid.node_optype, [c for c in COMPUTE_CODES if c != GC])
    busy = np.zeros(share.shape)                                              # [D, P]
    for lo in range(0, len(delay), _ROWS_AT_ONCE):
        rows = slice(lo, lo + _ROWS_AT_ONCE)
        np.add.at(busy.T, grid.node_stage[rows],
                  grid.duration[rows].sum(axis=2) * work[rows, None])
    for di, p in suspects:
        cells = np.zeros(cost.shape[:2], dtype=bool)
        cells[grid.node_stage == p, di] = True
        waited = (_mean_step(plan, cost, start, delay, cells) - t_nodelay) / t_nodelay
        peers = np.delete(busy[:, p], di)
        short = len(peers) > 0 and busy[di, p] < SHORT_BUSY * np.median(peers)
        # Its computes far shorter than its peers' yet its step as long as theirs (the
        # collectives they share end together): its gaps are its work unless the job waits on
        # them nearly whole, as on a stall (×0.7 of their length and more); replayed alone,
        # its gaps also repeat the delays every worker has (step gaps, launches), which cost
        # the job too. With two DP ranks no majority tells the slip from the honest rank: a
        # rank whose durations were written /1000 cost 7-29% (noise, step gaps), and its
        # honest peer read ×2 slow (S 2.0, worker_fault).
        bar = max(UNWAITED_COST, share[di, p] * SHORT_WAITED) if short else UNWAITED_COST
        if waited >= bar:
            continue
        left[(grid.node_stage == p) & work, di] = True
        how = (f"its computes {busy[di, p] / np.median(peers):.3g}× its stage peers' and its "
               "step as long as theirs, replayed alone they cost the job" if short else
               "replayed alone they cost the job")
        grid.warnings.append(
            f"computes of worker (dp {int(grid.dp_ranks[di])}, pp {int(p)}) {IDEAL_LEFT_OUT}: "
            f"its launch delays are {share[di, p]:.0%} of the step, yet {how} {waited:.1%} "
            "(nobody waits on its gaps: its computes are timed shorter than its work)")
    return left


def _mean_step(plan: ReplayPlan, cost: np.ndarray, start: np.ndarray, delay: np.ndarray,
               cells: np.ndarray | None) -> float:
    """Mean step time of a replay with measured costs and the launch delays of `cells`
    (bool [N, D]; None: no delays), a step slice's copy at a time."""
    if cells is None:
        return float(replay(plan, cost, start).mean())
    n, d, t = cost.shape
    span = max(1, CHUNK_BYTES // max(1, n * d * 8))
    times = []
    for lo in range(0, t, span):
        part = np.zeros_like(delay[:, :, lo:lo + span])
        part[cells] = delay[:, :, lo:lo + span][cells]
        times.append(replay(plan, cost[:, :, lo:lo + span], start[lo:lo + span], part))
    return float(np.concatenate(times).mean())
