"""DDP communication hook: StragglAR while one rank is persistently last, else the library
AllReduce. Register with `model.register_comm_hook(StragglarHookState(...), stragglar_hook)`.

No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime.
"""


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
        self.detector = StragglerDetector(self.world_size, self.window, self.threshold, self.min_lead_s)
        self.times = TimeExchange(self.process_group)
        self.arrivals = StoreArrivalOrder(group=self.process_group) if self.mode == "eager" else None
        if self.phase1 == "library" or (self.phase1 == "auto" and
                                         str(dist.get_backend(self.process_group)).lower() in ("nccl", "xccl")):
            prepare_subgroups(self.process_group)  # collective: all ranks register the hook together

    def close(self) -> None:
        """Wait for the last in-flight time exchange (call once after training)."""
        self.times.collect()

    def choose_straggler(self) -> int | None:
        """The straggler for this call; identical on every rank."""
        shared = self.times.collect()
        if shared is not None:
            self.detector.observe(shared)
        if self.mode == "eager":
            return self.arrivals.last_arrival()
        return self.detector.persistent_straggler()


def stragglar_hook(state: StragglarHookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket like DDP's default hook, with StragglAR when a straggler is known."""
    start = time.perf_counter()
    straggler = state.choose_straggler()
    tensor = bucket.buffer()
    tensor.div_(state.world_size)
    if straggler is None:
        dist.all_reduce(tensor, group=state.process_group)
    else:
        stragglar_all_reduce(tensor, straggler, state.process_group, phase1=state.phase1)
    seconds = time.perf_counter() - start
    state.times.post(seconds)
    state.decisions.append(HookDecision(len(state.decisions), straggler, seconds))
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut
