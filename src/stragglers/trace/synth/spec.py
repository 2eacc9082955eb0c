"""`SynthSpec`: one synthetic job, its shape and its injected causes as typed values.

`generate(spec)` runs it. The keyword form (`generate(dp=4, slow_worker=(3, 0, 2.0), ...)`,
dicts and tuples per injection) is converted in one place, `SynthSpec.from_keywords`, and a
spec gives it back with `keywords()` (what the trace's metadata records as its generator).
The injections' bounds depend on the job's shape (a rank, a stage, a step must exist), so a
spec is checked whole when it is made: a bad value is one InputError naming the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence, TypedDict, TypeVar

from stragglers.config import Config, PlainObject, setting
from stragglers.errors import InputError
from stragglers.trace.synth.injections import (BY_NAME, GC, GCInCompute, HeavyLastStage,
                                               HostStall, HostStallForm, Injection,
                                               SeqImbalanceForm, SequenceImbalance,
                                               SlowCollective, SlowCollectiveForm, SlowLink,
                                               SlowLinkForm, SlowWorker)
from stragglers.trace.synth.validate import KEYWORDS, SOURCE, Job, check

_I = TypeVar("_I", bound=Injection)


class SynthKeywords(TypedDict):
    """The generator's keyword form of a spec (`generate(**keywords)`), `name` left out; an
    injection not given is None."""

    dp: int
    pp: int
    vpp: int
    microbatches: int
    steps: int
    sync: str
    seed: int
    noise: float
    slow_worker: tuple[int, int, float] | None
    heavy_last_stage: float | None
    seq_imbalance: SeqImbalanceForm | None
    gc: tuple[float, float] | None
    slow_link: SlowLinkForm | SlowCollectiveForm | None
    host_stall: HostStallForm | None
    gc_in_compute: tuple[float, float] | None
    stage_scale: list[float] | None
    launch_delay: float
    step_gap: float


@dataclass(frozen=True)
class SynthSpec(Config):
    """A synthetic Megatron-style job: its shape, its noise and its injected causes."""

    dp: int = setting(2, "data-parallel size", minimum=1)
    pp: int = setting(4, "pipeline-parallel size (stages)", minimum=1)
    vpp: int = setting(1, "model chunks per stage (interleaved schedule when > 1)", minimum=1)
    microbatches: int = setting(8, "microbatches per step", minimum=1)
    steps: int = setting(10, "training steps", minimum=1)
    sync: str = setting("zero", "DP gradient sync: zero (all-gather + reduce-scatter) or ddp "
                        "(all-reduce)", choices=("zero", "ddp"))
    seed: int = setting(0, "random seed (same seed, same trace)", minimum=0)
    noise: float = setting(0.02, "sigma of the multiplicative lognormal noise", minimum=0.0)
    launch_delay: float = setting(20e-6, "mean launch delay per op, seconds", minimum=0.0)
    step_gap: float = setting(1e-3, "host time between steps, seconds", minimum=0.0)
    name: str | None = setting(None, "job name (default: from the parameters)")
    stage_scale: Sequence[float] | None = setting(
        None, "the forward/backward work of each stage (a layer split; no cause by itself)")
    injections: tuple[Injection, ...] = setting((), "the injected causes, one of each kind")

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.stage_scale, list):   # as to_dict() writes it
            object.__setattr__(self, "stage_scale", tuple(self.stage_scale))
        if not isinstance(self.injections, (list, tuple)):
            raise InputError(SOURCE, "injections", f"expected a tuple of injections, got "
                             f"{self.injections!r}")
        object.__setattr__(self, "injections", tuple(self.injections))
        seen: dict[str, Injection] = {}
        for item in self.injections:
            if not isinstance(item, Injection):
                raise InputError(SOURCE, "injections", f"expected injections ("
                                 f"{', '.join(BY_NAME)}), got {item!r}")
            if item.keyword in seen:
                raise InputError(SOURCE, "injections", f"{type(seen[item.keyword]).__name__} and "
                                 f"{type(item).__name__} both set {item.keyword}; the generator "
                                 "takes one of each kind")
            seen[item.keyword] = item
        # checked whole now (ranks, stages and steps must exist); generate() reuses the result
        object.__setattr__(self, "_job", check(self))

    def keywords(self) -> SynthKeywords:
        """The generator's keyword form (a fresh copy; `name` left out, as the metadata does)."""
        worker, heavy, seq = (self.given(SlowWorker), self.given(HeavyLastStage),
                              self.given(SequenceImbalance))
        gc, stall, gc_in_compute = (self.given(GC), self.given(HostStall),
                                    self.given(GCInCompute))
        link = self.given(SlowLink) or self.given(SlowCollective)
        return SynthKeywords(
            dp=self.dp, pp=self.pp, vpp=self.vpp, microbatches=self.microbatches,
            steps=self.steps, sync=self.sync, seed=self.seed, noise=self.noise,
            slow_worker=None if worker is None else worker.value(),
            heavy_last_stage=None if heavy is None else heavy.value(),
            seq_imbalance=None if seq is None else seq.value(),
            gc=None if gc is None else gc.value(),
            slow_link=None if link is None else link.value(),
            host_stall=None if stall is None else stall.value(),
            gc_in_compute=None if gc_in_compute is None else gc_in_compute.value(),
            stage_scale=None if self.stage_scale is None else list(self.stage_scale),
            launch_delay=self.launch_delay, step_gap=self.step_gap)

    def given(self, kind: type[_I]) -> _I | None:
        """The injection of this class, or None (a subclass with another keyword, GCInCompute
        of GC, is not one)."""
        return next((item for item in self.injections
                     if isinstance(item, kind) and item.keyword == kind.keyword), None)

    def parameters(self) -> Job:
        """The spec checked whole, as the generator runs it (numbers normalised, steps sorted)."""
        job: Job = getattr(self, "_job")
        return job

    @classmethod
    def from_keywords(cls, **keywords: Any) -> "SynthSpec":
        """The one conversion of the keyword form (tuples and dicts per injection) into a spec."""
        injections = tuple(_injection(k, keywords.pop(k)) for k in KEYWORDS
                           if keywords.get(k) is not None)
        for k in KEYWORDS:
            keywords.pop(k, None)
        return cls.from_mapping({**keywords, "injections": injections}, SOURCE)

    def to_dict(self) -> PlainObject:
        """Plain values; each injection as {"type": class name, its fields} (YAML, JSON)."""
        out: PlainObject = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {**out, "stage_scale": None if self.stage_scale is None else list(self.stage_scale),
                "injections": [{"type": type(i).__name__, **dataclasses.asdict(i)}
                               for i in self.injections]}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any] | None, source: object = None) -> SynthSpec:
        """Build from a mapping; injections may be written as {"type": "SlowWorker", ...}."""
        values = dict(values or {})
        injections = values.get("injections")
        if isinstance(injections, (list, tuple)):
            values.update(injections=tuple(_from_mapping(i, source or SOURCE)
                                           for i in injections))
        return super().from_mapping(values, source)


