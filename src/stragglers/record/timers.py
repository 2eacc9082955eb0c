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

    Creating a fresh event pair per op costs tens of µs of host time (specs/whatif.md §11), so
    events come from a pool and go back to it once the background flusher has read them. Each
    sampled step records one anchor event after a device synchronise and notes the host time;
    a mark's host time is anchor_host_ns + anchor.elapsed_time(mark).
    """

    is_cuda = True

    def __init__(self, device: torch.device):
        self.device = device
        self._pool: deque = deque()  # append/pop are atomic, so the flusher may give events back

    def _event(self):
        try:
            return self._pool.pop()
        except IndexError:
            return torch.cuda.Event(enable_timing=True)

    def begin_step(self):
        """Anchor this step's events to the host clock (one synchronise per sampled step)."""
        torch.cuda.synchronize(self.device)
        anchor = self._event()
        anchor.record()
        anchor.synchronize()
        return anchor, time.perf_counter_ns()

    def mark(self):
        """Record an event on the current stream; its time is read later."""
        ev = self._event()
        ev.record()
        return ev

    def resolve(self, mark, anchor) -> int:
        """Host ns of an event (blocks the calling thread, the flusher, until the event is done)."""
        if isinstance(mark, int):  # host-side marks (GC pauses) are already host ns
            return mark
        event, host_ns = anchor
        mark.synchronize()
        ns = host_ns + int(event.elapsed_time(mark) * 1e6)
        self._pool.append(mark)
        return ns

    def release(self, anchor) -> None:
        """Give a step's anchor event back to the pool."""
        if anchor is not None:
            self._pool.append(anchor[0])
