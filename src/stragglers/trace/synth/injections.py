"""The injected straggler causes of a synthetic job, one typed value per kind."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Self, Sequence, TypedDict


class SeqImbalanceForm(TypedDict):
    """seq_imbalance in the keyword form and in the metadata: every field of SequenceImbalance."""

    dist: str
    max_len: int
    min_len: int
    tokens_per_mb: int
    median_len: float
    sigma: float


class SlowLinkForm(TypedDict):
    """slow_link between two stages: {"kind": "p2p", ...} (steps a list in the metadata)."""

    kind: str
    dp: int
    stage_from: int
    stage_to: int
    factor: float
    steps: Sequence[int] | None


class SlowCollectiveForm(TypedDict):
    """slow_link of a collective: {"kind": "collective", ...} (steps a list in the metadata)."""

    kind: str
    optype: str
    factor: float
    stage: int | None
    steps: Sequence[int] | None


class HostStallForm(TypedDict):
    """host_stall: the worker, the seconds and the steps (a list in the metadata)."""

    dp: int
    stage: int
    seconds: float
    steps: Sequence[int] | None


# What `Injection.value()` gives (the keyword form, tuples as `generate(**keywords)` takes
# them) and what `record()` gives (the metadata's JSON form: lists for tuples).
InjectionValue = (tuple[int, int, float] | float | tuple[float, float] | SeqImbalanceForm
                  | SlowLinkForm | SlowCollectiveForm | HostStallForm)
InjectionRecord = (list[float] | float | SeqImbalanceForm | SlowLinkForm | SlowCollectiveForm
                   | HostStallForm)


@dataclass(frozen=True)
class Injection:
    """One injected straggler cause; `keyword` is the generator's keyword it stands for."""

    keyword: ClassVar[str] = ""

    def value(self) -> InjectionValue:
        """The keyword form's value (a tuple or dict, as `generate(**keywords)` takes it)."""
        raise NotImplementedError(f"{type(self).__name__} is no injection kind of the generator")

    def record(self) -> InjectionRecord:
        """The checked form the trace's metadata records (lists for tuples, as JSON has them)."""
        raise NotImplementedError(f"{type(self).__name__} is no injection kind of the generator")

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

    def value(self) -> SeqImbalanceForm:
        return SeqImbalanceForm(dist=self.dist, max_len=self.max_len, min_len=self.min_len,
                                tokens_per_mb=self.tokens_per_mb, median_len=self.median_len,
                                sigma=self.sigma)

    def record(self) -> SeqImbalanceForm:
        return self.value()


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

    def value(self) -> SlowLinkForm:
        return SlowLinkForm(kind=self.kind, dp=self.dp, stage_from=self.stage_from,
                            stage_to=self.stage_to, factor=self.factor, steps=self.steps)

    def record(self) -> SlowLinkForm:
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

    def value(self) -> SlowCollectiveForm:
        return SlowCollectiveForm(kind=self.kind, optype=self.optype, factor=self.factor,
                                  stage=self.stage, steps=self.steps)

    def record(self) -> SlowCollectiveForm:
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

    def value(self) -> HostStallForm:
        return HostStallForm(dp=self.dp, stage=self.stage, seconds=self.seconds,
                             steps=self.steps)

    def record(self) -> HostStallForm:
        return {**self.value(), "steps": _listed(self.steps)}


INJECTION_TYPES: tuple[type[Injection], ...] = (
    SlowWorker, HeavyLastStage, SequenceImbalance, GC, GCInCompute, SlowLink, SlowCollective,
    HostStall)
BY_NAME = {cls.__name__: cls for cls in INJECTION_TYPES}


def _listed(steps: Sequence[int] | None) -> Sequence[int] | None:
    """A tuple of the checked form as the list JSON gives back (other values as they are)."""
    return list(steps) if isinstance(steps, tuple) else steps
