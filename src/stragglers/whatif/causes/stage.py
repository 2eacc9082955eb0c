"""Stage partitioning imbalance: some pipeline stages hold more work than others on every DP rank."""

from __future__ import annotations

import numpy as np

from stragglers.whatif.causes.base import BUSY, Candidate, Context, per_worker_sum
from stragglers.whatif.causes.capacity import group_factors
from stragglers.whatif.confidence import mean_interval
from stragglers.whatif.grid import BWD, BWW, FWD
from stragglers.whatif.result import Where


def stage_compute(ctx: Context) -> np.ndarray:
    """Typical forward+backward compute per step of each stage [P, T].

    The typical worker: the median over DP ranks (the faster of two), so one slow worker does
    not make its stage look heavy. Without the GC pauses found inside compute: they are the
    collector's time, not the stage's work (with one DP rank, pauses ×1.5 spread the stages'
    shares step by step until a stage ×1.7 heavy was no candidate, --wide --no-seq-lens seed
    28 job 70).
    """
    g = ctx.w.grid
    compute = np.isin(g.node_optype, (FWD, BWD, BWW))
    fb = per_worker_sum(ctx.pause_free, g.node_stage, compute, g.pp_size)
    return fb.min(axis=0) if fb.shape[0] == 2 else np.median(fb, axis=0)


def stage_imbalance(ctx: Context) -> list[Candidate]:
    """The heaviest stage computes more than the mean stage; the fix rebalances every stage."""
    w, g, cfg = ctx.w, ctx.w.grid, ctx.cfg
    if g.pp_size < 2:
        return []
    cs = stage_compute(ctx)                                     # [P, T]
    excess = cs / cs.mean(axis=0, keepdims=True) - 1
    mean = excess.mean(axis=-1)
    lo, hi = mean_interval(excess, cfg)
    hot = int(np.argmax(mean))
    if lo[hot] < cfg.stage_min_excess:
        return []
    heavy = [int(p) for p in np.flatnonzero(lo >= cfg.stage_min_excess)]
    cost = rebalanced_costs(ctx, cs.mean(axis=1))
    shares = ", ".join(f"{100 * v / cs.mean(axis=1).sum():.0f}%" for v in cs.mean(axis=1))
    evidence = (f"stage {hot} computes {100 * mean[hot]:.0f}% ({100 * lo[hot]:.0f}–"
                f"{100 * hi[hot]:.0f}%) more per step than the mean stage on every DP rank "
                f"(shares of the work by stage: {shares}); the prediction moves work from "
                f"the heavier stages to the lighter ones until each computes the mean stage's")
    if len(g.dp_ranks) == 1:
        evidence += ("; with one DP rank a slow worker and a heavy stage look the same: check "
                     f"the worker of stage {hot} too")
    else:
        evidence += _slow_devices_too(ctx, hot, cs.mean(axis=1))
    # With one DP rank the heavy stage is one worker: name it (rank, host) too.
    where = ctx.where_workers([(0, p) for p in heavy]) if len(g.dp_ranks) == 1 else \
        Where(pp=[int(p) for p in heavy])
    return [Candidate("stage_imbalance", where, evidence, cost=cost, upper_bound=True)]


def _slow_devices_too(ctx: Context, hot: int, typical: np.ndarray) -> str:
    """The other reading of a heavy stage, in words: its workers all as slow as one another.

    A trace cannot tell them apart: every op of a stage holding more layers and of a stage on
    devices slower alike lasts longer by the same factor, and no worker of the stage is fast
    to compare with (a slow group holding every worker of a stage reads as a heavy stage).
    Where a slow group stands on other stages, its factor says how slow such devices are.
    """
    others = np.delete(typical, hot)
    ratio = float(typical[hot] / max(float(np.median(others)), 1e-12)) if len(others) else 1.0
    text = (f"; the same trace comes from a stage of devices slower alike (stage {hot} computes "
            f"{ratio:.2f}× the other stages' median and has no fast worker to compare with): "
            "where its layers are no heavier than the others', its devices are slow")
    factors = group_factors(ctx)
    if factors:
        stages = ", ".join(str(p) for p in sorted(factors))
        shown = ", ".join(f"{factors[p]:.2f}×" for p in sorted(factors))
        text += (f", as the slow group found on stage{'s' if len(factors) > 1 else ''} {stages} "
                 f"is ({shown} its stage's fast workers)")
    elif ratio > 1:
        # no group: a lone worker of another stage slowed alike may be the rest of it (a slow
        # node holding all of this stage and one worker of another reads as a heavy stage
        # and a worker fault)
        alike = _slowed_alike(ctx, hot, ratio)
        if alike:
            shown = ", ".join(f"{ctx.name(d, p)} {v:.2f}×" for d, p, v in alike[:4])
            text += (f", as slow as {'a worker' if len(alike) == 1 else 'workers'} of another "
                     f"stage against {'its' if len(alike) == 1 else 'their'} peers ({shown})")
    return text


