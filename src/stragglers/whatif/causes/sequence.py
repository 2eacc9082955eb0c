"""Sequence-length imbalance: microbatches whose cost differs the way their Σ sᵢ² does (docs/whatif.md §7)."""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import Trace
from stragglers.whatif.causes.base import Candidate, Context
from stragglers.whatif.confidence import MAD_TO_SIGMA
from stragglers.whatif.dependencies import reference_rows
from stragglers.whatif.grid import BWD, FWD
from stragglers.whatif.metrics import WhatIf
from stragglers.whatif.result import Where

# Rounds of the Σs² fit that leave out the ops a pause lengthened (it stops once stable).
_FIT_ROUNDS = 6
# Relative change in a worker's speed estimate under which the fit counts as stable.
_SPEED_TOL = 1e-3


def sequence_imbalance(ctx: Context) -> list[Candidate]:
    """Stages whose microbatches differ in cost together in forward and backward (or with Σs²)."""
    found = ctx.seq_pattern
    if found is None:
        return []
    stages, corr, cv, fit = found
    evidence = (f"microbatch compute varies by {100 * cv:.0f}% within each worker and step on "
                f"stage(s) {', '.join(map(str, stages))}; forward and backward of the same "
                f"microbatch correlate at {corr:.2f}")
    balanced = ctx.seq_balanced
    if balanced is not None:
        evidence += f"; compute follows Σs² (correlation {fit:.2f})" if fit is not None else ""
        evidence += "; the prediction moves every microbatch's Σs² to the step's mean"
        cost = balanced
    else:
        evidence += ("; no Σs² in the trace: the prediction removes the cost factor each "
                     "microbatch shares across its forward, backward and stages")
        cost = balanced_by_microbatch_factor(ctx)
    # the pattern test (microbatches' forward and backward, or compute and Σs², correlate
    # at seq_corr / seq_fit) already tells it from op noise, which correlates with neither
    return [Candidate("sequence_imbalance", Where(pp=[int(p) for p in stages]), evidence, cost=cost,
                      upper_bound=True, established=True)]


def detect(ctx: Context):
    """(stages, corr, cv, fit) on durations normalised per worker and step, or None.

    Normalising per worker and step keeps a uniformly slow worker or a drifting machine out.
    """
    g, trace, cfg = ctx.w.grid, ctx.trace, ctx.cfg
    stages, corrs, cvs, fits = [], [], [], []
    for s in range(g.pp_size):
        # GC pauses inside compute (found first) would break the pattern: one op of a
        # microbatch paused, its partner not
        f = _by_microbatch(ctx, s, FWD)
        b = _by_microbatch(ctx, s, BWD)
        if f is None or b is None or f.shape != b.shape or f.shape[0] < 2:
            continue
        keep = _paired(f, b, cfg)
        fn = f / np.maximum(_kept_mean(f, keep, (0,)), 1e-12)
        bn = b / np.maximum(_kept_mean(b, keep, (0,)), 1e-12)
        fn, bn = fn[keep], bn[keep]
        if fn.std() == 0 or bn.std() == 0:
            continue
        corr = float(np.corrcoef(fn.ravel(), bn.ravel())[0, 1])
        cv = float(fn.std())
        fit = _attn_fit(ctx, s, f + b)
        if cv >= cfg.seq_cv and (corr >= cfg.seq_corr or (fit is not None and fit >= cfg.seq_fit)):
            stages.append(s)
            corrs.append(corr)
            cvs.append(cv)
            if fit is not None:
                fits.append(fit)
    if not stages:
        return None
    return stages, float(np.mean(corrs)), float(np.mean(cvs)), \
        (float(np.mean(fits)) if fits else None)


def _paired(f: np.ndarray, b: np.ndarray, cfg) -> np.ndarray:
    """Which microbatches [mb, D, T] keep their forward/backward ratio: sequences scale both
    ops of a microbatch alike (all of them where too many do not for pauses).

    A GC pause that the pause test did not find lengthens one op of its pair: left in, it
    broke the correlation that tells sequences apart and, by raising its worker-step's mean,
    made every other microbatch there look short (--wide --no-seq-lens seed 10 job 19:
    correlation 0.69-0.82, sequences missed). Such a pair's log ratio stands out as a pause
    does among ops (`gc_outlier_z` robust deviations, at least `gc_min_excess`).
    """
    ratio = np.log(np.maximum(f, 1e-12) / np.maximum(b, 1e-12))
    dev = np.abs(ratio - np.median(ratio))
    scale = MAD_TO_SIGMA * float(np.median(dev))
    out = (dev > cfg.gc_outlier_z * scale) & (dev > np.log1p(cfg.gc_min_excess))
    if out.mean() > cfg.gc_max_rate:
        out[:] = False
    return ~out


