"""The noise floor of S: what i.i.d. op-to-op jitter of the measured size alone would give.

Every op varies a little from step to step; with many workers meeting at collectives the
slowest of them sets the pace, so even a healthy job has S a little above 1 — more with many
DP ranks and few microbatches. Replaying ideal costs with jitter of the measured size tells
how much, so such a job is not reported as straggling for an unexplained reason.
"""

from __future__ import annotations

import numpy as np

from stragglers.whatif.config import DiagnosisConfig
from stragglers.whatif.confidence import MAD_TO_SIGMA
from stragglers.whatif.grid import GC
from stragglers.whatif.metrics import WhatIf
from stragglers.whatif.replay import replay


def jitter_sigma(w: WhatIf) -> dict[int, float]:
    """Robust σ of log(cost / the same op's median over steps on the same worker), per op type.

    Comparing each op with itself on the same worker keeps persistent differences (a slow
    worker, a heavy stage) out of the jitter.
    """
    g = w.grid
    out = {}
    steps = g.shape[2]
    if steps < 2:
        return out
    for code in np.unique(g.node_optype):
        if code == GC:
            continue
        nodes = (g.node_optype == code) & ~w.model.no_op
        cost = w.cost[nodes]
        ok = g.present[nodes] & (cost > 0)
        if ok.sum() < 4:
            continue
        typical = np.median(np.where(ok, cost, np.nan), axis=2, keepdims=True)
        with np.errstate(invalid="ignore", divide="ignore"):
            resid = np.log(cost / typical)[ok & np.isfinite(typical)]
        resid = resid[np.isfinite(resid)]
        if len(resid) < 4:
            continue
        mad = float(np.median(np.abs(resid - np.median(resid))))
        # a residual against the median of `steps` values is smaller than the op's own spread
        out[int(code)] = MAD_TO_SIGMA * mad * float(np.sqrt(steps / max(steps - 1, 1)))
    return out


def noise_floor(w: WhatIf, cfg: DiagnosisConfig) -> float:
    """Mean S of `noise_draws` replays of ideal costs × lognormal jitter of the measured σ."""
    sigma = jitter_sigma(w)
    g = w.grid
    per_node = np.array([sigma.get(int(c), 0.0) for c in g.node_optype])[:, None, None]
    rng = np.random.default_rng(cfg.seed + 1)
    ideal = np.broadcast_to(w.ideal, w.cost.shape)
    t_ideal = float(w.t_ideal.mean())
    values = []
    for _ in range(cfg.noise_draws):
        jitter = np.exp(per_node * rng.standard_normal(w.cost.shape))
        values.append(float(replay(w.plan, ideal * jitter, w.step_start).mean()) / t_ideal)
    return float(np.mean(values))
