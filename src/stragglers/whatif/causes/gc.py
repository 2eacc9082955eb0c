"""Garbage-collection pauses: from gc rows where they carry pauses, else from the duration pattern."""

from __future__ import annotations

import warnings

import numpy as np

from stragglers.whatif.causes.base import Candidate, Context, Rows, fmt_steps
from stragglers.whatif.causes.sequence import MicrobatchCells
from stragglers.whatif.confidence import MAD_TO_SIGMA
from stragglers.whatif.grid import BWD, FWD, GC

# Smallest relative spread of compute durations assumed (noise-free synthetic jobs have ~0).
_REL_SPREAD_FLOOR = 1e-3


def gc_pauses(ctx: Context) -> list[Candidate]:
    """GC pauses recorded as gc rows, or (no pause in any gc row) hidden inside compute."""
    found = _from_rows(ctx)
    return [found] if found is not None else ctx.compute_pauses


def _records_gc(trace) -> bool:
    """Whether the trace's recorder wrote the collector's pauses as gc rows itself (attach:
    every pause from `gc_min_s` on; meta.extra["recorder"])."""
    recorder = trace.meta.extra.get("recorder")
    return isinstance(recorder, dict) and recorder.get("gc_min_s") is not None


def _gc_row_durations(ctx: Context) -> np.ndarray | None:
    """[n_gc, D, T] durations of the gc rows, or None when none carries a pause (NDTimeline
    writes zero-length gc rows: the pauses are then inside compute)."""
    g = ctx.w.grid
    nodes = g.node_optype == GC
    if not nodes.any():
        return None
    dur = np.where(g.present[nodes], g.duration[nodes], 0.0)
    return dur if dur.sum() > 0 else None


def _from_rows(ctx: Context) -> Candidate | None:
    w, g = ctx.w, ctx.w.grid
    dur = _gc_row_durations(ctx)
    if dur is None:
        return None
    nodes = g.node_optype == GC
    pause = dur > ctx.cfg.gc_pause_fraction * dur.max()
    ids = np.flatnonzero(nodes)
    workers = sorted({(int(d), int(g.node_stage[ids[k]])) for k, d, _ in zip(*np.nonzero(pause))})
    steps = sorted({int(g.steps[t]) for t in np.nonzero(pause)[2]})
    cost = Rows(ids, np.zeros((len(ids),) + w.cost.shape[1:]))   # the gc rows, paused none
    evidence = (f"{int(pause.sum())} GC pauses totalling {float(dur.sum()):.3f} s on "
                f"{len(workers)} workers at uncoordinated steps (gc rows)")
    # a gc row is the collector's own record of a pause: no noise to tell it from
    return Candidate("gc", ctx.where_workers(workers, steps), evidence, cost=cost,
                     upper_bound=True, strata=ctx.step_mask(steps), established=True)


