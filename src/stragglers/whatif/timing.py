"""Measured quantities: transfer/blocking split, launch delays, measured step times (spec §4)."""

from __future__ import annotations

import numpy as np

from stragglers.whatif.dependencies import DependencyModel
from stragglers.whatif.grid import OpGrid


def measured_costs(grid: OpGrid, model: DependencyModel) -> np.ndarray:
    """Per-op cost: duration for plain ops, transfer = end − max start over the group for comm."""
    cost = grid.duration.copy()
    end = grid.start + grid.duration
    for members, sync in zip(model.groups, model.group_dp_sync):
        g = np.max(grid.start[members], axis=0)
        if sync:
            g = g.max(axis=0, keepdims=True)
        # The member that arrived last waited for nobody; a small negative is clock error.
        cost[members] = np.maximum(end[members] - g, 0.0)
    cost[model.no_op] = 0.0  # recorded but never launched: zero transfer time (spec §3)
    return cost


def step_starts(grid: OpGrid) -> np.ndarray:
    """Measured start of each step: the earliest op of any worker."""
    return np.nanmin(grid.start, axis=(0, 1))


def base_step_times(grid: OpGrid) -> np.ndarray:
    """T_base per step: last end − first start over all workers."""
    end = np.where(grid.present, grid.start + grid.duration, -np.inf)
    return end.max(axis=(0, 1)) - step_starts(grid)


def launch_delays(grid: OpGrid, model: DependencyModel) -> np.ndarray:
    """start − max(end of dependencies) (or − step start), clamped at 0; absent ops get 0.

    Absent ops (a gc slot without a pause on this worker) are placed at the end of their
    dependencies with zero duration, in dependency order, so their successors see them.
    """
    start = grid.start.copy()
    end = start + grid.duration
    first = step_starts(grid)
    delay = np.zeros_like(start)
    for sn in model.order:
        members = model.groups[-sn - 1] if sn < 0 else [sn]
        for m in members:
            dep = model.deps[m]
            ready = end[dep].max(axis=0) if dep else np.broadcast_to(first, start.shape[1:])
            absent = ~grid.present[m]
            if absent.any():
                start[m][absent] = ready[absent]
                end[m][absent] = ready[absent]
            delay[m] = np.maximum(start[m] - ready, 0.0)
    return delay
