"""Replay a job on its dependency graph (specs/whatif.md §5), vectorised over DP ranks and steps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stragglers.whatif.dependencies import DependencyModel


@dataclass
class ReplayPlan:
    """The model compiled for replay: per super-node, its members and their dependency arrays."""

    steps: list[tuple[np.ndarray, list[np.ndarray], bool, bool]]  # (members, deps, is_group, dp_sync)
    n_nodes: int


def compile_plan(model: DependencyModel) -> ReplayPlan:
    """Turn the dependency model into a flat list of replay steps."""
    steps = []
    for sn in model.order:
        if sn < 0:
            g = -sn - 1
            members = np.asarray(model.groups[g], dtype=np.int64)
            steps.append((members, [np.asarray(model.deps[m], dtype=np.int64) for m in members],
                          True, model.group_dp_sync[g]))
        else:
            steps.append((np.asarray([sn], dtype=np.int64), [np.asarray(model.deps[sn], np.int64)],
                          False, False))
    return ReplayPlan(steps, len(model.deps))


def replay(plan: ReplayPlan, cost: np.ndarray, step_start: np.ndarray,
           launch_delay: np.ndarray | None = None, keep_timeline: bool = False,
           jobs: int = 1):
    """Replay with per-op cost (compute: duration; comm member: transfer) of shape [N, D, T].

    `cost` and `launch_delay` may broadcast along D and T (shape [N, 1, 1] for ideal costs).
    With jobs = B > 1 the D axis holds B independent jobs of D/B DP replicas each (DP
    synchronisation stays within a job): one pass replays them all.
    Returns step times [T] ([B, T] when jobs > 1), and (start, end) when keep_timeline.
    """
    n = plan.n_nodes
    d = max(cost.shape[1], launch_delay.shape[1] if launch_delay is not None else 1)
    t = len(step_start)
    start = np.empty((n, d, t))
    end = np.empty((n, d, t))
    base = np.broadcast_to(step_start, (d, t))
    for members, deps, is_group, dp_sync in plan.steps:
        for m, dep in zip(members, deps):
            if len(dep) == 0:
                s = base
            elif len(dep) == 1:
                s = end[dep[0]]
            else:
                s = end[dep].max(axis=0)
            if launch_delay is not None:
                s = s + launch_delay[m]
            start[m] = s
        if is_group:
            if len(members) == 1:
                g = start[members[0]]
            else:
                g = start[members].max(axis=0)
            if dp_sync:
                if jobs == 1:
                    g = g.max(axis=0, keepdims=True)
                else:
                    g = np.repeat(g.reshape(jobs, -1, t).max(axis=1), d // jobs, axis=0)
            end[members] = g + cost[members]
        else:
            m = members[0]
            end[m] = start[m] + cost[m]
    if jobs == 1:
        step_time = end.max(axis=(0, 1)) - step_start
    else:
        step_time = end.reshape(n, jobs, d // jobs, t).max(axis=(0, 2)) - step_start
    if keep_timeline:
        return step_time, start, end
    return step_time