def _slowed_alike(ctx: Context, hot: int, ratio: float) -> list[tuple[int, int, float]]:
    """(dp index, stage, level) of the workers of other stages whose typical busy compute over
    their stage's median worker (median over steps) lies within half of `ratio`'s log of it."""
    g = ctx.w.grid
    if len(g.dp_ranks) < 2:
        return []
    busy = per_worker_sum(ctx.own_durations, g.node_stage, np.isin(g.node_optype, BUSY),
                          g.pp_size)                                          # [D, P, T]
    level = np.median(busy / np.maximum(np.median(busy, axis=0, keepdims=True), 1e-12),
                      axis=2)                                                 # [D, P]
    near = np.abs(np.log(np.maximum(level, 1e-12)) - np.log(ratio)) <= np.log(ratio) / 2
    near[:, hot] = False
    return sorted(((int(d), int(p), float(level[d, p])) for d, p in zip(*np.nonzero(near))),
                  key=lambda x: -x[2])


def rebalanced_costs(ctx: Context, typical: np.ndarray) -> np.ndarray:
    """Costs with work moved from heavier to lighter stages until each computes the mean stage's.

    What moving layers achieves at best (suggest_stage_split finds the layer split): a heavier
    stage keeps its share of its own ops' time, step by step; a lighter stage keeps all of its
    own and gains a part of the heavier stages' time: each of its forward/backward ops that of
    the same kind and microbatch on the heavier stage (the moved layers carry that microbatch's
    load: sequence-imbalanced microbatches stay uneven), or, where the stages' ops do not pair
    up, a part of the heavier stages' time in that step spread over its ops by their typical
    shares. The moved work is added, not the light stage's own ops scaled up: scaling a stage
    ×4 made a load spike of its ops four times as long (a pp 2 run beside CPU hogs predicted
    two of 15 steps twice as slow after the fix). It is moved at the devices' speeds: the
    giver's time over its typical speed against its stage's peers, times the receiver's (a
    slow worker's layers run at the healthy device's speed once moved onto it: carried at the
    slow one's, they made its DP rank's light stage the straggler once the slow worker was
    fixed too, and a heavy stage ×1.8 beside a slow worker ×2.4 on it was dropped, ×0.95 after
    that fix; combinations seed 32 jobs 308, 448). The work moved and the devices' speeds are
    read from `ctx.cost`: a worker's computes left out of the ideal (timed shorter than its
    work) at its stage peers' (read as stated, its stage's typical speed was its own: the
    honest peer ×3 slow, taking a third of the work moved, ×1.25 predicted for ×1.19).
    """
    w, g = ctx.w, ctx.w.grid
    measured = ctx.cost
    fb = np.isin(g.node_optype, (FWD, BWD, BWW))
    stages = np.arange(g.pp_size)
    receives = np.array([bool((fb & (g.node_stage == p)).any()) for p in stages])
    target = typical[receives].mean() if receives.any() else typical.mean()
    give = np.maximum(typical - target, 0.0)
    need = np.where(receives, np.maximum(target - typical, 0.0), 0.0)
    keep = np.where(give > 0, target / np.maximum(typical, 1e-12), 1.0)
    cost = w.cost.copy()
    if need.sum() <= 0:
        return cost
    # flow[p, q]: the fraction of stage q's work per step that stage p takes over
    flow = np.outer(need / need.sum(), give / np.maximum(typical, 1e-12))
    work = per_worker_sum(measured, g.node_stage, fb, g.pp_size)             # [D, P, T]
    speed = _typical_speed(work)                                              # [D, P]
    ops = {int(p): _ops_by_kind(g, fb & (g.node_stage == p)) for p in stages}
    for p in stages:
        sel = fb & (g.node_stage == p)
        if not sel.any():
            continue
        cost[sel] *= keep[p]
        weight = None   # each op's typical share of its stage's work, once a stage needs it
        for q in np.flatnonzero(flow[p] > 0):
            mine, theirs = ops[int(p)], ops[int(q)]
            pace = (speed[:, p] / speed[:, q])[None, :, None]                 # [1, D, 1]
            if mine.keys() == theirs.keys():
                idx = list(mine)
                cost[[mine[k] for k in idx]] += flow[p, q] * pace * measured[
                    [theirs[k] for k in idx]]
                continue
            if weight is None:
                # (median over steps, where it ran)
                weight = np.median(measured[sel], axis=2)[:, :, None] * g.present[sel]
                total = weight.sum(axis=0, keepdims=True)
                np.divide(weight, total, out=weight, where=total > 0)
            cost[sel] += weight * (flow[p, q] * pace * work[None, :, q, :])
    return cost


def _typical_speed(work: np.ndarray) -> np.ndarray:
    """[D, P] each worker's time per unit of its stage's work: the median over steps of its
    compute ([D, P, T]) over the stage's typical worker's (the faster of two, as
    `stage_compute`); a step's own load (its sequences) stays in the ops moved."""
    ref = work.min(axis=0) if work.shape[0] == 2 else np.median(work, axis=0)   # [P, T]
    rel = work / np.maximum(ref, 1e-12)[None]
    out = np.median(np.where(ref[None] > 0, rel, np.nan), axis=2)
    return np.where(np.isfinite(out) & (out > 0), out, 1.0)


def _ops_by_kind(g, sel: np.ndarray) -> dict[tuple[int, int, int], int]:
    """The selected nodes by (op type, microbatch, model chunk): a stage's ops that pair up
    with another stage's."""
    return {(int(g.node_optype[n]), int(g.node_seq[n]), int(g.node_mc[n])): int(n)
            for n in np.flatnonzero(sel)}
