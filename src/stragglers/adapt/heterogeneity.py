"""Injected device speeds for CPU experiments: a worker of speed s sleeps b x t_sample / s.

On one CPU host the workers are equally fast, so heterogeneity is injected: every micro-batch of
m samples also sleeps m x sample_time / speed(step). Three patterns, all deterministic:
deterministic (fixed per-rank speeds), transient (random short episodes, seeded per rank) and
persistent (one rank slowed from a step on). The persistent slowdown belongs to the first
incarnation only: KILL_RESTART "relaunches the node away from its old host", which on one
machine means the restarted process (TORCHELASTIC_RESTART_COUNT > 0) no longer carries it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from stragglers.errors import InputError


def parse_speeds(text: str, world_size: int) -> list[float]:
    """'1,1,1,0.33' -> per-rank speeds; one value applies to every rank."""
    try:
        speeds = [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise InputError("--speeds", None, f"expected comma-separated numbers, got {text!r}") from exc
    if len(speeds) == 1:
        speeds = speeds * world_size
    if len(speeds) != world_size or any(s <= 0 for s in speeds):
        raise InputError("--speeds", None,
                         f"expected {world_size} positive values (one per rank), got {text!r}")
    return speeds


class SimulatedDevice:
    """The speed of one rank over steps, and the sleep that makes it so."""

    def __init__(self, rank: int, speeds: Sequence[float], sample_time: float,
                 transient_rate: float = 0.0, transient_factor: float = 3.0,
                 transient_steps: tuple[int, int] = (5, 15), persistent_rank: int | None = None,
                 persistent_factor: float = 3.0, persistent_start: int = 0, incarnation: int = 0,
                 seed: int = 0):
        self.rank, self.base = rank, float(speeds[rank])
        self.sample_time = sample_time
        self.persistent = persistent_rank == rank and incarnation == 0
        self.persistent_factor, self.persistent_start = persistent_factor, persistent_start
        self.transient_factor = transient_factor
        rng = random.Random(seed * 1009 + rank)
        self._episodes: list[tuple[int, int]] = []
        step = 0
        while transient_rate > 0 and step < 100_000:
            step += 1 + int(rng.expovariate(transient_rate))
            length = rng.randint(*transient_steps)
            self._episodes.append((step, step + length))
            step += length
        self.step = 0

    @property
    def device(self) -> str:
        """A device-type label: ranks with a different base speed are different hardware."""
        return f"sim-x{self.base:g}"

    def speed(self, step: int) -> float:
        """Samples per sample_time at `step`."""
        s = self.base
        if self.persistent and step >= self.persistent_start:
            s /= self.persistent_factor
        if any(a <= step < b for a, b in self._episodes):
            s /= self.transient_factor
        return s

    def run(self, samples: int) -> None:
        """Spend the simulated device time of `samples` samples at the current step."""
        time.sleep(samples * self.sample_time / self.speed(self.step))
