"""Injected per-step worker delays, drawn deterministically from (seed, step, worker).

The same (seed, distribution, scale) gives every scheme the same delays, so schemes can be
compared side by side in one run.
"""

from __future__ import annotations

import numpy as np

from stragglers.errors import InputError

DISTRIBUTIONS = ("pareto", "lognormal", "exponential", "none")


class DelaySampler:
    """Per-(step, worker) delay in seconds: `scale`·X with X heavy-tailed (pareto, lognormal)."""

    def __init__(self, dist: str = "pareto", scale: float = 0.01, seed: int = 0,
                 shape: float | None = None):
        if dist not in DISTRIBUTIONS:
            raise InputError("delays", "dist", f"expected one of {', '.join(DISTRIBUTIONS)}, "
                                               f"got {dist!r}")
        if not scale >= 0:
            raise InputError("delays", "scale", f"expected a delay scale >= 0 seconds, got {scale}")
        self.dist = dist
        self.scale = float(scale)
        self.seed = int(seed)
        # Pareto α = 1.5: finite mean, infinite variance; lognormal σ = 1.5
        self.shape = shape if shape is not None else {"pareto": 1.5, "lognormal": 1.5}.get(dist, 1.0)

    def __call__(self, step: int, worker: int) -> float:
        """The delay of `worker` at `step` (seconds)."""
        if self.dist == "none" or self.scale == 0:
            return 0.0
        rng = np.random.default_rng([self.seed, int(step), int(worker)])
        if self.dist == "pareto":
            x = rng.pareto(self.shape)  # Lomax: 0-based, heavy tail
        elif self.dist == "lognormal":
            x = rng.lognormal(0.0, self.shape)
        else:
            x = rng.exponential(1.0)
        return float(self.scale * x)

    def describe(self) -> str:
        """A short label, e.g. 'pareto(α=1.5)·0.01s seed 0'."""
        return f"{self.dist}(shape={self.shape:g})x{self.scale:g}s seed {self.seed}"


class FixedDelays:
    """Delays from an explicit table {(step, worker): seconds}; 0 elsewhere (for tests)."""

    def __init__(self, table: dict[tuple[int, int], float]):
        self.table = dict(table)

    def __call__(self, step: int, worker: int) -> float:
        """The tabled delay or 0."""
        return float(self.table.get((int(step), int(worker)), 0.0))
