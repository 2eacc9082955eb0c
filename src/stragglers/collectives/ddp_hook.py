"""DDP communication hook: StragglAR while one rank is persistently last, else the library
AllReduce. Register with `model.register_comm_hook(StragglarHookState(...), stragglar_hook)`.

No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.
"""


import queue
import threading
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from stragglers.collectives.arrival import StoreArrivalOrder, TimeExchange
from stragglers.collectives.detection import StragglerDetector
from stragglers.collectives.executor import prepare_subgroups, stragglar_all_reduce
from stragglers.errors import InputError

MODES = ("persistent", "eager")


@dataclass
class HookDecision:
    """What one hook call did: the straggler used (None = library AllReduce) and its seconds."""

    call: int
    bucket: int
    straggler: int | None
    seconds: float


@dataclass
class StragglarHookState:
    """Hook state. mode="persistent": StragglAR with the rank last in most of the recent window
    (decided from numbers every rank shares, so all ranks agree). mode="eager": whoever arrives
    last at this very call, agreed through the c10d store."""

    process_group: object = None
    mode: str = "persistent"
    window: int = 8
    threshold: float = 0.6
    min_lead_s: float = 0.0
    phase1: str = "auto"
    decisions: list[HookDecision] = field(default_factory=list)

    def __post_init__(self):
        if self.mode not in MODES:
            raise InputError("StragglarHookState", "mode", f"expected one of {MODES}, got {self.mode!r}")
        self.world_size = dist.get_world_size(self.process_group)
        # one detector per bucket: only the first bucket of a step waits for a late backward,
        # the later ones start in step, so their "last" is noise that must not dilute the first's
        self.detectors: dict[int, StragglerDetector] = {}
        self._shared_for: int | None = None
        self._comm: _CommThread | None = None
        self.times = TimeExchange(self.process_group)
        self.arrivals = StoreArrivalOrder(group=self.process_group) if self.mode == "eager" else None
        if self.phase1 == "library" or (self.phase1 == "auto" and
                                         str(dist.get_backend(self.process_group)).lower() in ("nccl", "xccl")):
            prepare_subgroups(self.process_group)  # collective: all ranks register the hook together

    def close(self) -> None:
        """Finish queued work and the last time exchange (call once after training)."""
        if self._comm is not None:
            self._comm.submit(self.times.collect).wait()

    def submit(self, fn) -> torch.futures.Future:
        """Run `fn` on this state's communication thread; a Future of its result."""
        if self._comm is None:
            self._comm = _CommThread()
        return self._comm.submit(fn)

    def detector(self, bucket_index: int) -> StragglerDetector:
        """The detector of one DDP bucket (created on first use)."""
        if bucket_index not in self.detectors:
            self.detectors[bucket_index] = StragglerDetector(self.world_size, self.window, self.threshold,
                                                             self.min_lead_s)
        return self.detectors[bucket_index]

    def choose_straggler(self, bucket_index: int = 0) -> int | None:
        """The straggler for this call; identical on every rank."""
        shared = self.times.collect()
        if shared is not None:
            self.detector(self._shared_for).observe(shared)
        self._shared_for = bucket_index
        if self.mode == "eager":
            return self.arrivals.last_arrival()
        return self.detector(bucket_index).persistent_straggler()


class _CommThread:
    """One thread that runs every collective of the hook in submission order.

    DDP calls the hook in the same bucket order on every rank; running the collectives on one
    thread keeps that order (so p2p and collectives match across ranks) while the autograd
    thread goes on with the backward pass, as with DDP's own asynchronous AllReduce.
    """

    def __init__(self):
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._run, name="stragglar-comm", daemon=True).start()

    def submit(self, fn) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self.jobs.put((fn, fut))
        return fut

    def _run(self) -> None:
        while True:
            fn, fut = self.jobs.get()
            try:
                fut.set_result(fn())
            except Exception as exc:  # surfaces in the training loop through the future
                fut.set_exception(exc)


def _average(state: StragglarHookState, tensor: torch.Tensor, bucket_index: int, start: float) -> torch.Tensor:
    straggler = state.choose_straggler(bucket_index)
    tensor.div_(state.world_size)
    if straggler is None:
        dist.all_reduce(tensor, group=state.process_group)
    else:
        stragglar_all_reduce(tensor, straggler, state.process_group, phase1=state.phase1)
    seconds = time.perf_counter() - start
    state.times.post(seconds)
    state.decisions.append(HookDecision(len(state.decisions), bucket_index, straggler, seconds))
    return tensor


def stragglar_hook(state: StragglarHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket like DDP's default hook, with StragglAR when a straggler is known.

    Returns at once; the reduction runs on the state's communication thread.
    """
    start = time.perf_counter()
    tensor, index = bucket.buffer(), bucket.index()
    return state.submit(lambda: _average(state, tensor, index, start))
