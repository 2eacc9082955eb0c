"""Stage partitioning imbalance: some pipeline stages hold more work than others on every DP rank."""

from __future__ import annotations

import numpy as np

from stragglers.whatif.causes.base import Candidate, Context, per_worker_sum
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
    # The rebalanced pipeline: every stage's forward/backward scaled to the mean stage's work
    # (what moving layers achieves at best; suggest_stage_split finds the layer split).
    scale = cs.mean() / np.maximum(cs.mean(axis=1), 1e-12)
    cost = w.cost.copy()
    fb = np.isin(g.node_optype, (FWD, BWD, BWW))
    for p in range(g.pp_size):
        cost[fb & (g.node_stage == p)] *= scale[p]
    shares = ", ".join(f"{100 * v / cs.mean(axis=1).sum():.0f}%" for v in cs.mean(axis=1))
    evidence = (f"stage {hot} computes {100 * mean[hot]:.0f}% ({100 * lo[hot]:.0f}–"
                f"{100 * hi[hot]:.0f}%) more per step than the mean stage on every DP rank "
                f"(shares of the work by stage: {shares}); the prediction rebalances every "
                f"stage to the mean")
    if len(g.dp_ranks) == 1:
        evidence += ("; with one DP rank a slow worker and a heavy stage look the same: check "
                     f"the worker of stage {hot} too")
    # With one DP rank the heavy stage is one worker: name it (rank, host) too.
    where = ctx.where_workers([(0, p) for p in heavy]) if len(g.dp_ranks) == 1 else \
        Where(pp=[int(p) for p in heavy])
    return [Candidate("stage_imbalance", where, evidence, cost=cost, upper_bound=True)]
