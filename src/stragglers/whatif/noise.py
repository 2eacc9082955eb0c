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

import numpy as np

from stragglers.whatif.config import DiagnosisConfig
from stragglers.whatif.confidence import ratio_interval
from stragglers.whatif.grid import GC
from stragglers.whatif.metrics import WhatIf
from stragglers.whatif._replay import replay


def residuals(w: WhatIf) -> np.ndarray:
    """log(cost / the same op's median over steps on the same worker), 0 where undefined [N, D, T].

    Comparing each op with itself on the same worker keeps persistent differences out.
    """
    g = w.grid
    use = g.present & (w.cost > 0) & ~w.model.no_op[:, None, None] \
        & (g.node_optype != GC)[:, None, None]
    if g.shape[2] < 2:
        return np.zeros(w.cost.shape)
    typical = _median_over_steps(w.cost, use)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.log(w.cost / typical)
    return np.where(use & np.isfinite(out), out, 0.0)


def _median_over_steps(values: np.ndarray, use: np.ndarray) -> np.ndarray:
    """Median over the last axis of the cells where use is true ([N, D, 1]; NaN where none).

    np.nanmedian goes through masked arrays here, ten times slower on large jobs.
    """
    ordered = np.sort(np.where(use, values, np.inf), axis=2)
    count = use.sum(axis=2, keepdims=True)
    lo = np.take_along_axis(ordered, np.maximum((count - 1) // 2, 0), axis=2)
    hi = np.take_along_axis(ordered, np.minimum(count // 2, values.shape[2] - 1), axis=2)
    with np.errstate(invalid="ignore"):
        return np.where(count > 0, (lo + hi) / 2, np.nan)


def within_floor(w: WhatIf, cfg: DiagnosisConfig) -> bool:
    """Whether S is what the job's jitter alone gives: the lower end of S's interval over
    steps (the gain test's, `confidence`) at most the noise floor + `noise_margin`.

    S is a mean over the steps: from five or six steps of a noisy job it lies a few percent
    from the floor either way (noise-only dp 2-4 jobs of 5-6 steps read S 1.10-1.11 over
    floors 1.07-1.08, `unexplained`); a slowdown that no cause explains stands above the
    floor in its interval, as a finding's gain must.
    """
    s = w.slowdown
    lo = min(s, ratio_interval(w.t_nodelay, w.t_ideal, cfg)[0]) if len(w.t_nodelay) > 1 else s
    return lo <= noise_floor(w, cfg) + cfg.noise_margin


def noise_floor(w: WhatIf, cfg: DiagnosisConfig) -> float:
    """Mean S of `noise_draws` replays of ideal costs × the reshuffled measured variation."""
    key = (cfg.noise_draws, cfg.seed)
    if key not in w._floors:
        w._floors[key] = _noise_floor(w, cfg)
    return w._floors[key]


def _noise_floor(w: WhatIf, cfg: DiagnosisConfig) -> float:
    """The floor's replays (noise_floor, which keeps their answer)."""
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