def balanced_by_attn_cost(ctx: Context) -> np.ndarray | None:
    """Costs after Σs² is balanced across DP ranks and microbatches of each stage and step.

    Per stage and compute type, duration ≈ f(Σs²) (least-squares polynomial, both relative to
    the step's mean); balancing moves every microbatch's Σs² to the step's mean, so each op
    loses f(Σs²) − f(mean) and keeps its residual.
    """
    trace, w = ctx.trace, ctx.w
    if "attn_cost" not in trace.ops:
        return None
    g = w.grid
    cost = w.cost.copy()
    for s in range(g.pp_size):
        for code in (FWD, BWD):
            nodes = microbatch_nodes(w, trace, s, code)
            if len(nodes) == 0:
                continue
            rows = g.row[nodes]
            attn = np.where(rows >= 0, trace.ops["attn_cost"][np.maximum(rows, 0)], np.nan)
            if not np.all(np.isfinite(attn)):
                return None
            dur = ctx.duration[nodes]
            x = attn / np.maximum(attn.mean(axis=(0, 1), keepdims=True), 1e-300)
            if np.std(x) == 0:
                continue
            fitted = _fit_without_pauses(x, dur, ctx.cfg)
            if fitted is None:               # no increasing relation: nothing to balance
                continue
            fit, unit = fitted
            cost[nodes] = np.maximum(dur - (fit(x) - fit(1.0)) * unit, 0.0)
    return cost


def _fit_without_pauses(x: np.ndarray, dur: np.ndarray, cfg):
    """(fit, unit [1, D, T]) of duration on Σs² [mb, D, T], duration in units of its step's
    mean and its worker's own speed, left out the ops a pause lengthened; None when cost does
    not grow with Σs².

    Fit in units of each step's mean: a machine whose speed drifts from step to step (a
    loaded host) changes the seconds per Σs², not the relative shape. And of each worker's
    own speed: a slow worker stretches its microbatches' Σs² share as it stretches the rest
    (a slow GPU multiplies), so its ops lose that share in its own seconds; its speed is how
    much longer than its sequences predict it computes (mean over its microbatches and
    steps: a rank that drew long sequences is no slower). A GC pause inside an op adds
    seconds that Σs² does not explain: kept in, one 10× op pulls the least-squares curve and
    its step's mean (with pauses in most steps the prediction kept a fraction of the
    imbalance), so the ops far above the curve, by what the pause test calls a pause
    (`gc_outlier_z` robust deviations and `gc_min_excess` of the fitted time), are left out
    and the fit made again, until the set and the speeds are stable.
    """
    # Quadratic where there are enough microbatches: measured cost grows faster than
    # linearly in Σs² on real hardware (cache, memory traffic of long sequences).
    degree = 2 if x.size >= 12 else 1
    keep = np.ones(dur.shape, dtype=bool)
    speed = np.ones((1, dur.shape[1], 1))
    for _ in range(_FIT_ROUNDS):
        unit = _kept_mean(dur / speed, keep, (0, 1)) * speed                   # [1, D, T]
        y = dur / np.maximum(unit, 1e-300)
        fit = np.polynomial.Polynomial.fit(x[keep], y[keep], degree)
        curve = fit(x)
        # the median over the worker's ops: its pauses do not move it, nor does a first
        # round that, before its speed was known, took a slow worker's ops for pauses
        ratio = np.median(y / np.maximum(curve, 1e-12), axis=(0, 2), keepdims=True)
        ratio /= float(ratio.mean())                                            # [1, D, 1]
        resid = y - curve
        scale = MAD_TO_SIGMA * float(np.median(np.abs(resid[keep])))
        paused = (resid > cfg.gc_outlier_z * scale) & \
            (resid > cfg.gc_min_excess * np.maximum(curve, 1e-12))
        if paused.mean() > cfg.gc_max_rate:
            paused[:] = False    # too many to be pauses: the fit keeps every op
        if np.array_equal(~paused, keep) and np.allclose(ratio, 1.0, atol=_SPEED_TOL):
            break
        keep = ~paused
        speed = speed * ratio
    if fit(x.max()) < fit(1.0):
        return None
    return fit, unit


