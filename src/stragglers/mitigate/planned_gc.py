"""Planned garbage collection: automatic GC off, gc.collect() on every rank at the same step."""

from __future__ import annotations

import gc

from stragglers.errors import StragglersError


class PlannedGC:
    """Turn automatic GC off and collect every `every` steps, at the same step on all ranks.

    Automatic collections start whenever one rank's allocation counters cross a threshold, so
    they land on different ranks at different times and every rank waits for the slowest at the
    next synchronisation. Collecting at a fixed step on all ranks pays the same cost once, in
    parallel (docs/whatif.md §10: +12.6% with 128 DP ranks, N=500).
    """

    def __init__(self, every: int, generation: int = 2):
        if every < 1:
            raise StragglersError(f"PlannedGC: every must be >= 1 step, got {every}")
        if generation not in (0, 1, 2):
            raise StragglersError(f"PlannedGC: generation must be 0, 1 or 2, got {generation}")
        self.every, self.generation = int(every), generation
        self.collections = 0
        self._was_enabled: bool | None = None

    def start(self) -> "PlannedGC":
        """Disable automatic collection (remembering whether it was on)."""
        if self._was_enabled is None:
            self._was_enabled = gc.isenabled()
            gc.disable()
        return self

    def stop(self) -> None:
        """Restore automatic collection as it was before start()."""
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def __enter__(self) -> "PlannedGC":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()     # an exception inside the block propagates

    def step(self, step: int) -> bool:
        """Call once per step on every rank; collects after steps every-1, 2·every-1, ..."""
        if (step + 1) % self.every:
            return False
        gc.collect(self.generation)
        self.collections += 1
        return True
