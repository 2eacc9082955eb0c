"""Replay a job on its dependency graph (docs/whatif.md §5), vectorised over DP ranks and steps."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stragglers.whatif.dependencies import DependencyModel, sync_max


# How a group's members synchronise across DP ranks: not (False), all together (True), or within
# the process groups labelled per DP rank ([D] labels).
DpSync = bool | np.ndarray


@dataclass
class ReplayPlan:
    """The model compiled for replay: per super-node, its members and their dependencies."""

    # (members, their deps, is a group, dp sync: False, True (all DP ranks) or labels [D])
    steps: list[tuple[tuple[int, ...], tuple[tuple[int, ...], ...], bool, DpSync]]
    n_nodes: int


def compile_plan(model: DependencyModel) -> ReplayPlan:
    """Turn the dependency model into a flat list of (members, deps, is_group, dp_sync)."""
    steps: list[tuple[tuple[int, ...], tuple[tuple[int, ...], ...], bool, DpSync]] = []
    for sn in model.order:
        if sn < 0:
            g = -sn - 1
            members = tuple(int(m) for m in model.groups[g])
            sync: DpSync = bool(model.group_dp_sync[g])
            parts = model.group_parts[g]
            if sync and parts is not None:
                sync = parts                         # labels: the process groups' DP ranks
            steps.append((members, tuple(tuple(sorted(set(model.deps[m]))) for m in members),
                          True, sync))
        else:
            steps.append(((int(sn),), (tuple(sorted(set(model.deps[sn]))),), False, False))
    return ReplayPlan(steps, len(model.deps))


# The most bytes one replay's end times [N, D, steps] take: a longer job is replayed a few
# steps at a time (steps are independent, so the step times are bit for bit the same) and its
# working memory is that of a step chunk, not of the job (docs/whatif.md §5).
CHUNK_BYTES = 256 * 2**20


def replay(plan: ReplayPlan, cost: np.ndarray, step_start: np.ndarray,
           launch_delay: np.ndarray | None = None, keep_timeline: bool = False,
           jobs: int = 1):
    """Replay with per-op cost (compute: duration; comm member: transfer) of shape [N, D, T].

    `cost` and `launch_delay` may broadcast along D and T (shape [N, 1, 1] for ideal costs).
    With jobs = B > 1 the D axis holds B independent jobs of D/B DP replicas each (DP
    synchronisation stays within a job): one pass replays them all.
    Returns step times [T] ([B, T] when jobs > 1), and (start, end) when keep_timeline.
    """
    d = max(cost.shape[1], launch_delay.shape[1] if launch_delay is not None else 1)
    t = len(step_start)
    per_step = plan.n_nodes * d * 8 * (2 if keep_timeline else 1)
    span = max(1, CHUNK_BYTES // max(per_step, 1))
    if t <= span:
        return _replay_steps(plan, cost, step_start, launch_delay, keep_timeline, jobs)
    times, starts, ends = [], [], []
    for lo in range(0, t, span):
        sl = slice(lo, min(lo + span, t))
        got = _replay_steps(plan, _steps_of(cost, sl, t), step_start[sl],
                            None if launch_delay is None else _steps_of(launch_delay, sl, t),
                            keep_timeline, jobs)
        if keep_timeline:
            got, start, end = got
            starts.append(start)
            ends.append(end)
        times.append(got)
    out = np.concatenate(times, axis=-1)
    if keep_timeline:
        return out, np.concatenate(starts, axis=2), np.concatenate(ends, axis=2)
    return out


def _steps_of(values: np.ndarray, sl: slice, t: int) -> np.ndarray:
    """The steps `sl` of a [N, D|1, T|1] array (one broadcast along steps stays as it is)."""
    return values[:, :, sl] if values.shape[2] == t else values


def _replay_steps(plan: ReplayPlan, cost: np.ndarray, step_start: np.ndarray,
                  launch_delay: np.ndarray | None, keep_timeline: bool, jobs: int):
    """replay() of steps whose end times are held at once."""
    n = plan.n_nodes
    d = max(cost.shape[1], launch_delay.shape[1] if launch_delay is not None else 1)
    t = len(step_start)
    end = np.empty((n, d, t))
    start = np.empty((n, d, t)) if keep_timeline else None
    base = np.broadcast_to(step_start, (d, t))
    cost = np.broadcast_to(cost, (n, d, t)) if cost.shape[1:] != (d, t) else cost
    scratch = np.empty((d, t))

    def ready(m: int, dep: tuple[int, ...], out: np.ndarray) -> np.ndarray:
        """Start of op m: the latest end of its dependencies (plus its launch delay)."""
        if not dep:
            np.copyto(out, base)
        elif len(dep) == 1:
            np.copyto(out, end[dep[0]])
        else:
            np.maximum(end[dep[0]], end[dep[1]], out=out)
            for x in dep[2:]:
                np.maximum(out, end[x], out=out)
        if launch_delay is not None:
            out += launch_delay[m]
        if start is not None:
            start[m] = out
        return out

    for members, deps, is_group, dp_sync in plan.steps:
        if not is_group:
            m = members[0]
            np.add(ready(m, deps[0], scratch), cost[m], out=end[m])
            continue
        g = ready(members[0], deps[0], np.empty((d, t)))
        for m, dep in zip(members[1:], deps[1:]):
            np.maximum(g, ready(m, dep, scratch), out=g)
        if dp_sync is True or (dp_sync is not False and jobs > 1):
            if jobs == 1:
                g = g.max(axis=0, keepdims=True)
            else:   # each job syncs within itself (a pair of replicas: no process groups)
                g = np.repeat(g.reshape(jobs, -1, t).max(axis=1), d // jobs, axis=0)
        elif isinstance(dp_sync, np.ndarray):
            g = sync_max(g, dp_sync)
        for m in members:
            np.add(g, cost[m], out=end[m])
    if jobs == 1:
        step_time = end.max(axis=(0, 1)) - step_start
    else:
        step_time = end.reshape(n, jobs, d // jobs, t).max(axis=(0, 2)) - step_start
    if keep_timeline:
        return step_time, start, end
    return step_time

