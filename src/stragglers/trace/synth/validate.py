"""Checking a synthetic job's parameters: a SynthSpec checked whole into the `Job` it runs."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypedDict

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.model import COMPUTE_OPTYPES, OPTYPES, P2P_OPTYPES
from stragglers.trace.synth.injections import (GC, GCInCompute, HeavyLastStage, HostStall,
                                               HostStallForm, Injection, SeqImbalanceForm,
                                               SequenceImbalance, SlowCollective,
                                               SlowCollectiveForm, SlowLink, SlowLinkForm,
                                               SlowWorker)

if TYPE_CHECKING:
    from stragglers.trace.synth.spec import SynthSpec

SOURCE = "stragglers synth"
COLLECTIVE_OPTYPES = tuple(o for o in OPTYPES if o not in COMPUTE_OPTYPES + P2P_OPTYPES)
# the injections' keywords in the generator's order (ground truth, default names, the metadata)
KEYWORDS = ("slow_worker", "heavy_last_stage", "seq_imbalance", "gc", "slow_link",
            "host_stall", "gc_in_compute")
# Fields of the generator's keyword form the metadata records, in its order.
_SHAPE = ("dp", "pp", "vpp", "microbatches", "steps", "sync", "seed", "noise")


class GeneratorRecord(TypedDict):
    """The checked keyword form as the trace's metadata records it (JSON values: lists for
    tuples); an injection not given is None."""

    dp: int
    pp: int
    vpp: int
    microbatches: int
    steps: int
    sync: str
    seed: int
    noise: float
    slow_worker: list[float] | None          # [dp rank, stage, factor]
    heavy_last_stage: float | None
    seq_imbalance: SeqImbalanceForm | None
    gc: list[float] | None                   # [pauses per worker per step, pause seconds]
    slow_link: SlowLinkForm | SlowCollectiveForm | None
    host_stall: HostStallForm | None
    gc_in_compute: list[float] | None
    stage_scale: list[float] | None
    launch_delay: float
    step_gap: float


@dataclass(frozen=True)
class Job:
    """A SynthSpec checked whole: the sizes, noise and injections the generator runs.

    Numbers are int/float, step lists sorted tuples, every injection's defaults filled in;
    an injection that is not given is None.
    """

    dp: int
    pp: int
    vpp: int
    microbatches: int
    steps: int
    sync: str
    seed: int
    noise: float
    launch_delay: float
    step_gap: float
    stage_scale: tuple[float, ...] | None = None
    slow_worker: SlowWorker | None = None
    heavy_last_stage: HeavyLastStage | None = None
    seq_imbalance: SequenceImbalance | None = None
    gc: GC | None = None
    slow_link: SlowLink | SlowCollective | None = None
    host_stall: HostStall | None = None
    gc_in_compute: GCInCompute | None = None

    def injected(self) -> list[tuple[str, Injection]]:
        """(keyword, injection) of the injections given, in the generator's order."""
        given = ((k, getattr(self, k)) for k in KEYWORDS)
        return [(k, item) for k, item in given if item is not None]

    def without(self, keyword: str) -> Job:
        """The same job without one injection (every other draw unchanged)."""
        if keyword not in KEYWORDS:
            raise ValueError(f"{keyword!r} is no injection; expected one of {KEYWORDS}")
        none: dict[str, Any] = {keyword: None}
        return dataclasses.replace(self, **none)

    def keywords(self) -> GeneratorRecord:
        """The checked keyword form, as the trace's metadata records it (JSON values)."""
        return GeneratorRecord(
            dp=self.dp, pp=self.pp, vpp=self.vpp, microbatches=self.microbatches,
            steps=self.steps, sync=self.sync, seed=self.seed, noise=self.noise,
            slow_worker=None if self.slow_worker is None else self.slow_worker.record(),
            heavy_last_stage=None if self.heavy_last_stage is None
            else self.heavy_last_stage.record(),
            seq_imbalance=None if self.seq_imbalance is None else self.seq_imbalance.record(),
            gc=None if self.gc is None else self.gc.record(),
            slow_link=None if self.slow_link is None else self.slow_link.record(),
            host_stall=None if self.host_stall is None else self.host_stall.record(),
            gc_in_compute=None if self.gc_in_compute is None else self.gc_in_compute.record(),
            stage_scale=None if self.stage_scale is None else list(self.stage_scale),
            launch_delay=self.launch_delay, step_gap=self.step_gap)


