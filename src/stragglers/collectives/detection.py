"""Online straggler detection: who arrived last at each collective, and who does so persistently.

Pure Python (no torch): fed the same numbers on every rank, it takes the same decision on
every rank — the property the DDP hook relies on to never deadlock.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Sequence

from stragglers.errors import InputError


@dataclass(frozen=True)
class Arrival:
    """One observation: the rank that arrived last and its lead over the second-last (s)."""

    last: int
    lead: float


def last_arrival(time_in_collective: Sequence[float]) -> Arrival:
    """The last rank to arrive is the one that spent the least time inside the collective.

    Every rank leaves at about the same moment (nobody finishes before the last input is in),
    so time-in-collective is arrival order reversed, and needs no synchronised clocks.
    Ties go to the lowest rank so that all ranks agree.
    """
    if len(time_in_collective) < 2:
        raise InputError("straggler detection", "time_in_collective", "need one value per rank for >= 2 ranks")
    order = sorted(range(len(time_in_collective)), key=lambda r: (time_in_collective[r], r))
    return Arrival(order[0], float(time_in_collective[order[1]] - time_in_collective[order[0]]))


class StragglerDetector:
    """A rank last in at least `threshold` of the last `window` collectives is the persistent
    straggler, provided its median lead is at least `min_lead_s` (else StragglAR cannot win)."""

    def __init__(self, world_size: int, window: int = 8, threshold: float = 0.6, min_lead_s: float = 0.0):
        if world_size < 2:
            raise InputError("StragglerDetector", "world_size", f"need >= 2 ranks, got {world_size}")
        if window < 1:
            raise InputError("StragglerDetector", "window", f"need a window of >= 1 steps, got {window}")
        if not 0.0 < threshold <= 1.0:
            raise InputError("StragglerDetector", "threshold", f"need a fraction in (0, 1], got {threshold}")
        self.world_size = world_size
        self.window = window
        self.threshold = threshold
        self.min_lead_s = min_lead_s
        self.history: deque[Arrival] = deque(maxlen=window)

    def observe(self, time_in_collective: Sequence[float]) -> Arrival:
        """Record one collective's per-rank time inside it; returns who arrived last."""
        if len(time_in_collective) != self.world_size:
            raise InputError("StragglerDetector", "time_in_collective",
                             f"expected {self.world_size} values, got {len(time_in_collective)}")
        arrival = last_arrival(time_in_collective)
        self.history.append(arrival)
        return arrival

    def persistent_straggler(self) -> int | None:
        """The persistent straggler, or None (then use the library AllReduce)."""
        if len(self.history) < self.window:
            return None
        rank, count = min(Counter(a.last for a in self.history).items(), key=lambda kv: (-kv[1], kv[0]))
        if count < self.threshold * self.window:
            return None
        leads = sorted(a.lead for a in self.history if a.last == rank)
        if leads[len(leads) // 2] < self.min_lead_s:
            return None
        return rank
