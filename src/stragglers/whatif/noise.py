"""The noise floor of S: what the job's own op-to-op variation alone would give.

Every op varies from step to step; with many workers meeting at collectives the slowest of
them sets the pace, so even a healthy job has S above 1 — more with many DP ranks and few
microbatches, and much more on a loaded machine, where a rank is slowed for a while now and
then. The floor replays ideal costs with the job's measured variation reshuffled: each
worker-step keeps its residuals together (a load spike that slows a rank for a step stays one
spike) but lands on a random worker and step, so anything that persists on a worker (a fault)
or a stage (an imbalance) is gone. S at or below the floor is noise, whatever its size.
"""

from __future__ import annotations

import warnings

import numpy as np

from stragglers.whatif.config import DiagnosisConfig
from stragglers.whatif.grid import GC
from stragglers.whatif.metrics import WhatIf
from stragglers.whatif.replay import replay


def residuals(w: WhatIf) -> np.ndarray:
    """log(cost / the same op's median over steps on the same worker), 0 where undefined [N, D, T].

    Comparing each op with itself on the same worker keeps persistent differences out.
    """
    g = w.grid
    use = g.present & (w.cost > 0) & ~w.model.no_op[:, None, None] \
        & (g.node_optype != GC)[:, None, None]
    if g.shape[2] < 2:
        return np.zeros(w.cost.shape)
    cost = np.where(use, w.cost, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)   # all-NaN rows: ops never measured
        typical = np.nanmedian(cost, axis=2, keepdims=True)
        out = np.log(cost / typical)
    return np.where(np.isfinite(out), out, 0.0)


def noise_floor(w: WhatIf, cfg: DiagnosisConfig) -> float:
    """Mean S of `noise_draws` replays of ideal costs × the reshuffled measured variation."""
    g = w.grid
    resid = residuals(w)
    n, d, t = resid.shape
    rng = np.random.default_rng(cfg.seed + 1)
    ideal = np.broadcast_to(w.ideal, w.cost.shape)
    t_ideal = float(w.t_ideal.mean())
    values = []
    for _ in range(cfg.noise_draws):
        factor = np.empty_like(resid)
        for p in range(g.pp_size):
            nodes = np.flatnonzero(g.node_stage == p)
            perm = rng.permutation(d * t)
            factor[nodes] = np.exp(resid[nodes].reshape(len(nodes), d * t)[:, perm]
                                   ).reshape(len(nodes), d, t)
        # the same mean cost per op: only the variation moves, not the amount of work
        factor /= factor.mean(axis=(1, 2), keepdims=True)
        values.append(float(replay(w.plan, ideal * factor, w.step_start).mean()) / t_ideal)
    return float(np.mean(values))