def check(spec: SynthSpec) -> Job:
    """Check sizes and injections of `spec` (one InputError naming the field); the Job it runs."""
    dp, pp, vpp, microbatches, steps = (_int(getattr(spec, k), k) for k in _SHAPE[:5])
    seed = _int(spec.seed, "seed", 0)
    if spec.sync not in ("zero", "ddp"):
        raise InputError(SOURCE, "sync", f"expected 'zero' or 'ddp', got {spec.sync!r}")
    if vpp > 1 and pp < 2:
        raise InputError(SOURCE, "vpp", "an interleaved schedule (vpp > 1) needs pp >= 2")
    if vpp > 1 and microbatches % pp:
        raise InputError(SOURCE, "microbatches", f"the interleaved schedule needs a multiple of "
                         f"pp={pp} microbatches, got {microbatches}")
    job = Job(dp, pp, vpp, microbatches, steps, spec.sync, seed,
              noise=_positive(spec.noise, "noise", strict=False),
              launch_delay=_positive(spec.launch_delay, "launch_delay", strict=False),
              step_gap=_positive(spec.step_gap, "step_gap", strict=False))
    given = {item.keyword: item for item in spec.injections}
    checked = {k: _CHECKS[k](given[k], job) for k in KEYWORDS if k in given}
    scale = spec.stage_scale
    if scale is not None:
        if not isinstance(scale, (list, tuple)) or len(scale) != pp:
            raise InputError(SOURCE, "stage_scale", f"expected one factor per stage "
                             f"({pp} numbers), got {scale!r}")
        scale = tuple(_positive(f, "stage_scale") for f in scale)
    return dataclasses.replace(job, stage_scale=scale, **checked)


