"""The injected straggler causes of a synthetic job, one typed value per kind."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Self, Sequence


@dataclass(frozen=True)
class Injection:
    """One injected straggler cause; `keyword` is the generator's keyword it stands for."""

    keyword: ClassVar[str] = ""

    def value(self) -> Any:
        """The keyword form's value (a tuple or dict, as `generate(**keywords)` takes it)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def record(self) -> Any:
        """The checked form the trace's metadata records (lists for tuples, as JSON has them)."""
        return {f.name: _listed(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> Self:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class SlowWorker(Injection):
    """One worker (DP rank, stage) computes `factor` times as long: a worker_fault."""

    keyword: ClassVar[str] = "slow_worker"
    dp: int
    stage: int
    factor: float

    def value(self) -> tuple[int, int, float]:
        return (self.dp, self.stage, self.factor)

    def record(self) -> list[float]:
        return list(self.value())


@dataclass(frozen=True)
class HeavyLastStage(Injection):
    """The last stage's forward/backward × `factor`: a stage_imbalance."""

    keyword: ClassVar[str] = "heavy_last_stage"
    factor: float

    def value(self) -> float:
        return self.factor

    def record(self) -> float:
        return self.factor


@dataclass(frozen=True)
class SequenceImbalance(Injection):
    """Sequence lengths drawn from `dist` and packed per microbatch: a sequence_imbalance."""

    keyword: ClassVar[str] = "seq_imbalance"
    dist: str = "lognormal"                          # "lognormal" or "uniform"
    max_len: int = 16384
    min_len: int = 64
    tokens_per_mb: int = 16384
    median_len: float = 1024
    sigma: float = 1.2


@dataclass(frozen=True)
class GC(Injection):
    """Garbage-collection pauses (gc rows): `rate` per worker per step, `seconds` each."""

    keyword: ClassVar[str] = "gc"
    rate: float
    seconds: float

    def value(self) -> tuple[float, float]:
        return (self.rate, self.seconds)

    def record(self) -> list[float]:
        return list(self.value())


@dataclass(frozen=True)
class GCInCompute(GC):
    """GC pauses inside forward/backward compute, with no gc rows (what NDTimeline shows)."""

    keyword: ClassVar[str] = "gc_in_compute"


@dataclass(frozen=True)
class SlowLink(Injection):
    """The p2p link between two neighbouring stages of one DP rank × `factor` (both ways)."""

    keyword: ClassVar[str] = "slow_link"
    kind: ClassVar[str] = "p2p"
    dp: int
    stage_from: int
    stage_to: int
    factor: float
    steps: Sequence[int] | None = None               # None: every step

    def value(self) -> dict:
        return {"kind": self.kind, **super().value()}

    def record(self) -> dict:
        return {"kind": self.kind, "factor": self.factor, "steps": _listed(self.steps),
                "dp": self.dp, "stage_from": self.stage_from, "stage_to": self.stage_to}


@dataclass(frozen=True)
class SlowCollective(Injection):
    """One collective op type × `factor`, on one stage or all (None), on some steps or all."""

    keyword: ClassVar[str] = "slow_link"
    kind: ClassVar[str] = "collective"
    optype: str
    factor: float
    stage: int | None = None
    steps: Sequence[int] | None = None

    def value(self) -> dict:
        return {"kind": self.kind, **super().value()}

    def record(self) -> dict:
        return {"kind": self.kind, "factor": self.factor, "steps": _listed(self.steps),
                "optype": self.optype, "stage": self.stage}


@dataclass(frozen=True)
class HostStall(Injection):
    """Host-side work (a slow data loader) before one worker's first op of each step."""

    keyword: ClassVar[str] = "host_stall"
    dp: int
    stage: int
    seconds: float
    steps: Sequence[int] | None = None


INJECTION_TYPES: tuple[type[Injection], ...] = (
    SlowWorker, HeavyLastStage, SequenceImbalance, GC, GCInCompute, SlowLink, SlowCollective,
    HostStall)
BY_NAME = {cls.__name__: cls for cls in INJECTION_TYPES}


def _listed(value: Any) -> Any:
    """A tuple of the checked form as the list JSON gives back (other values as they are)."""
    return list(value) if isinstance(value, tuple) else value