def _kept_mean(values: np.ndarray, keep: np.ndarray, axis: tuple[int, ...]) -> np.ndarray:
    """Mean of `values` over `axis` (kept dims) counting only the cells `keep` holds (all of
    them where it holds none)."""
    count = keep.sum(axis=axis, keepdims=True)
    kept = np.where(keep, values, 0.0).sum(axis=axis, keepdims=True) / np.maximum(count, 1)
    return np.where(count > 0, kept, values.mean(axis=axis, keepdims=True))


def without_sequence_load(ctx: Context) -> np.ndarray | None:
    """Durations [N, D, T] with each microbatch's load divided out, as a worker's own speed is
    judged where the trace has no Σs² (None with one stage: no other stage tells load from
    speed, and a microbatch's fwd/bwd share both; None where the run's load cannot be told
    robustly, see below).

    The same sequences cross every stage of a DP rank, and a worker's speed is its own
    stage's alone: a microbatch's load on a worker is what its ops on the rank's other stages
    share, step by step (their log durations less each worker's mean there), plus the rank's
    load over the whole run, the median over those stages of how far its workers sit from
    their stage's median worker (only where one slow worker moves neither). Kept in, a rank's load, which over a few steps stays above or below its peers' by chance
    (±12% over 8 steps at a 42% microbatch spread), spread every worker's ratio to its peers:
    a worker ×1.9 among 16 stood 3.9-5.8 robust deviations out, under outlier_z. What this
    gives up: a pipeline replica slow on every stage reads as its sequences' load.
    """
    w, g, trace = ctx.w, ctx.w.grid, ctx.trace
    d, free = g.shape[1], ctx.pause_free             # measured without the pauses found
    # The rank's load over the run, per stage, where one slow worker can move neither the
    # stage's median worker (three DP ranks or more) nor the median over the other stages
    # (three or more of them: of two DP ranks each sits as far from their mean as the other).
    # Elsewhere none is taken out: the load step by step alone would leave the run's, a
    # chance offset (+17% over 8 steps at dp 2 × pp 2) that the steps' spread no longer
    # covered, named as a slow worker
    if g.pp_size < 2 or not (d >= 3 or g.pp_size >= 4):
        return None
    found = []                                       # (stage, nodes, residual [n, D, T])
    offsets = np.zeros((d, g.pp_size))               # [D, P] persistent, from stage medians
    groups = np.zeros(g.pp_size)
    for s in range(g.pp_size):
        for code in (FWD, BWD):
            nodes = microbatch_nodes(w, trace, s, code)
            if len(nodes) == 0:
                continue
            mc = trace.ops["mc"][microbatch_rows(w, nodes)]
            log = np.log(np.maximum(free[nodes], 1e-12))
            for chunk in np.unique(mc):              # each model chunk's ops: their own mean
                sel = mc == chunk
                mine = log[sel].mean(axis=(0, 2))                        # [D]
                log[sel] -= mine[None, :, None]
                offsets[:, s] += mine - np.median(mine)
                groups[s] += 1
            found.append((s, nodes, log))
    offsets /= np.maximum(groups, 1)[None, :]
    run = [np.median(np.delete(offsets, s, axis=1), axis=1)[:, None] for s in range(g.pp_size)]
    # what the ops of each worker-step's microbatch on the other stages share
    cells = MicrobatchCells(w, trace, [nodes for _, nodes, _ in found])
    total, count = cells.sums([log for _, _, log in found])
    on_stage = {s: cells.sums([log if t == s else None for t, _, log in found])
                for s in {s for s, _, _ in found}}
    logs: dict = {}
    for k, (s, nodes, _) in enumerate(found):
        mine, mine_n = on_stage[s]
        others = cells.at(k, count) - cells.at(k, mine_n)
        pred = (cells.at(k, total) - cells.at(k, mine)) / np.maximum(others, 1) + run[s]
        pred = np.where(others > 0, pred, 0.0)       # (none on other stages: left as it is)
        for i, n in enumerate(nodes):
            if np.any(others[i] > 0):
                logs[int(n)] = [pred[i]]
    return _divided(ctx.duration, free, logs, {n: [n] for n in logs})


