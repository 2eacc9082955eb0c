"""The controller's arithmetic (docs/adaptive.md §4): batch split, integer rounding, accumulation, restart gain."""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from stragglers.errors import InputError


def optimal_step_time(global_batch: int, throughputs: Sequence[float],
                      overheads: Sequence[float] | None = None) -> float:
    """T* = (B + sum c_i v_i) / sum v_i: the smallest step time any split can reach."""
    v = _check_throughputs(throughputs)
    c = list(overheads) if overheads is not None else [0.0] * len(v)
    return (global_batch + sum(ci * vi for ci, vi in zip(c, v))) / sum(v)


def split_batch(global_batch: int, throughputs: Sequence[float],
                overheads: Sequence[float] | None = None) -> list[int]:
    """Integer per-worker batches minimising max_i(b_i/v_i + c_i) with sum b_i = B exactly.

    The real solution b_i = v_i (T* - c_i) is water-filled (a worker whose overhead alone exceeds
    T* gets 0 and T* is recomputed without it), then rounded by largest remainder.
    """
    v = _check_throughputs(throughputs)
    if global_batch < 0:
        raise InputError("policy", "global_batch", f"expected >= 0, got {global_batch}")
    c = [0.0] * len(v) if overheads is None else [max(0.0, float(x)) for x in overheads]
    if len(c) != len(v):
        raise InputError("policy", "overheads", f"expected {len(v)} values, got {len(c)}")
    # (sets and a heap: with lists and a scan per unit a 16,384-rank split took 188 s, on the
    # service's event loop)
    active = [i for i in range(len(v)) if v[i] > 0]
    while True:
        t_star = (global_batch + sum(c[i] * v[i] for i in active)) / sum(v[i] for i in active)
        drop = {i for i in active if c[i] >= t_star}
        if not drop or len(drop) == len(active):
            break
        active = [i for i in active if i not in drop]
    kept = set(active)
    real = [v[i] * max(0.0, t_star - c[i]) if i in kept else 0.0 for i in range(len(v))]
    scale = global_batch / sum(real) if sum(real) > 0 else 0.0
    sizes = [int(math.floor(x * scale)) for x in real]
    # Hand out the remaining units one at a time to the worker that finishes them soonest:
    # this rounding minimises the step time max_i(b_i/v_i + c_i), unlike largest remainder.
    # (ties to the lowest rank; only the chosen worker's time changes)
    soonest = [((sizes[i] + 1) / v[i] + c[i], i) for i in active]
    heapq.heapify(soonest)
    for _ in range(global_batch - sum(sizes)):
        _, j = heapq.heappop(soonest)
        sizes[j] += 1
        heapq.heappush(soonest, ((sizes[j] + 1) / v[j] + c[j], j))
    return sizes


def round_preserving_sum(values: Sequence[float], total: int) -> list[int]:
    """Round non-negative reals to integers summing to `total` (largest remainder)."""
    floors = [int(math.floor(x)) for x in values]
    rest = total - sum(floors)
    order = sorted(range(len(values)), key=lambda i: (floors[i] - values[i], i))
    for i in order[:max(0, rest)]:
        floors[i] += 1
    return floors


def micro_batches(batch: int, memory_cap: int | None) -> list[int]:
    """Split a worker's batch into k = ceil(b / M) accumulation micro-batches, as even as possible."""
    if batch <= 0:
        return []
    if memory_cap is None:
        return [batch]
    if memory_cap < 1:
        raise InputError("policy", "memory_cap", f"expected >= 1 sample, got {memory_cap}")
    k = math.ceil(batch / memory_cap)
    return [batch // k + (1 if j < batch % k else 0) for j in range(k)]


def loss_scale(world_size: int, local_batch: int, global_batch: int) -> float:
    """Factor for a local *mean* loss when gradients are averaged over ranks: n·b_i / B."""
    return world_size * local_batch / global_batch


def restart_gain(bpt_straggler: float, bpt_median: float, remaining_steps: int) -> float:
    """Seconds KILL_RESTART would save: (BPT_i - BPT_median) x remaining steps."""
    return max(0.0, bpt_straggler - bpt_median) * max(0, remaining_steps)


def _check_throughputs(throughputs: Sequence[float]) -> list[float]:
    v = [float(x) for x in throughputs]
    if not v:
        raise InputError("policy", "throughputs", "expected at least one worker")
    if any(not math.isfinite(x) or x < 0 for x in v) or sum(v) <= 0:
        raise InputError("policy", "throughputs", f"expected finite values >= 0, sum > 0; got {v}")
    return v