def pauses_in_compute(ctx: Context) -> list[Candidate]:
    """Rare, large outliers of forward/backward compute that the same microbatch does not share.

    Each op is compared with the same op on the same worker in the other steps (median), so a
    slow worker or a heavy stage is not an outlier; an outlier whose microbatch is slow
    elsewhere too (backward, other stages) is sequence imbalance, not a pause.
    """
    w, g, trace, cfg = ctx.w, ctx.w.grid, ctx.trace, ctx.cfg
    if ctx.steps < 3 or _gc_row_durations(ctx) is not None:
        return []   # the median over steps needs a majority of pause-free steps; gc rows
        #             that carry the pauses say where they are
    if trace.meta.extra.get("compute_from") == "gpu kernels":
        return []   # a pause of the Python host cannot lengthen a GPU kernel: on a GPU trace
        #             it leaves the GPU idle (a launch delay), never a longer compute op
    if _records_gc(trace):
        return []   # our recorder writes every pause of the process's collector as a gc row
        #             (gc.callbacks): with none recorded, long compute ops are no GC pauses
        #             (on a loaded CPU: the scheduler's preemption, which cpu_contention tells)
    if g.pp_size == 1 and not (g.node_optype == BWD).any():
        return []   # one compute op per worker and step (a table of step times): no partner
        #             op of the same microbatch to tell a pause from any slow step by
    compute = np.flatnonzero(np.isin(g.node_optype, (FWD, BWD)))
    raw = g.duration[compute]                                      # [n, D, T]
    # Where the trace carries Σs², ops are compared without the share their sequences
    # explain: a microbatch of long sequences is no pause, and with sequences that vary from
    # step to step the pauses hide among such microbatches.
    balanced = ctx.seq_balanced
    dur = raw if balanced is None else balanced[compute]
    typical = np.median(dur, axis=2, keepdims=True)
    # Compute noise is multiplicative: the outlier test is on log durations. (In place: on a
    # big job each of these is the size of the grid's compute rows.)
    log_rel = np.maximum(dur, 1e-12)
    log_rel /= np.maximum(typical, 1e-12)
    np.log(log_rel, out=log_rel)
    by_mb = None
    stood_out = None    # ops of microbatches whose shared factor stood out as a pause
    back: np.ndarray | float = 1.0
    if balanced is None:
        # Without Σs² the microbatches' uneven lengths would go into the spread (seed 9 job 28
        # of --wide --no-seq-lens: bar x18.5 against x1.44 with Σs², 1 of 10 pauses found).
        # A microbatch's length scales all its ops alike and a pause lengthens one: each
        # microbatch's shared factor is the smallest of its ops' log ratios.
        by_mb = _Microbatches(ctx.w, trace, compute)
        resid, shared, factor = _without_microbatch_factor(log_rel, by_mb, cfg)
        bar = _pause_bar(resid[~shared], cfg)
        # An op paused in most of its steps has a pause for its median: against it, its
        # pause-free steps set a low factor that its partner ops then stand out from (an
        # invented pause in each). It is measured against what its peers make usual.
        usual = _usual_on_peers(dur, typical, bar, g.node_stage[compute])
        if usual is not typical:
            np.log(np.maximum(dur, 1e-12) / np.maximum(usual, 1e-12), out=log_rel)
            resid, shared, factor = _without_microbatch_factor(log_rel, by_mb, cfg)
        log_rel = resid
        stood_out = _factor_stood_out(shared, by_mb)
        del resid, shared
        dur = dur / factor
        back = factor     # a pause adds seconds: its excess is counted at the microbatch's length
        typical = np.median(dur, axis=2, keepdims=True)
    else:
        # Balancing Σs² moves each microbatch to its step's mean load, which stays: a step of
        # long sequences lengthens every op of it alike (dp 1: ±35%, a bar of ×4.7 that
        # pauses ×4.4-4.9 did not reach, --wide seed 23 job 39). That shared factor is taken
        # out as the microbatch's is above (the median over the step's ops: pauses are rare).
        step = np.median(log_rel, axis=(0, 1), keepdims=True)          # [1, 1, T]
        dur = dur / np.exp(step)
        back = np.exp(step)
        typical = np.median(dur, axis=2, keepdims=True)
        np.log(np.maximum(dur, 1e-12) / np.maximum(typical, 1e-12), out=log_rel)
        bar = _pause_bar(np.abs(log_rel), cfg)
    outlier = log_rel >= bar
    del log_rel
    typical = _usual_without_pauses(dur, typical, outlier, bar, g.node_stage[compute])
    count = int(outlier.sum())
    if count == 0 or count > cfg.gc_max_rate * outlier.size:
        return []
    # Microbatch-bound: another op of the same microbatch on the same DP rank and step is out too.
    if by_mb is None:
        by_mb = _Microbatches(ctx.w, trace, compute)
    rate = count / outlier.size
    bound = outlier & (by_mb.at(by_mb.sum(outlier)) >= 2)
    if stood_out is not None:
        # every op of the microbatch paused, its factor standing out among all microbatches'
        # as a pause among ops: no sequences bind them (dp 1 × pp 1, --wide seed 9 job 162:
        # 2 of 3 pauses on one microbatch's fwd and bwd, read as sequences)
        bound &= ~stood_out
    # outliers that independent pauses would put beside another one
    chance = float(np.sum(np.where(outlier, 1.0 - (1.0 - rate) ** (by_mb.size - 1), 0.0))) / count
    # Sequence imbalance binds a microbatch's ops together far beyond chance; pauses only by
    # chance, which is large where a microbatch has many ops (pp 8: 16 per DP rank and step,
    # so at 5% of ops paused half the pauses share a microbatch with another).
    if bound.sum() > count * (chance + cfg.gc_max_bound * (1.0 - chance)):
        return []
    # The pattern is GC: every outlier is a pause (two may hit one microbatch by chance).
    pause = outlier
    excess = np.where(pause, (dur - typical) * back, 0.0)
    cost = Rows.on(w.cost, compute)      # the compute rows only, not a copy of the grid
    cost.values[:] = np.where(pause, np.maximum(raw - excess, 0.0), cost.values)
    k, d, t = np.nonzero(pause)
    workers = sorted({(int(x), int(g.node_stage[compute[y]])) for y, x in zip(k, d)})
    steps = sorted({int(g.steps[x]) for x in t})
    at = np.broadcast_to(typical, dur.shape)[pause]
    times = float(np.median(1 + (dur[pause] - at) / np.maximum(at, 1e-12)))
    evidence = (f"{int(pause.sum())} forward/backward ops ({100 * pause.mean():.1f}% of them) "
                f"take {times:.1f}× their usual time (median), {float(excess.sum()):.3f} s "
                f"more in all, on "
                f"{len(workers)} workers at random steps ({fmt_steps(steps)}), not tied to a "
                f"microbatch: GC pauses inside compute (the trace's gc rows carry none)")
    # each pause passed an outlier test of its own (gc_outlier_z robust deviations over the
    # op's usual time): what is left to ask of the gain is that it be worth fixing
    return [Candidate("gc", ctx.where_workers(workers, steps), evidence, cost=cost,
                      upper_bound=True, strata=ctx.step_mask(steps), established=True)]


