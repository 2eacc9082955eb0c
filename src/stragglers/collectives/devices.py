"""Device-aware helpers: where control tensors live, and timing that is honest on a GPU.

NCCL only moves CUDA tensors, and its collectives return to the host before the GPU has run
them, so (1) every small control tensor (times, shapes) goes on the device the group's backend
uses, and (2) time inside a collective is measured with CUDA events on the stream, read
lazily, never with a host clock around asynchronous GPU work.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist


def backend_of(group=None) -> str:
    """The group's backend name in lower case ("gloo", "nccl", "cpu:gloo,cuda:nccl", …)."""
    return str(dist.get_backend(group)).lower()


def control_device(group=None, like: torch.Tensor | None = None) -> torch.device:
    """The device small control tensors must be on to go through `group`.

    A pure NCCL group needs CUDA (the current device); a group with gloo for CPU tensors
    (plain gloo or "cpu:gloo,cuda:nccl") takes them on the CPU, which keeps them off the GPU.
    """
    backend = backend_of(group)
    if "gloo" in backend or "nccl" not in backend:
        if like is not None and like.device.type != "cpu" and "gloo" not in backend:
            return like.device
        return torch.device("cpu")
    if like is not None and like.is_cuda:
        return like.device
    return torch.device("cuda", torch.cuda.current_device())


class Stopwatch:
    """Elapsed time of work issued between `start()` and `stop()` on this thread.

    CPU: the host clock. CUDA: two events on the current stream, so the time is when the GPU
    ran the work (including waiting inside NCCL for a late peer); `seconds()` reads it, waiting
    for the end event only then (call it later, off the critical path).
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.cuda = torch.device(device).type == "cuda"
        self._t0 = self._t1 = 0.0
        if self.cuda:
            self._e0 = torch.cuda.Event(enable_timing=True)
            self._e1 = torch.cuda.Event(enable_timing=True)

    def start(self) -> "Stopwatch":
        """Mark the start (host clock, or an event recorded on the current CUDA stream)."""
        if self.cuda:
            self._e0.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def stop(self) -> "Stopwatch":
        """Mark the end (returns at once on CUDA)."""
        if self.cuda:
            self._e1.record()
        else:
            self._t1 = time.perf_counter()
        return self

    def seconds(self) -> float:
        """The elapsed time in seconds (on CUDA, waits for the end event to complete)."""
        if self.cuda:
            self._e1.synchronize()
            return self._e0.elapsed_time(self._e1) / 1e3
        return self._t1 - self._t0