def synth_spec(spec: SynthSpec | None, keywords: dict[str, Any]) -> SynthSpec:
    """What `generate` runs: the spec, changed by `keywords`, or the keyword form converted."""
    if spec is None:
        return SynthSpec.from_keywords(**keywords)
    if not isinstance(spec, SynthSpec):
        raise InputError(SOURCE, "spec", f"expected a SynthSpec, got {spec!r}")
    return spec.replace(**keywords) if keywords else spec


def _injection(keyword: str, value: Any) -> Injection:
    """One keyword-form injection as its typed value (shapes checked here, values by the spec)."""
    if keyword == "slow_worker":
        return SlowWorker(*_items(value, 3, keyword, "(dp_rank, stage, factor)"))
    if keyword == "heavy_last_stage":
        return HeavyLastStage(value)
    if keyword in ("gc", "gc_in_compute"):
        cls = GC if keyword == "gc" else GCInCompute
        return cls(*_items(value, 2, keyword, "(pauses per worker per step, pause seconds)"))
    if keyword == "seq_imbalance":
        value = {"dist": value} if isinstance(value, str) else value
        return _typed(SequenceImbalance, _keys(value, keyword, _field_names(SequenceImbalance),
                                               "a dict or a distribution name"))
    if keyword == "host_stall":
        return _typed(HostStall, _keys(value, keyword, {"dp", "stage", "seconds", "steps"},
                                       "{'dp', 'stage', 'seconds', 'steps' (optional)}"))
    return _slow_link(value)


def _slow_link(value: Any) -> Injection:
    shape = ("{'kind': 'p2p', 'dp', 'stage_from', 'stage_to', 'factor'} or {'kind': "
             "'collective', 'optype', 'stage', 'factor'}")
    fields = dict(value) if isinstance(value, Mapping) else {}
    kind = fields.pop("kind", None)
    if kind not in ("p2p", "collective"):
        raise InputError(SOURCE, "slow_link", f"expected {shape}")
    cls = SlowLink if kind == "p2p" else SlowCollective
    unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise InputError(SOURCE, "slow_link", f"unknown keys {sorted(unknown)}")
    return _typed(cls, fields)


def _typed(cls: type[Injection], fields: dict) -> Injection:
    """`cls` of these fields; a missing one is None, which the spec's check refuses by name."""
    missing = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
    return cls(**{**dict.fromkeys(missing - set(fields)), **fields})


def _field_names(cls: type[Injection]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _items(value: Any, count: int, keyword: str, shape: str) -> tuple:
    try:
        items = tuple(value)
    except TypeError:
        items = ()
    if len(items) != count:
        raise InputError(SOURCE, keyword, f"expected {shape}")
    return items


def _keys(value: Any, keyword: str, allowed: set[str], shape: str) -> dict:
    if not isinstance(value, Mapping):
        raise InputError(SOURCE, keyword, f"expected {shape}, got {value!r}")
    unknown = set(value) - allowed
    if unknown:
        raise InputError(SOURCE, keyword, f"unknown keys {sorted(unknown)}; expected "
                         f"{sorted(allowed)}")
    return dict(value)


def _from_mapping(item: Any, source: object) -> Injection:
    """{"type": "SlowWorker", "dp": 1, ...} (as to_dict writes it), or an Injection as is."""
    if isinstance(item, Injection):
        return item
    name = item.get("type") if isinstance(item, Mapping) else None
    if name not in BY_NAME:
        raise InputError(source, "injections", f"expected {{'type': one of {', '.join(BY_NAME)}, "
                         f"and its fields}}, got {item!r}")
    cls = BY_NAME[name]
    fields = {k: v for k, v in item.items() if k != "type"}
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise InputError(source, f"injections.{name}", f"unknown field {unknown[0]!r}; "
                         f"expected {', '.join(sorted(names))}")
    try:
        return cls(**fields)
    except TypeError:
        raise InputError(source, f"injections.{name}", f"expected the fields "
                         f"{', '.join(sorted(names))}, got {sorted(fields)}") from None
