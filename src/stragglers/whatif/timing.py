"""Measured quantities: transfer/blocking split, launch delays, measured step times (docs/whatif.md §4)."""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import OPTYPE_CODES, P2P_OPTYPES
from stragglers.whatif.dependencies import DependencyModel, sync_max
from stragglers.whatif.grid import OpGrid

P2P_CODES = [OPTYPE_CODES[o] for o in P2P_OPTYPES]


# Rows of one batched p2p call (batch_isend_irecv) share their start and end: the same timer
# values (exactly equal in NDTimeline traces); 1 ns leaves room for unit conversions only.
BATCH_EPS = 1e-9


def measured_costs(grid: OpGrid, model: DependencyModel) -> np.ndarray:
    """Per-op cost: duration for plain ops, transfer = end − max start over the group for comm.

    p2p rows of one batched call (same worker, same start and end) complete together, so
    waiting for any of their peers shows in all of them: their transfer is measured per call,
    from the latest start over all the call's groups.
    """
    cost = grid.duration.copy()
    # the group starts of the grouped rows only, ends computed a few rows at a time: on a big
    # job each of these arrays is a grid's size (10⁸ ops: 0.8 GB)
    grouped = np.flatnonzero(model.group_of >= 0)
    at = np.full(len(cost), -1, dtype=np.int64)
    at[grouped] = np.arange(len(grouped))
    group_start = np.full((len(grouped),) + grid.start.shape[1:], np.nan)
    for members, sync, parts in zip(model.groups, model.group_dp_sync, model.group_parts):
        g = np.max(grid.start[members], axis=0)
        if sync:
            g = sync_max(g, parts)
        group_start[at[members]] = g
    np.copyto(group_start, grid.start[grouped], where=np.isnan(group_start))
    _per_call(grid, model, at, group_start)
    # The member that arrived last waited for nobody; a small negative is clock error.
    for lo in range(0, len(grouped), _ROWS_AT_ONCE):
        rows = grouped[lo:lo + _ROWS_AT_ONCE]
        end = grid.start[rows] + grid.duration[rows]
        cost[rows] = np.maximum(end - group_start[lo:lo + _ROWS_AT_ONCE], 0.0)
    cost[model.no_op] = 0.0  # recorded but never launched: zero transfer time (docs/whatif.md §3)
    return cost


# Grid rows whose temporaries measured_costs and base_step_times hold at once.
_ROWS_AT_ONCE = 64


def _batched_somewhere(grid: OpGrid, nodes: np.ndarray, end: np.ndarray) -> bool:
    """Whether two of these p2p ops (`end`: their ends, [k, D, T]) share start and end on the
    first DP rank (a batched call).

    Batching is the schedule's, the same code on every rank: one DP rank tells, which keeps
    traces without batching from paying for the per-call pass.
    """
    present = grid.present[nodes, :1]
    start = np.where(present, grid.start[nodes, :1], np.inf)
    stop = np.where(present, end[:, :1], np.inf)
    order = np.argsort(start, axis=0, kind="stable")
    s = np.take_along_axis(start, order, axis=0)
    e = np.take_along_axis(stop, order, axis=0)
    with np.errstate(invalid="ignore"):
        same = (np.abs(np.diff(s, axis=0)) <= BATCH_EPS) & (np.abs(np.diff(e, axis=0)) <= BATCH_EPS)
    return bool(same.any())


def _per_call(grid: OpGrid, model: DependencyModel, at: np.ndarray,
              group_start: np.ndarray) -> None:
    """Raise each batched p2p row's group start to the latest over its call (in place;
    `group_start` holds the grouped rows, row n at at[n])."""
    p2p = np.isin(grid.node_optype, P2P_CODES) & ~model.no_op & (model.group_of >= 0)
    for stage in range(grid.pp_size):
        nodes = np.flatnonzero(p2p & (grid.node_stage == stage))
        if len(nodes) < 2:
            continue
        end = grid.start[nodes] + grid.duration[nodes]
        if not _batched_somewhere(grid, nodes, end):
            continue
        start = np.where(grid.present[nodes], grid.start[nodes], np.inf)
        order = np.argsort(start, axis=0, kind="stable")                  # [k, D, T]
        s = np.take_along_axis(start, order, axis=0)
        e = np.take_along_axis(np.where(grid.present[nodes], end, np.inf), order, axis=0)
        g = np.take_along_axis(group_start[at[nodes]], order, axis=0)
        same = (np.abs(np.diff(s, axis=0)) <= BATCH_EPS) & (np.abs(np.diff(e, axis=0)) <= BATCH_EPS)
        if not same.any():
            continue
        run = g.copy()
        for i in range(1, len(nodes)):                 # running max within each call ...
            run[i] = np.where(same[i - 1], np.maximum(run[i - 1], g[i]), g[i])
        for i in range(len(nodes) - 2, -1, -1):        # ... and the call's max back to all rows
            run[i] = np.where(same[i], run[i + 1], run[i])
        out = np.empty_like(run)
        np.put_along_axis(out, order, run, axis=0)
        group_start[at[nodes]] = np.where(grid.present[nodes], out, group_start[at[nodes]])


def step_starts(grid: OpGrid) -> np.ndarray:
    """Measured start of each step: the earliest op of any worker."""
    return np.nanmin(grid.start, axis=(0, 1))


def base_step_times(grid: OpGrid) -> np.ndarray:
    """T_base per step: last end − first start over all workers."""
    last = np.full(grid.start.shape[2], -np.inf)
    for lo in range(0, len(grid.start), _ROWS_AT_ONCE):   # a few rows at a time: no grid copy
        rows = slice(lo, lo + _ROWS_AT_ONCE)
        end = np.where(grid.present[rows], grid.start[rows] + grid.duration[rows], -np.inf)
        np.maximum(last, end.max(axis=(0, 1)), out=last)
    return last - step_starts(grid)


def launch_delays(grid: OpGrid, model: DependencyModel) -> np.ndarray:
    """start − max(end of dependencies) (or − step start), clamped at 0; absent ops get 0.

    Absent ops (a gc slot without a pause on this worker) are placed at the end of their
    dependencies with zero duration, in dependency order, so their successors see them.
    """
    end = grid.start + grid.duration
    first = step_starts(grid)
    delay = np.zeros_like(end)
    for sn in model.order:
        members = model.groups[-sn - 1] if sn < 0 else [sn]
        for m in members:
            dep = model.deps[m]
            ready = end[dep].max(axis=0) if dep else np.broadcast_to(first, end.shape[1:])
            absent = ~grid.present[m]
            start = grid.start[m]
            if absent.any():
                # an op's own row only: a copy of the grid's starts would be the job's size
                start = np.where(absent, ready, start)
                end[m][absent] = ready[absent]
            delay[m] = np.maximum(start - ready, 0.0)
    return delay
