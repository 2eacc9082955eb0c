"""Timestamp sources: perf_counter_ns on CPU, pooled CUDA events on GPU (read lazily, off the step)."""

from __future__ import annotations

import time
from collections import deque

import torch


class CpuTimer:
    """Host timestamps: a mark is perf_counter_ns, already resolved."""

    is_cuda = False

    def begin_step(self) -> None:
        """Nothing to anchor on the host clock."""
        return None

    def mark(self) -> int:
        """The current host time in ns."""
        return time.perf_counter_ns()

    def resolve(self, mark: int, anchor) -> int:
        """A mark in host ns (identity)."""
        return mark

    def release(self, anchor) -> None:
        """Nothing to give back."""


class CudaTimer:
    """GPU timestamps from CUDA events on the current stream, mapped onto the host clock.

    Creating a fresh event pair per op costs tens of µs of host time (docs/whatif.md §11), so
    events come from a pool and go back to it once the background writer has read them: the
    training thread only records (a few µs), it never waits on an event. Event times are
    mapped to the host clock through an anchor: one event recorded on an idle device (after a
    synchronise) with the host time noted. The anchor is renewed at most every `reanchor_s`
    (GPU and host clocks drift by ppm), so the synchronise costs once per half minute, not
    once per step; a mark's host time is anchor_host_ns + anchor.elapsed_time(mark).
    """

    is_cuda = True

    def __init__(self, device: torch.device, reanchor_s: float = 30.0):
        self.device = device
        self.reanchor_ns = int(reanchor_s * 1e9)
        self._pool: deque = deque()  # append/pop are atomic, so the writer may give events back
        self._anchor: tuple[torch.cuda.Event, int] | None = None

    def _event(self):
        try:
            return self._pool.pop()
        except IndexError:
            return torch.cuda.Event(enable_timing=True)

    def begin_step(self):
        """The anchor this step's events are read against (renewed when it has grown old)."""
        now = time.perf_counter_ns()
        if self._anchor is None or now - self._anchor[1] > self.reanchor_ns:
            torch.cuda.synchronize(self.device)
            anchor = torch.cuda.Event(enable_timing=True)  # never pooled: steps share it
            anchor.record()
            anchor.synchronize()
            self._anchor = (anchor, time.perf_counter_ns())
        return self._anchor

    def mark(self):
        """Record an event on the current stream; its time is read later, by the writer."""
        ev = self._event()
        ev.record()
        return ev

    def resolve(self, mark, anchor) -> int:
        """Host ns of an event (blocks the calling thread, the writer, until the event is done)."""
        if isinstance(mark, int):  # host-side marks (GC pauses) are already host ns
            return mark
        event, host_ns = anchor
        mark.synchronize()
        ns = host_ns + int(event.elapsed_time(mark) * 1e6)
        self._pool.append(mark)
        return ns

    def release(self, anchor) -> None:
        """Anchors are shared by steps and kept (the old one is dropped when renewed)."""
