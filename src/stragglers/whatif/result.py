"""The typed result of one what-if analysis, and its JSON form (`stragglers analyze --json`).

`analyze()` returns an `AnalysisResult`. The cause detectors build `Where` and the diagnosis
builds `Finding`s, carried unchanged to every report (console, HTML, Perfetto), the monitor,
`advise` and JSON. The types are msgspec Structs: `to_dict()`/`to_json()` write them (NaN/inf
as null, int map keys as JSON strings), `from_dict()`/`from_json()` read them back strictly,
naming the field at fault, and `json_schema()` is the JSON Schema generated from them
(docs/result.schema.json). Schema 1 (before every field was always written) is read too.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Mapping
from typing import Any, Literal

import msgspec
import numpy as np

from stragglers.config import PlainObject
from stragglers.errors import InputError
from stragglers.trace.jsontypes import JsonObject
from stragglers.trace.model import Note
from stragglers.whatif.config import DECOMPOSE_SLOWDOWN, STRAGGLING_SLOWDOWN, DiagnosisConfig

# Version of the JSON layout: bump when a field changes meaning or is removed. 2: every field
# of every object is written (schema 1 left some out at their defaults); notes are objects.
SCHEMA_VERSION = 2
# The replay is trusted when it reproduces the measured step time within this (docs/whatif.md §5).
SIM_ERROR_LIMIT = 0.05
SOURCE = "analysis result"
Basis = Literal["alone", "after_others"]


class WorkerRef(msgspec.Struct):
    """One worker a finding names: DP rank, stage, and its global rank and host where known."""

    dp: int
    pp: int
    rank: int | None = None
    host: str | None = None


class Where(msgspec.Struct, omit_defaults=True):
    """Where a cause sits; every list empty means the whole job (written: the fields set)."""

    dp: list[int] = []
    pp: list[int] = []
    ranks: list[int] = []
    hosts: list[str] = []
    workers: list[WorkerRef] = []     # most severe first
    steps: list[int] = []             # an intermittent cause's steps (empty: every step)
    optypes: list[str] = []           # communication: the op types of the slow transfers
    scope: str | None = None          # "traced ranks": found among a partial trace's ranks only


class Interval(msgspec.Struct, array_like=True):
    """A bootstrap interval over steps, written [low, high]."""

    low: float
    high: float


class CapacityOption(msgspec.Struct):
    """What one capacity factor buys at the measured routing, and the tokens it drops."""

    speedup: float
    dropped: float


class Finding(msgspec.Struct):
    """One diagnosed cause: where it sits, why we think so, what fixing it buys.

    The fields are those of whatif/README.md ("The result of a diagnosis").
    """

    cause: str
    where: Where = msgspec.field(default_factory=Where)
    evidence: str = ""
    speedup_if_fixed: float | None = None   # what fixing it buys, on `basis`
    fix: str | None = None
    interval: Interval | None = None        # bootstrap interval of speedup_if_fixed
    upper_bound: bool = False               # the speedup is what a perfect fix would buy
    share: float | None = None              # fraction of the straggler excess it removes
    speedup_after_others: float | None = None  # fixing it once the other causes are fixed
    # expert_imbalance: per capacity factor ("1", "1.25", …) at the measured routing
    capacity_factor: dict[str, CapacityOption] | None = None
    speedup_alone: float | None = None      # fixing only this cause, as the job is
    basis: Basis | None = None              # what speedup_if_fixed assumes
    below_threshold: bool = False           # found in a job that is not straggling (evidence: why)

    @property
    def low(self) -> float | None:
        """The interval's lower end, or the point where one step gives no interval."""
        return self.interval.low if self.interval is not None else self.speedup_if_fixed


class SlowStep(msgspec.Struct):
    """One of the slowest steps, and the worker that computed longest in it against its stage's
    median worker (None where no worker took 5% longer: the step's time went elsewhere)."""

    step: int
    slowdown: float
    worker: WorkerRef | None = None
    ratio: float | None = None       # the worker's busy compute / its stage's median worker's


class LeftOut(msgspec.Struct):
    """A worker left out of the analysis, and why (whatif/README.md "Workers whose ops differ")."""

    dp: int
    pp: int
    rank: int | None = None
    host: str | None = None
    # "ops_differ": its op set differs from its stage peers' majority; "replica": it is a worker
    # of a DP replica left out for another worker's ops (the engine analyses whole replicas)
    reason: Literal["ops_differ", "replica"] = "ops_differ"
    missing: list[str] = []    # ops its stage's majority ran that it lacks ("barrier #0")
    extra: list[str] = []      # ops it ran that no majority of its stage ran
    steps: list[int] = []      # the steps where its ops differ


class DiagnosisSummary(msgspec.Struct):
    """All listed causes together: the combined prediction and what is left unexplained."""

    all_fixed: float | None = None            # speedup with every listed cause fixed
    all_fixed_interval: Interval | None = None
    explained: float | None = None            # fraction of the straggler excess they remove
    unexplained: float | None = None          # 1 − explained, at least 0
    noise_floor: float | None = None          # S that measurement jitter alone gives this job


class WorkerScore(msgspec.Struct):
    """S_w of one worker (docs/whatif.md §7), with its global rank and host where known."""

    dp: int
    pp: int
    score: float
    rank: int | None = None
    host: str | None = None


class JobInfo(msgspec.Struct):
    """What was analysed: the job's shape and which of its workers the trace holds."""

    name: str = "unnamed job"
    run_id: str = "0"
    dp: int | None = None
    pp: int | None = None
    tp: int | None = None
    dsp: int | None = None
    vpp: int | None = None
    world_size: int | None = None
    steps: int | None = None          # steps analysed
    ops: int | None = None            # ops in the analysed steps
    source: str | None = None
    ranks_read: int | None = None     # distinct global ranks in the trace
    workers_read: int | None = None   # distinct (dp, pp) workers in the trace
    missing_workers: list[tuple[int, int]] = []  # (dp, pp) of dp·pp not traced (the first
    # MAX_LISTED_MISSING of them: a meta.json may declare 2^29 workers over four rank files)
    missing_count: int | None = None  # how many are missing in all (None: results before it)
    # the job's parallel degrees (dp, tp, cp, ep, pp) where the trace gives them: a trace of a
    # tensor-/context-parallel job has a worker (column) per TP/CP rank, so `dp` above counts
    # dp·tp·cp of them there, and this says what the mesh was (dp 2 × tp 2, not dp 4)
    parallel: dict[str, int] = {}


_JSON_NAMES = {"t_base": "T_base", "t_nodelay": "T_nodelay", "t_ideal": "T_ideal",
               "m_w": "M_W", "m_s": "M_S"}


class AnalysisResult(msgspec.Struct, rename=_JSON_NAMES):
    """S, its decompositions, M_W/M_S, the diagnosis and what the reader noted (docs/whatif.md §5–§7)."""

    slowdown: float
    job: JobInfo = msgspec.field(default_factory=JobInfo)
    waste: float | None = None
    straggling: bool | None = None          # None on a partial trace: unknown, not false
    straggling_threshold: float = STRAGGLING_SLOWDOWN
    # the trace holds only some ranks of its job (docs/whatif.md §7): no job-wide verdict
    partial: bool = False
    sim_error: float | None = None
    launch_slowdown: float | None = None   # mean T_base / mean T_nodelay
    t_base: float | None = None
    t_nodelay: float | None = None
    t_ideal: float | None = None
    step_slowdown: dict[int, float] = {}
    slowest_steps: list[SlowStep] = []     # the top steps by slowdown, with who computed longest
    step_times: dict[str, dict[int, float]] = {}
    ideal_durations: dict[str, float] = {}
    by_optype: dict[str, float] = {}
    by_stage: dict[int, float] = {}
    by_dp_rank: dict[int, float] = {}
    worker_scores: list[WorkerScore] = []
    m_w: float | None = None
    m_s: float | None = None
    diagnosis: list[Finding] = []
    diagnosis_summary: DiagnosisSummary | None = None
    steps_analysed: list[int] = []
    warmup_steps: list[int] = []   # left out as warm-up
    diagnosis_config: DiagnosisConfig | None = None   # the thresholds the diagnosis used
    warnings: list[str] = []
    notes: list[Note] = []
    # workers not analysed because their ops differ from their stage peers' (and the other
    # workers of their DP replicas); the result is then partial
    left_out: list[LeftOut] = []

    def __post_init__(self) -> None:
        if self.waste is None and self.slowdown is not None and self.slowdown > 0:
            self.waste = 1.0 - 1.0 / self.slowdown
        if self.straggling is None and not self.partial:
            self.straggling = self.slowdown >= self.straggling_threshold

    def __repr__(self) -> str:  # the whole repr is pages long: say what matters
        causes = ", ".join(f.cause for f in self.diagnosis) or "no diagnosis"
        return (f"AnalysisResult(job={self.job.name!r}, slowdown={self.slowdown:.4f}, "
                f"straggling={self.straggling}, diagnosis=[{causes}], notes={len(self.notes)})")

    @property
    def decomposed(self) -> bool:
        """Whether the attribution (by op type, stage, DP rank or worker) is present."""
        return bool(self.by_optype or self.by_stage or self.by_dp_rank or self.worker_scores)

    @property
    def decompose_threshold(self) -> float:
        """The S from which attribution is computed (docs/whatif.md §7)."""
        return DECOMPOSE_SLOWDOWN

    @property
    def sim_error_high(self) -> bool:
        """The replay missed the measured step time by more than SIM_ERROR_LIMIT."""
        return self.sim_error is not None and self.sim_error > SIM_ERROR_LIMIT

    def to_dict(self) -> PlainObject:
        """The JSON form as plain Python (int map keys kept; NaN/inf become None)."""
        return {"schema_version": SCHEMA_VERSION,
                **_finite(msgspec.to_builtins(self, enc_hook=_numpy_value))}

    def to_json(self, indent: int | None = 2) -> str:
        """The result as strict JSON (no NaN/Infinity tokens)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, raw: Any, source: str = SOURCE) -> "AnalysisResult":
        """Read a result's JSON form back (schema 1 or 2); a bad field is an InputError naming it."""
        if not isinstance(raw, Mapping):
            raise InputError(source, None, f"expected a JSON object, got {type(raw).__name__}")
        version = raw.get("schema_version", SCHEMA_VERSION)
        if not isinstance(version, int) or isinstance(version, bool) or version > SCHEMA_VERSION:
            raise InputError(source, "schema_version", f"{version!r} is newer than this version "
                             f"of stragglers reads (≤ {SCHEMA_VERSION})")
        raw = _upgraded(dict(raw), version, source)
        # Through JSON text, so JSON's string map keys become the declared int keys strictly.
        try:
            text = msgspec.json.encode(raw, enc_hook=_numpy_value)
        except (TypeError, OverflowError) as e:
            raise InputError(source, None, f"not a JSON value: {e}") from None
        try:
            return msgspec.json.decode(text, type=cls)
        except msgspec.ValidationError as e:
            field, problem = _field_of(str(e))
            raise InputError(source, field, problem) from None

    @classmethod
    def from_json(cls, text: str | bytes, source: str = SOURCE) -> "AnalysisResult":
        """Read `stragglers analyze --json` output; a bad field is an InputError naming it."""
        try:   # decoded once, straight into the types
            doc = msgspec.json.decode(text, type=_Document)
        except msgspec.MsgspecError:
            # not JSON, schema 1's plain-string notes, or a bad field: from_dict reads schema 1
            # and names what is wrong
            try:
                raw = json.loads(text)
            except ValueError as e:
                raise InputError(source, None, f"not JSON: {e}") from None
            return cls.from_dict(raw, source)
        if doc.schema_version > SCHEMA_VERSION:
            raise InputError(source, "schema_version", f"{doc.schema_version!r} is newer than "
                             f"this version of stragglers reads (≤ {SCHEMA_VERSION})")
        return cls(**{name: getattr(doc, name) for name in cls.__struct_fields__})


class _Document(AnalysisResult):
    """A result's JSON form as written: the result with the schema version it was written in."""

    schema_version: int = SCHEMA_VERSION


def json_schema() -> JsonObject:
    """The JSON Schema of `stragglers analyze --json`, generated from the types."""
    schema = msgspec.json.schema(AnalysisResult)
    body = schema["$defs"]["AnalysisResult"]
    body["properties"] = {"schema_version": {"const": SCHEMA_VERSION}, **body["properties"]}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"urn:stragglers:analysis-result:{SCHEMA_VERSION}",
            **schema}


def _upgraded(raw: dict[str, Any], version: int, source: str) -> dict[str, Any]:
    """A schema-1 object in schema 2's form: notes given as plain strings become objects."""
    if version < 2 and isinstance(raw.get("notes"), list):
        raw["notes"] = [{"kind": "other", "message": n} if isinstance(n, str) else n
                        for n in raw["notes"]]
    raw.pop("schema_version", None)
    return raw


_AT = re.compile(r" - at (?:`key` in )?`\$([^`]*)`$")
_MISSING_FIELD = re.compile(r"missing required field `([^`]+)`")


def _field_of(message: str) -> tuple[str | None, str]:
    """(field path, problem) from a msgspec validation message ('... - at `$.a[0].b`')."""
    at = _AT.search(message)
    problem = message[:at.start()] if at else message
    path = at.group(1).lstrip(".").replace("[...]", "") if at else ""
    missing = _MISSING_FIELD.search(problem)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
        problem = "missing"
    return path or None, problem[:1].lower() + problem[1:]


def _numpy_value(value: Any) -> Any:
    """numpy scalars and arrays as Python values (msgspec's hook for types it does not know)."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise NotImplementedError(f"cannot write {type(value).__name__} into JSON")


def _finite(value: Any) -> Any:
    """A copy with NaN/inf floats as None (strict JSON has no token for them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def plain(value: Any, *, str_keys: bool = False) -> Any:
    """A copy with only JSON-ready Python values: numpy scalars unwrapped, NaN/inf → None
    (`str_keys`: map keys as text, as JSON writes them)."""
    return _finite(msgspec.to_builtins(value, enc_hook=_numpy_value, str_keys=str_keys))


# the missing workers a result lists (their count is whole)
MAX_LISTED_MISSING = 4096


def job_info(trace: Any, steps: int, ops: int, left_out: list[LeftOut] | None = None) -> JobInfo:
    """The job facts of a trace: shape from its metadata, and which workers it really holds
    (the workers `left_out` of the analysis count as not held: the result is partial)."""
    meta, o = trace.meta, trace.ops
    pp = max(int(meta.pp_size), int(o["stage"].max()) + 1 if len(o["stage"]) else 1)
    cells = np.unique(o["dp_rank"].astype(np.int64) * pp + o["stage"])
    have = {(int(c // pp), int(c % pp)) for c in cells} - {(w.dp, w.pp) for w in left_out or []}
    gone = {w.rank for w in left_out or [] if w.rank is not None}
    inside = sum(1 for d, _ in have if d < meta.dp_size)
    # the declared grid walked only until MAX_LISTED_MISSING are found (a set of every
    # declared worker held GBs for a meta.json of 2^29 DP ranks)
    missing = list(itertools.islice(((d, p) for d in range(meta.dp_size) for p in range(pp)
                                     if (d, p) not in have), MAX_LISTED_MISSING))
    return JobInfo(name=str(meta.name), run_id=str(meta.run_id), dp=meta.dp_size,
                   pp=meta.pp_size, tp=meta.tp_size, dsp=meta.dsp_size, vpp=meta.vpp_size,
                   world_size=meta.world_size, steps=int(steps), ops=int(ops),
                   source=str(trace.source),
                   ranks_read=int(len(np.setdiff1d(o["rank"], list(gone)) if gone
                                      else np.unique(o["rank"]))),
                   workers_read=len(have), missing_workers=missing,
                   missing_count=int(meta.dp_size) * pp - inside,
                   parallel=parallel_degrees(meta))


def parallel_degrees(meta: Any) -> dict[str, int]:
    """The job's parallel degrees from its metadata ({} where nothing says more than the
    DP × PP table): the recorder's mesh (`extra.parallel`), else the model-parallel groups a
    reader found (`extra.group_sizes`; the table's dp then counts dp·tp·cp workers)."""
    extra = meta.extra if isinstance(meta.extra, dict) else {}
    given = extra.get("parallel")
    if isinstance(given, dict):
        out = {k: int(v) for k, v in given.items() if k in _DEGREES and _positive_int(v)}
        return {k: out[k] for k in _DEGREES if k in out}
    groups = extra.get("group_sizes")
    if not isinstance(groups, dict) or not groups:
        return {}
    sizes = {k: int(v) for k, v in groups.items() if k in _DEGREES and _positive_int(v)}
    tp, cp = sizes.get("tp", 1), sizes.get("cp", 1)
    workers, pp = int(meta.dp_size), int(meta.pp_size)
    if workers % (tp * cp):  # the groups do not tile the table: say only what they show
        return {k: sizes[k] for k in _DEGREES if k in sizes}
    out = {"dp": workers // (tp * cp), "tp": tp, "cp": cp, "ep": sizes.get("ep", 1), "pp": pp}
    return {k: out[k] for k in _DEGREES}


_DEGREES = ("dp", "tp", "cp", "ep", "pp")


def _positive_int(value: Any) -> bool:
    """An int ≥ 1 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def reader_notes(trace: Any) -> list[Note]:
    """The reader's notes of a trace (Trace.notes; older readers left strings in meta.extra)."""
    notes = list(trace.notes)
    if not notes:
        notes = [Note("other", str(m)) for m in trace.meta.extra.get("notes") or []]
    return notes