def _pause_bar(spread: np.ndarray, cfg) -> float:
    """The log ratio from which an op is a pause: gc_outlier_z robust deviations of `spread`
    (absolute log ratios), and at least gc_min_excess."""
    scale = max(MAD_TO_SIGMA * float(np.median(spread, overwrite_input=True)), _REL_SPREAD_FLOOR)
    return max(float(np.log1p(cfg.gc_min_excess)), cfg.gc_outlier_z * scale)


def _peer_expected(dur: np.ndarray, stage: np.ndarray) -> np.ndarray:
    """[n, D, 1] each op's usual time on each worker from its peers: the op's median over DP
    ranks and steps times the worker's speed (its stage's ops' median ratio to their peers)."""
    peers = np.median(dur, axis=(1, 2), keepdims=True)                     # [n, 1, 1]
    rel = dur / np.maximum(peers, 1e-12)
    speed = np.ones((1,) + dur.shape[1:2] + (1,))
    expected = np.empty(dur.shape[:2] + (1,))
    for p in np.unique(stage):
        rows = stage == p
        speed[0, :, 0] = np.median(rel[rows].transpose(1, 0, 2).reshape(dur.shape[1], -1),
                                   axis=1)
        expected[rows] = peers[rows] * speed
    return expected


def _usual_on_peers(dur: np.ndarray, typical: np.ndarray, bar: float,
                    stage: np.ndarray) -> np.ndarray:
    """`typical` [n, D, 1], with what the peers make usual where the median over steps is
    itself a pause (`typical` itself where none is, or there are no peers)."""
    if dur.shape[1] < 2:
        return typical
    expected = _peer_expected(dur, stage)
    paused = _median_paused(dur, expected, bar)
    return np.where(paused, expected, typical) if paused.any() else typical


def _median_paused(dur: np.ndarray, expected: np.ndarray, bar: float) -> np.ndarray:
    """bool [n, D, 1]: the op's median over its steps is pulled by pauses, at least half of
    its steps a pause (`bar`) above what its peers make usual (`expected` [n, D, 1]).

    Half is enough: with 4 of 8 steps paused ×3.2 the median sat halfway (×2.0, under the
    bar), so the op's pauses did not stand out against it, and at its clean steps it set its
    microbatch's factor so low that its partner ops read as pauses (dp 16 × pp 2, --wide
    seed 21 job 179: the pauses left in named the worker a worker_fault ×1.044)."""
    above = np.log(np.maximum(dur, 1e-12) / np.maximum(expected, 1e-12)) >= bar
    return 2 * above.sum(axis=2, keepdims=True) >= dur.shape[2]


class _Microbatches:
    """Which microbatch each forward/backward op (`compute`, all stages) holds in each
    worker-step, its own row's (sequence.MicrobatchCells): a DP rank numbering its microbatches
    otherwise holds another microbatch at a template op than the stage's reference replica-step,
    and keyed by that one its ops were grouped with other microbatches' ops on the other stages
    (their shared factor and the pauses they bind)."""

    def __init__(self, w, trace, compute: np.ndarray) -> None:
        cells = MicrobatchCells(w, trace, [compute])
        self.index = cells.index[0]                                   # [n, D, T]
        self.m = len(cells.ids)
        self.shape = (self.m,) + self.index.shape[1:]
        self.cells = cells
        # (where an op's microbatch differs among worker-steps: each op's cell of an [M, D, T]
        # array as one flat index, a gather by it a few times faster than by three arrays)
        self.flat = cells.flat(0) if cells.same[0] is None else None
        self.size = self.at(self.sum(np.ones(self.index.shape)))     # [n, D, T] ops of its mb

    def sum(self, values: np.ndarray) -> np.ndarray:
        """[M, D, T]: `values` [n, D, T] summed over each microbatch's ops in each cell."""
        return self.cells.reduce(0, np.add, np.zeros(self.shape), values)

    def least(self, values: np.ndarray) -> np.ndarray:
        """[M, D, T]: the smallest of `values` over each microbatch's ops in each cell."""
        return self.cells.reduce(0, np.minimum, np.full(self.shape, np.inf), values)

    def at(self, per_mb: np.ndarray) -> np.ndarray:
        """[n, D, T]: `per_mb` [M, D, T] at the microbatch each op holds."""
        if self.flat is None:
            return per_mb[self.cells.same[0]]
        return per_mb.reshape(-1)[self.flat]