def balanced_by_microbatch_factor(ctx: Context) -> np.ndarray:
    """Costs with each microbatch's shared factor divided out.

    A microbatch carries its sequences through every stage, forward and backward: its cost
    factor (duration over the step's mean of its op type, with each worker's persistent speed
    taken out) is common to all of them, while per-op noise is not. The geometric mean over
    those ops estimates the factor; dividing it out balances microbatches and DP ranks.
    It is measured and divided out on the durations without the GC pauses found inside
    compute, which stay where they are (the collector's, not the sequences'): a ×14 pause
    in the factor's mean made its microbatch look long and, through the step's mean, every
    other one short, and the fix predicted a slowdown (×0.95 beside GC ×1.9, --wide
    --no-seq-lens seed 26 job 143: sequences ×1.05 missed).
    """
    w, g, trace = ctx.w, ctx.w.grid, ctx.trace
    free = ctx.pause_free
    found = []                                        # (nodes, log ratio [n, D, T])
    for s in range(g.pp_size):
        for code in (FWD, BWD):
            nodes = microbatch_nodes(w, trace, s, code)
            if len(nodes) < 2:
                continue
            dur = np.maximum(free[nodes], 1e-12)
            per_worker = dur.mean(axis=0)                                   # [D, T]
            # Across DP ranks: a step's sequences load the ranks unevenly; what persists
            # over steps is the worker's own speed (a worker fault), not sequences.
            across = np.log(per_worker / per_worker.mean(axis=0, keepdims=True))
            across -= across.mean(axis=1, keepdims=True)
            found.append((nodes, np.log(dur / per_worker[None]) + across[None]))
    out = w.cost.copy()
    cells = MicrobatchCells(w, trace, [nodes for nodes, _ in found])
    total, count = cells.sums([norm for _, norm in found])
    for k, (nodes, _) in enumerate(found):
        factor = np.exp(cells.at(k, total) / np.maximum(cells.at(k, count), 1))
        out[nodes] -= free[nodes] - free[nodes] / factor
    return out


class MicrobatchCells:
    """Which microbatch each of some template ops holds in each worker-step: its own row's
    mb_id (the reference replica-step's where it has no row). A DP rank numbering its
    microbatches otherwise holds, at a template op, another microbatch than the replica-step
    the model read: keyed by that one, its ops were paired with other microbatches' ops on
    the other stages."""

    def __init__(self, w: WhatIf, trace: Trace, groups: list[np.ndarray]) -> None:
        g, mb_id = w.grid, trace.ops["mb_id"]
        held = []
        for nodes in groups:
            rows = g.row[nodes]
            ref = mb_id[microbatch_rows(w, nodes)]
            held.append(np.where(rows >= 0, mb_id[np.maximum(rows, 0)], ref[:, None, None]))
        self.ids = np.unique(np.concatenate([m.ravel() for m in held])) if held \
            else np.zeros(0, np.int64)
        self.index = [np.searchsorted(self.ids, m) for m in held]       # [n, D, T] each
        # (per group, each op's microbatch where it holds one in every worker-step, as in an
        # honest trace: its sums and gathers then go over whole [D, T] planes at once)
        self.same = [m[:, 0, 0] if m.size and bool((m == m[:, :1, :1]).all()) else None
                     for m in self.index]
        _, d, t = g.shape
        self.dd, self.tt = np.indices((d, t))

    def flat(self, k: int) -> np.ndarray:
        """[n, D, T]: the cell of an [M, D, T] array each op of group `k` holds, flat."""
        d, t = self.dd.shape
        return (self.index[k] * d + self.dd[None]) * t + self.tt[None]

    def reduce(self, k: int, ufunc: np.ufunc, out: np.ndarray, values: np.ndarray
               ) -> np.ndarray:
        """`out` [M, D, T] with group `k`'s `values` [n, D, T] folded in by `ufunc` (np.add,
        np.minimum) at the microbatch each op holds, op after op: an op's cells are distinct,
        and the ops' order is np.add.at's (the same sums), at a tenth of its time on a
        16M-op job (ufunc.at took 1 s of its analysis)."""
        values = np.broadcast_to(values, self.index[k].shape)
        same = self.same[k]
        if same is not None:   # (an op's microbatch the same in every cell: its whole plane)
            for m, v in zip(same, values):
                out[m] = ufunc(out[m], v)
            return out
        for idx, v in zip(self.index[k], values):
            at = (idx, self.dd, self.tt)
            out[at] = ufunc(out[at], v)
        return out

    def sums(self, values: list[np.ndarray | None]) -> tuple[np.ndarray, np.ndarray]:
        """Per microbatch and worker-step [M, D, T]: the sum of `values` (per group [n, D, T];
        None leaves a group out) and how many ops it adds."""
        total = np.zeros((len(self.ids),) + self.dd.shape)
        count = np.zeros_like(total)
        for k, v in enumerate(values):
            if v is not None:
                self.reduce(k, np.add, total, v)
                self.reduce(k, np.add, count, np.ones(self.index[k].shape))
        return total, count

    def at(self, k: int, per_mb: np.ndarray) -> np.ndarray:
        """[n, D, T]: `per_mb` [M, D, T] at the microbatch each op of group `k` holds."""
        if self.same[k] is not None:
            return per_mb[self.same[k]]
        return per_mb[self.index[k], self.dd[None], self.tt[None]]


