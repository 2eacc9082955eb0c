"""DDP communication hook: StragglAR while one rank is persistently last, else the library
AllReduce. Register with `model.register_comm_hook(StragglarHookState(...), stragglar_hook)`.

No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.

Three rules keep every rank in step:
* the hook's traffic runs on its **own process group** (created collectively when the state is
  built), so a model that runs collectives of its own during backward (SyncBatchNorm,
  tensor-parallel layers, a hand-written all_reduce in a backward) never interleaves with it;
* the collectives run on one communication thread, in bucket order, identical on every rank;
* decisions come from numbers every rank shares (an all-reduced time vector).
"""

import itertools
import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from stragglers.collectives.arrival import StoreArrivalOrder, TimeExchange
from stragglers.collectives.detection import StragglerDetector
from stragglers.collectives.devices import Stopwatch, backend_of
from stragglers.collectives.executor import prepare_subgroups, stragglar_all_reduce
from stragglers.collectives.groups import companion_group
from stragglers.errors import InputError

MODES = ("persistent", "eager")
DEFAULT_MIN_LEAD_S = 1e-3
_STATES = itertools.count()  # every rank builds its states in the same order


@dataclass
class HookDecision:
    """What one hook call did: the straggler used (None = library AllReduce) and its seconds
    inside the collective, counted from when the bucket could start (its gradient was ready
    and the previous bucket was done), not from when DDP called the hook."""

    call: int
    bucket: int
    straggler: int | None
    seconds: float | None  # None until read (CUDA: read lazily at the next call)


@dataclass
class StragglarHookState:
    """Hook state. mode="persistent": StragglAR with the rank last in most of the recent window
    by a median lead of at least `min_lead_s` (decided from numbers every rank shares, so all
    ranks agree). mode="eager": whoever arrives last at this very call, through the c10d store.

    Build it on every rank at the same point (like the DDP model itself): it creates its own
    process group with the ranks of `process_group`.
    """

    process_group: dist.ProcessGroup | None = None
    mode: str = "persistent"
    window: int = 8
    threshold: float = 0.6
    # a lead below ~1 ms is scheduling noise on these backends, and far below the delay
    # StragglAR needs to win (its phase 1 must hide in it): such ranks are not stragglers
    min_lead_s: float = DEFAULT_MIN_LEAD_S
    phase1: str = "auto"
    decisions: list = field(default_factory=list)

    def __post_init__(self):
        if self.mode not in MODES:
            raise InputError("StragglarHookState", "mode", f"expected one of {MODES}, got {self.mode!r}")
        if not isinstance(self.min_lead_s, (int, float)) or self.min_lead_s < 0:
            raise InputError("StragglarHookState", "min_lead_s",
                             f"expected seconds >= 0, got {self.min_lead_s!r}")
        self.world_size = dist.get_world_size(self.process_group)
        # collective, once: every rank creates the hook's group here in the same order
        self.comm_group = companion_group(self.process_group, f"stragglar-hook-{next(_STATES)}")
        # one detector per bucket: only the first bucket of a step waits for a late backward;
        # the later ones are measured from when they could start (see _Job), so queueing
        # behind the previous bucket is not lateness
        self.detectors: dict[int, StragglerDetector] = {}
        self._comm: _CommThread | None = None
        self._unposted: tuple[Stopwatch, int, HookDecision] | None = None
        self.times = TimeExchange(self.comm_group)
        self.arrivals = StoreArrivalOrder(group=self.comm_group) if self.mode == "eager" else None
        backend = backend_of(self.comm_group)
        if self.phase1 == "library" or (self.phase1 == "auto" and backend in ("nccl", "xccl")):
            prepare_subgroups(self.comm_group)  # collective: all ranks build the state together

    def close(self) -> None:
        """Finish queued work and the last time exchange (call once after training)."""
        if self._comm is not None:
            self._comm.submit(self._finish, None).wait()

    def _finish(self) -> None:
        self._observe()
        self._post_unposted()
        self._observe()

    def submit(self, fn, device=None) -> torch.futures.Future:
        """Run `fn` on this state's communication thread; a Future of its result."""
        if self._comm is None:
            self._comm = _CommThread()
        return self._comm.submit(fn, device)

    def detector(self, bucket_index: int) -> StragglerDetector:
        """The detector of one DDP bucket (created on first use)."""
        if bucket_index not in self.detectors:
            self.detectors[bucket_index] = StragglerDetector(self.world_size, self.window, self.threshold,
                                                             self.min_lead_s)
        return self.detectors[bucket_index]

    def _observe(self) -> None:
        shared = self.times.collect_tagged()
        if shared is not None and self.world_size > 1:
            times, bucket = shared
            self.detector(bucket).observe(times)

    def _post_unposted(self) -> None:
        if self._unposted is not None:
            watch, bucket, decision = self._unposted
            self._unposted = None
            decision.seconds = watch.seconds()  # CUDA: the events of the previous call
            self.times.post(decision.seconds, bucket)

    def choose_straggler(self, bucket_index: int = 0) -> int | None:
        """The straggler for this call; identical on every rank."""
        self._observe()
        self._post_unposted()
        if self.world_size < 2:
            return None
        if self.arrivals is not None:   # eager mode
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

    def submit(self, fn, device=None) -> torch.futures.Future:
        # on CUDA the future records the streams' work, so DDP's use of the result waits for it
        fut: torch.futures.Future = torch.futures.Future(devices=[device]) \
            if device is not None and device.type == "cuda" else torch.futures.Future()
        self.jobs.put((fn, fut, device))
        return fut

    def _run(self) -> None:
        while True:
            fn, fut, device = self.jobs.get()
            try:
                if device is not None and device.type == "cuda":
                    torch.cuda.set_device(device)  # the current device is per thread
                fut.set_result(fn())
            except Exception as exc:  # surfaces in the training loop through the future
                fut.set_exception(exc)


def _average(state: StragglarHookState, tensor: torch.Tensor, bucket_index: int) -> torch.Tensor:
    # the bucket can start now: its gradient is ready (it was submitted) and the previous
    # bucket is done (one thread); on CUDA the start event is ordered after both on the stream
    watch = Stopwatch(tensor.device).start()
    straggler = state.choose_straggler(bucket_index)
    tensor.div_(state.world_size)
    if straggler is None:
        dist.all_reduce(tensor, group=state.comm_group)
    else:
        stragglar_all_reduce(tensor, straggler, state.comm_group, phase1=state.phase1, check=False)
    watch.stop()
    decision = HookDecision(len(state.decisions), bucket_index, straggler, None)
    state.decisions.append(decision)
    state._unposted = (watch, bucket_index, decision)
    if not watch.cuda:  # the host clock is already final: share it now, collect it next call
        state._post_unposted()
    return tensor


def stragglar_hook(state: StragglarHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket like DDP's default hook, with StragglAR when a straggler is known.

    Returns at once; the reduction runs on the state's communication thread.
    """
    tensor, index = bucket.buffer(), bucket.index()
    return state.submit(lambda: _average(state, tensor, index), tensor.device)