def _int(value: Any, field: str, low: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise InputError(SOURCE, field, f"expected an integer >= {low}, got {value!r}")
    return int(value)


def _positive(value: Any, field: str, low: float = 0.0, strict: bool = True) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(SOURCE, field, f"expected a number, got {value!r}") from None
    if not np.isfinite(v) or v < low or (strict and v == low):
        raise InputError(SOURCE, field, f"expected a finite number {'>' if strict else '>='} "
                         f"{low}, got {value!r}")
    return v


def _index(value: Any, field: str, size: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not 0 <= value < size:
        raise InputError(SOURCE, field, f"{what} {value!r} is out of range; expected 0..{size - 1}")
    return int(value)


def _steps(value: Sequence[int] | None, field: str, job: Job) -> tuple[int, ...] | None:
    """A step list sorted and checked (None: every step)."""
    if value is None:
        return None
    try:
        steps = tuple(sorted({_index(s, field, job.steps, "step") for s in value}))
    except TypeError:
        raise InputError(SOURCE, field, "expected a list of step numbers") from None
    if not steps:
        raise InputError(SOURCE, field, "is empty; give at least one step or None for every step")
    return steps


def _slow_worker(item: SlowWorker, job: Job) -> SlowWorker:
    return item.replace(dp=_index(item.dp, "slow_worker", job.dp, "dp rank"),
                        stage=_index(item.stage, "slow_worker", job.pp, "stage"),
                        factor=_positive(item.factor, "slow_worker factor"))


def _heavy_last_stage(item: HeavyLastStage, job: Job) -> HeavyLastStage:
    checked = item.replace(factor=_positive(item.factor, "heavy_last_stage"))
    if job.pp == 1:
        warnings.warn("heavy_last_stage with pp=1 slows the only stage: every worker is "
                      "equally slow, so it is no imbalance", stacklevel=5)
    return checked


def _seq_imbalance(item: SequenceImbalance, job: Job) -> SequenceImbalance:
    if item.dist not in ("lognormal", "uniform"):
        raise InputError(SOURCE, "seq_imbalance.dist", f"expected 'lognormal' or 'uniform', "
                         f"got {item.dist!r}")
    max_len, min_len, tokens = (
        int(_positive(v, f"seq_imbalance.{k}", low=1, strict=False)) for k, v in
        (("max_len", item.max_len), ("min_len", item.min_len),
         ("tokens_per_mb", item.tokens_per_mb)))
    if min_len > max_len:
        raise InputError(SOURCE, "seq_imbalance.min_len", f"{min_len} exceeds max_len {max_len}")
    return item.replace(max_len=max_len, min_len=min_len, tokens_per_mb=tokens,
                        median_len=_positive(item.median_len, "seq_imbalance.median_len"),
                        sigma=_positive(item.sigma, "seq_imbalance.sigma", strict=False))


def _gc(item: GC, job: Job) -> GC:
    """GC pauses with gc rows (keyword gc) or inside compute (gc_in_compute)."""
    checked = item.replace(rate=_positive(item.rate, f"{item.keyword} rate"),
                           seconds=_positive(item.seconds, f"{item.keyword} length"))
    forwards = job.microbatches * job.vpp
    if item.keyword == "gc" and checked.rate > forwards:
        warnings.warn(f"gc rate {checked.rate} exceeds the {forwards} forwards per step; "
                      f"every forward gets a pause (rate capped at {forwards})", stacklevel=5)
    return checked


def _host_stall(item: HostStall, job: Job) -> HostStall:
    return item.replace(dp=_index(item.dp, "host_stall dp", job.dp, "dp rank"),
                        stage=_index(item.stage, "host_stall stage", job.pp, "stage"),
                        seconds=_positive(item.seconds, "host_stall seconds"),
                        steps=_steps(item.steps, "host_stall steps", job))


def _slow_link(item: SlowLink | SlowCollective, job: Job) -> SlowLink | SlowCollective:
    factor = _positive(item.factor, "slow_link factor")
    steps = _steps(item.steps, "slow_link steps", job)
    checked = _p2p_link(item, job) if isinstance(item, SlowLink) else _collective(item, job)
    return checked.replace(factor=factor, steps=steps)


def _p2p_link(item: SlowLink, job: Job) -> SlowLink:
    if job.pp < 2:
        raise InputError(SOURCE, "slow_link", "a p2p link needs pp >= 2 (no pipeline p2p)")
    dp = _index(item.dp, "slow_link dp", job.dp, "dp rank")
    a = _index(item.stage_from, "slow_link stage_from", job.pp, "stage")
    b = _index(item.stage_to, "slow_link stage_to", job.pp, "stage")
    ring = job.vpp > 1 and {a, b} == {0, job.pp - 1}
    if abs(a - b) != 1 and not ring:
        raise InputError(SOURCE, "slow_link", f"stages {a} and {b} are not pipeline "
                         "neighbours, so no p2p traffic passes between them")
    return item.replace(dp=dp, stage_from=a, stage_to=b)


def _collective(item: SlowCollective, job: Job) -> SlowCollective:
    optype = item.optype
    if optype not in COLLECTIVE_OPTYPES:
        raise InputError(SOURCE, "slow_link optype", f"expected one of "
                         f"{', '.join(COLLECTIVE_OPTYPES)}, got {optype!r}")
    present = collectives_present(job.sync, job.pp)
    if optype not in present:
        raise InputError(SOURCE, "slow_link optype", f"{optype} does not occur in this job "
                         f"(sync={job.sync}, pp={job.pp}); it has {', '.join(present)}")
    stage = item.stage
    if optype == "embedding-grads-all-reduce" and stage not in (None, 0, job.pp - 1):
        raise InputError(SOURCE, "slow_link stage", "embedding-grads-all-reduce runs only on "
                         f"stages 0 and {job.pp - 1}")
    return item.replace(
        stage=None if stage is None else _index(stage, "slow_link stage", job.pp, "stage"))


def collectives_present(sync: str, pp: int) -> list[str]:
    """The collective op types a job of this sync and pipeline depth runs."""
    names = ["params-all-gather", "grads-reduce-scatter"] if sync == "zero" \
        else ["grads-all-reduce"]
    if pp > 1:
        names += ["layernorm-grads-all-reduce", "embedding-grads-all-reduce",
                  "optimizer-clip-main-grad"]
    return names


# One check per injection keyword, in the order they run (KEYWORDS).
_CHECKS: dict[str, Callable[[Any, Job], Any]] = {
    "slow_worker": _slow_worker, "heavy_last_stage": _heavy_last_stage,
    "seq_imbalance": _seq_imbalance, "gc": _gc, "slow_link": _slow_link,
    "host_stall": _host_stall, "gc_in_compute": _gc}

