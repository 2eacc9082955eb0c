"""Warm-up steps (allocation, compilation, cold caches): found from the measured step times."""

from __future__ import annotations

import math

import numpy as np

from stragglers.whatif.config import DiagnosisConfig
from stragglers.whatif.grid import OpGrid
from stragglers.whatif.timing import base_step_times


def warmup_steps(grid: OpGrid, cfg: DiagnosisConfig) -> list[int]:
    """Leading steps slower than warmup_factor × the median of the later steps.

    Only a run of steps at the start counts (warm-up happens once), at most
    warmup_max_fraction of the steps, and two steps are always kept.
    """
    t = base_step_times(grid)
    n = len(t)
    limit = min(int(math.floor(cfg.warmup_max_fraction * n)), n - 2)
    dropped = 0
    while dropped < limit:
        rest = float(np.median(t[dropped + 1:]))
        if not t[dropped] > cfg.warmup_factor * rest:
            break
        dropped += 1
    return [int(s) for s in grid.steps[:dropped]]