def _without_microbatch_factor(log_rel: np.ndarray, by_mb: _Microbatches, cfg
                               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Log ratios [n, D, T] less each microbatch's shared factor (the smallest over its ops on
    the same DP rank and step), where that factor sits (the op that set it, the first of
    them, a residual of 0 by construction, left out of the spread), and the factor itself
    [n, D, T] (as a ratio).

    A factor that stands out among all microbatches' factors as a pause would among ops is
    not taken out: every op of that microbatch was paused (two pauses of one fwd/bwd pair
    at pp 1, by chance some eight times on a 64-rank job), and the sequences' spread of
    factors is too wide for one microbatch to stand out so."""
    least = by_mb.least(log_rel)                                      # [M, D, T]
    # a lone op: its factor would be itself, no pause could show
    multi = by_mb.sum(np.ones(log_rel.shape)) > 1
    taken = multi.copy()
    if multi.any():
        every = least[multi]
        dev = every - np.median(every)
        taken[multi] = dev < _pause_bar(np.abs(dev), cfg)
    low = log_rel == by_mb.at(least)
    n = np.broadcast_to(np.arange(len(log_rel))[:, None, None], log_rel.shape)
    first = by_mb.least(np.where(low, n, len(log_rel)))   # (the first op that set it)
    on = by_mb.at(taken)
    shared = low & (n == by_mb.at(first)) & on
    factor = np.where(on, by_mb.at(least), 0.0)
    return log_rel - factor, shared, np.exp(factor)


def _factor_stood_out(shared: np.ndarray, by_mb: _Microbatches) -> np.ndarray:
    """bool [n, D, T]: the ops of each microbatch (of two ops or more) on a DP rank and step
    whose shared factor was not taken out (it stood out as a pause: no op of it set it)."""
    return (by_mb.size > 1) & (by_mb.at(by_mb.sum(shared)) == 0)


def _usual_without_pauses(dur: np.ndarray, typical: np.ndarray, outlier: np.ndarray,
                          bar: float, stage: np.ndarray) -> np.ndarray:
    """The usual time [n, D, 1] of each op on its worker, the median of its steps without a
    pause; `outlier` [n, D, T] is extended in place to the pauses that then stand out.

    An op paused in several steps pulls its median over steps toward the pause (by chance in
    4 of 8 steps somewhere on a job of thousands of ops): measured against that median its
    pauses were cut only to it, and what was left read as the worker's slowness (a worker
    fault named on a job with GC pauses only). Only the ops with an outlier are recomputed.
    An op paused in half its steps or more (3 of 5: about once per 64 × 2 job) has a pause
    for its median, or one pulled halfway to it: it is found against what its worker's speed (its ops' median over their
    peers') and the op's time on its peers (median over DP ranks and steps) make usual.
    """
    typical = typical.copy()
    if dur.shape[1] > 1:
        expected = _peer_expected(dur, stage)
        # the op's median over its steps is itself a pause: its paused steps stand out
        # against what is usual for it on this worker
        paused_usual = _median_paused(dur, expected, bar)
        if paused_usual.any():
            n, d = np.nonzero(paused_usual[:, :, 0])
            outlier[n, d] |= np.log(np.maximum(dur[n, d], 1e-12)
                                    / np.maximum(expected[n, d], 1e-12)) >= bar
    for _ in range(_USUAL_ROUNDS):
        n, d = np.nonzero(outlier.any(axis=2))
        if not len(n):
            break
        steps = dur[n, d]                                             # [k, T]
        with warnings.catch_warnings():   # every step an outlier: the typical value below
            warnings.simplefilter("ignore", RuntimeWarning)
            usual = np.nanmedian(np.where(outlier[n, d], np.nan, steps), axis=1)
        usual = np.where(np.isfinite(usual), usual, typical[n, d, 0])
        out = np.log(np.maximum(steps, 1e-12) / np.maximum(usual, 1e-12)[:, None]) >= bar
        typical[n, d, 0] = usual
        if np.array_equal(out, outlier[n, d]):
            break
        outlier[n, d] = out
    return typical


# Rounds of the usual time left out the pauses found (it stops once no more stand out).
_USUAL_ROUNDS = 4