def _divided(cost: np.ndarray, free: np.ndarray, logs: dict, members: dict) -> np.ndarray:
    """`cost` with the pause-free part of each microbatch's ops divided by its factor (the
    exponential of its `logs`' mean [D, T]; `members`: its template ops), the pauses kept."""
    out = cost.copy()
    for key, rows in logs.items():
        nodes = members[key]
        factor = np.exp(np.mean(rows, axis=0))            # [D, T]
        out[nodes] -= free[nodes] - free[nodes] / factor[None]
    return out


def _attn_fit(ctx: Context, stage: int, compute: np.ndarray) -> float | None:
    """Correlation of a microbatch's fwd+bwd time with its Σ sᵢ² (both normalised per worker-step)."""
    g, trace = ctx.w.grid, ctx.trace
    if "attn_cost" not in trace.ops:
        return None
    nodes = microbatch_nodes(ctx.w, trace, stage, FWD)
    rows = g.row[nodes]
    cost = np.where(rows >= 0, trace.ops["attn_cost"][np.maximum(rows, 0)], np.nan)
    if not np.all(np.isfinite(cost)) or np.any(cost.mean(axis=0) <= 0):
        return None
    cn = cost / cost.mean(axis=0, keepdims=True)
    dn = compute / compute.mean(axis=0, keepdims=True)
    if cn.std() < ctx.cfg.seq_cv or dn.std() == 0:
        return None
    return float(np.corrcoef(cn.ravel(), dn.ravel())[0, 1])


def microbatch_rows(w: WhatIf, nodes: np.ndarray) -> np.ndarray:
    """Trace rows that say which microbatch (and model chunk) each template op is: those of its
    stage's reference replica-step, where the model read its order (a first DP rank numbering
    its microbatches otherwise paired one microbatch's ops with another's on other stages)."""
    return reference_rows(w.grid, w.model, nodes)


def microbatch_nodes(w: WhatIf, trace: Trace, stage: int, code: int) -> np.ndarray:
    """Template ops of one compute type on one stage, ordered by (model chunk, microbatch)."""
    g = w.grid
    nodes = np.flatnonzero((g.node_stage == stage) & (g.node_optype == code))
    ref = microbatch_rows(w, nodes)
    key = trace.ops["mc"][ref].astype(np.int64) * 100000 + trace.ops["mb_id"][ref]
    return nodes[np.argsort(key, kind="stable")]


def _by_microbatch(ctx: Context, stage: int, code: int):
    """Pause-free durations [microbatch, D, T] of one compute type on one stage, ordered by
    (mc, mb_id)."""
    nodes = microbatch_nodes(ctx.w, ctx.trace, stage, code)
    return ctx.pause_free[nodes] if len(nodes) else None
