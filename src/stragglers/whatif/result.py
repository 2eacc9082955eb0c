"""The typed result of one what-if analysis, and its JSON form (`stragglers analyze --json`).

`analyze()` returns an `AnalysisResult`; every report (console, HTML, Perfetto, --json) reads it.
`to_dict()` gives plain Python values (int map keys, no numpy scalars, None for NaN/inf) under
the JSON field names; `to_json()` writes them with `schema_version`. `from_dict()` reads such a
JSON object back (a saved result, an older schema), naming the field at fault. Item access by
JSON name (`result["slowdown"]`, `result["diagnosis"][0]["cause"]`) keeps older callers working.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from stragglers.errors import InputError
from stragglers.whatif.config import DECOMPOSE_SLOWDOWN, STRAGGLING_SLOWDOWN

# Version of the JSON layout: bump when a field changes meaning or is removed.
SCHEMA_VERSION = 1
# The replay is trusted when it reproduces the measured step time within this (docs/whatif.md §5).
SIM_ERROR_LIMIT = 0.05
SOURCE = "analysis result"


def plain(value: Any) -> Any:
    """A copy with only JSON-ready Python values: numpy scalars unwrapped, NaN/inf → None."""
    if isinstance(value, Mapping):
        return {_plain_key(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [plain(v) for v in value]
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, str):
        return str(value)  # np.str_ becomes a plain str
    if value is None:
        return None
    if hasattr(value, "to_dict"):
        return plain(value.to_dict())
    return str(value)


def _plain_key(key: Any) -> Any:
    if isinstance(key, (np.integer, int)) and not isinstance(key, bool):
        return int(key)
    return str(key)


class _ByName:
    """Read access by JSON field name, for callers written against the old result dict."""

    _JSON_NAMES: ClassVar[dict[str, str]] = {}

    def __getitem__(self, key: str) -> Any:
        attr = self._JSON_NAMES.get(key, key)
        declared = {f.name: f for f in fields(self) if f.name != "extra"}  # type: ignore[arg-type]
        if attr in declared:
            if _omitted(declared[attr], getattr(self, attr)):
                raise KeyError(key)  # as in the JSON form, which leaves it out
            return getattr(self, attr)
        return self.extra[key]  # type: ignore[attr-defined]

    def get(self, key: str, default: Any = None) -> Any:
        """The field called `key` in the JSON form, or default."""
        try:
            return self[key]
        except KeyError:
            return default

    def __contains__(self, key: object) -> bool:
        return self.get(key, _MISSING) is not _MISSING  # type: ignore[arg-type]


_MISSING = object()


def when_set(default: Any) -> Any:
    """A field declared after the first schema: written to JSON only when it differs from default."""
    return field(default=default, metadata={"json": "when set"})


def _omitted(f: Any, value: Any) -> bool:
    """Whether the JSON form leaves out this field's value (a when_set field at its default)."""
    return f.metadata.get("json") == "when set" and value == f.default


@dataclass
class JobInfo(_ByName):
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
    missing_workers: list[list[int]] = field(default_factory=list)  # [dp, pp] of dp·pp not traced
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class WorkerScore(_ByName):
    """S_w of one worker (docs/whatif.md §7), with what else the analysis knows of it (rank, host)."""

    dp: int
    pp: int
    score: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Finding(_ByName):
    """One diagnosed cause: where it sits, why we think so, what fixing it buys.

    The fields are those of whatif/README.md ("The result of a diagnosis").
    """

    cause: str
    where: dict[str, Any] = field(default_factory=dict)  # dp, pp, ranks, hosts, workers, steps
    evidence: str = ""
    speedup_if_fixed: float | None = None   # fixing only this cause (its own share)
    fix: str | None = None
    interval: list[float] | None = None     # bootstrap interval of speedup_if_fixed
    upper_bound: bool = False               # the speedup is what a perfect fix would buy
    share: float | None = None              # fraction of the straggler excess it removes
    speedup_after_others: float | None = None  # fixing it once the other causes are fixed
    # Declared later, so written only when set (a verdict such as `none` has none of them):
    # expert_imbalance: per capacity factor C ("1", "1.25", …), {"speedup", "dropped"} at the
    # measured routing
    capacity_factor: dict[str, dict[str, float]] | None = when_set(None)
    speedup_alone: float | None = when_set(None)  # fixing only this cause, as the job is
    basis: str | None = when_set(None)  # "alone" | "after_others": what speedup_if_fixed assumes
    below_threshold: bool = when_set(False)  # found in a job that is not straggling (evidence: why)
    # Fields a newer diagnosis adds beyond these, kept as given.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class DiagnosisSummary(_ByName):
    """All listed causes together: the combined prediction and what is left unexplained."""

    all_fixed: float | None = None            # speedup with every listed cause fixed
    all_fixed_interval: list[float] | None = None
    explained: float | None = None            # fraction of the straggler excess they remove
    unexplained: float | None = None          # 1 − explained, at least 0
    noise_floor: float | None = None          # S that measurement jitter alone gives this job
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class AnalysisResult(_ByName):
    """S, its decompositions, M_W/M_S, the diagnosis and what the reader noted (docs/whatif.md §5–§7)."""

    _JSON_NAMES: ClassVar[dict[str, str]] = {
        "T_base": "t_base", "T_nodelay": "t_nodelay", "T_ideal": "t_ideal",
        "M_W": "m_w", "M_S": "m_s"}

    slowdown: float
    job: JobInfo = field(default_factory=JobInfo)
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
    step_slowdown: dict[int, float] = field(default_factory=dict)
    step_times: dict[str, dict[int, float]] = field(default_factory=dict)
    ideal_durations: dict[str, float] = field(default_factory=dict)
    by_optype: dict[str, float] = field(default_factory=dict)
    by_stage: dict[int, float] = field(default_factory=dict)
    by_dp_rank: dict[int, float] = field(default_factory=dict)
    worker_scores: list[WorkerScore] = field(default_factory=list)
    m_w: float | None = None
    m_s: float | None = None
    diagnosis: list[Finding] = field(default_factory=list)
    diagnosis_summary: DiagnosisSummary | None = None
    steps_analysed: list[int] = field(default_factory=list)
    warmup_steps: list[int] = field(default_factory=list)   # left out as warm-up
    diagnosis_config: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    notes: list[dict[str, str]] = field(default_factory=list)  # the reader's, see Trace.notes
    # Top-level fields the analysis adds beyond these (e.g. a combined prediction), kept as given.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.waste is None and self.slowdown > 0:
            self.waste = 1.0 - 1.0 / self.slowdown
        if self.straggling is None and not self.partial:
            self.straggling = self.slowdown >= self.straggling_threshold

    def __repr__(self) -> str:  # the whole dataclass repr is pages long: say what matters
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

    def to_dict(self) -> dict[str, Any]:
        """The JSON form as plain Python (int map keys kept; NaN/inf become None)."""
        out: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
        names = {v: k for k, v in self._JSON_NAMES.items()}
        for f in fields(self):
            if f.name != "extra":
                out[names.get(f.name, f.name)] = _to_plain(getattr(self, f.name))
        out.update(plain(self.extra))
        return out

    def to_json(self, indent: int | None = 2) -> str:
        """The result as strict JSON (no NaN/Infinity tokens)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, raw: Any, source: str = SOURCE) -> "AnalysisResult":
        """Read a result's JSON form back; a bad field is an InputError naming it."""
        if not isinstance(raw, Mapping):
            raise InputError(source, None, f"expected a JSON object, got {type(raw).__name__}")
        version = raw.get("schema_version", SCHEMA_VERSION)
        if not isinstance(version, int) or version > SCHEMA_VERSION:
            raise InputError(source, "schema_version", f"{version!r} is newer than this version "
                             f"of stragglers reads (≤ {SCHEMA_VERSION})")
        r = _Reader(raw, source)
        known = {"schema_version", *cls._JSON_NAMES,
                 *(f.name for f in fields(cls) if f.name not in cls._JSON_NAMES.values())}
        return cls(
            slowdown=r.number("slowdown", required=True),
            job=r.job(),
            waste=r.number("waste"),
            straggling=r.flag("straggling"),
            straggling_threshold=r.number("straggling_threshold") or STRAGGLING_SLOWDOWN,
            partial=bool(r.flag("partial")),
            sim_error=r.number("sim_error"),
            launch_slowdown=r.number("launch_slowdown"),
            t_base=r.number("T_base"), t_nodelay=r.number("T_nodelay"),
            t_ideal=r.number("T_ideal"),
            step_slowdown=r.number_map("step_slowdown", int),
            step_times={k: r.number_map(f"step_times.{k}", int, v)
                        for k, v in r.mapping("step_times").items()},
            ideal_durations=r.number_map("ideal_durations", str),
            by_optype=r.number_map("by_optype", str),
            by_stage=r.number_map("by_stage", int),
            by_dp_rank=r.number_map("by_dp_rank", int),
            worker_scores=r.worker_scores(),
            m_w=r.number("M_W"), m_s=r.number("M_S"),
            diagnosis=r.findings(),
            diagnosis_summary=r.diagnosis_summary(),
            steps_analysed=r.ints("steps_analysed"),
            warmup_steps=r.ints("warmup_steps"),
            diagnosis_config=dict(r.mapping("diagnosis_config")),
            warnings=r.strings("warnings"),
            notes=r.notes(),
            extra={k: v for k, v in raw.items() if k not in known},
        )


def _to_plain(value: Any) -> Any:
    if isinstance(value, _ByName):
        return _record(value)
    if isinstance(value, list):
        return [_to_plain(v) for v in value]
    return plain(value)


def _record(obj: _ByName) -> dict[str, Any]:
    """A JobInfo / WorkerScore / Finding as a plain dict, its extras merged in."""
    out = {f.name: plain(getattr(obj, f.name)) for f in fields(obj)  # type: ignore[arg-type]
           if f.name != "extra" and not _omitted(f, getattr(obj, f.name))}
    out.update(plain(obj.extra))  # type: ignore[attr-defined]
    return out


class _Reader:
    """Typed reads of a result's JSON form, each error naming the field."""

    def __init__(self, raw: Mapping[str, Any], source: str):
        self.raw, self.source = raw, source

    def fail(self, key: str, problem: str) -> InputError:
        return InputError(self.source, key, problem)

    def number(self, key: str, required: bool = False, raw: Any = _MISSING) -> float | None:
        value = self.raw.get(key) if raw is _MISSING else raw
        if value is None:
            if required:
                raise self.fail(key, "missing; expected a number")
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self.fail(key, f"expected a number, got {value!r}")
        if not math.isfinite(value):
            raise self.fail(key, f"expected a finite number, got {value!r}")
        return float(value)

    def flag(self, key: str) -> bool | None:
        value = self.raw.get(key)
        if value is not None and not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {value!r}")
        return value

    def mapping(self, key: str, value: Any = _MISSING) -> Mapping[Any, Any]:
        value = (self.raw.get(key) if value is _MISSING else value) or {}
        if not isinstance(value, Mapping):
            raise self.fail(key, f"expected an object, got {type(value).__name__}")
        return value

    def number_map(self, key: str, key_type: type, value: Any = _MISSING) -> dict[Any, float]:
        # JSON turns integer keys into strings: accept both.
        out = {}
        for k, v in self.mapping(key, value).items():
            try:
                out[key_type(k)] = float(v)
            except (TypeError, ValueError):
                raise self.fail(key, f"expected {'integer keys and ' if key_type is int else ''}"
                                f"numbers, got {k!r}: {v!r}") from None
        return out

    def strings(self, key: str) -> list[str]:
        value = self.raw.get(key) or []
        if not isinstance(value, list):
            raise self.fail(key, "expected a list of strings")
        return [str(v) for v in value]

    def records(self, key: str) -> list[Mapping[str, Any]]:
        value = self.raw.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
            raise self.fail(key, "expected a list of objects")
        return value

    def job(self) -> JobInfo:
        raw = dict(self.mapping("job"))
        values: dict[str, Any] = {}
        for f in fields(JobInfo):
            v = raw.get(f.name)
            if f.name == "extra" or v is None:
                continue
            if f.type == "int | None" and (isinstance(v, bool) or not isinstance(v, int)):
                raise self.fail(f"job.{f.name}", f"expected an integer, got {v!r}")
            if f.name == "missing_workers" and not (isinstance(v, list) and all(
                    isinstance(c, list) and len(c) == 2 for c in v)):
                raise self.fail("job.missing_workers", "expected a list of [dp, pp]")
            values[f.name] = str(v) if f.type in ("str", "str | None") else v
        return JobInfo(**values, extra={k: v for k, v in raw.items() if k not in values
                                        and k not in {f.name for f in fields(JobInfo)}})

    def worker_scores(self) -> list[WorkerScore]:
        out = []
        for s in self.records("worker_scores"):
            try:
                out.append(WorkerScore(int(s["dp"]), int(s["pp"]), float(s["score"]),
                                       {k: v for k, v in s.items() if k not in ("dp", "pp", "score")}))
            except (KeyError, TypeError, ValueError):
                raise self.fail("worker_scores", "expected a list of {dp, pp, score} "
                                "objects") from None
        return out

    def findings(self) -> list[Finding]:
        out = []
        for i, entry in enumerate(self.records("diagnosis")):
            if "cause" not in entry:
                raise self.fail(f"diagnosis[{i}]", "expected an object with a 'cause'")
            where = entry.get("where") or {}
            if not isinstance(where, Mapping):
                raise self.fail(f"diagnosis[{i}].where", f"expected an object, got {where!r}")
            out.append(self.record(Finding, entry, f"diagnosis[{i}]"))
        return out

    def diagnosis_summary(self) -> DiagnosisSummary | None:
        raw = self.raw.get("diagnosis_summary")
        return None if raw is None else self.record(DiagnosisSummary, self.mapping(
            "diagnosis_summary"), "diagnosis_summary")

    def record(self, cls: type, entry: Mapping[str, Any], key: str) -> Any:
        """A Finding / DiagnosisSummary from its JSON object, each field type-checked."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "extra" or entry.get(f.name) is None:
                continue
            v, where = entry[f.name], f"{key}.{f.name}"
            if f.type in ("float | None",):
                v = self.number(where, raw=v)
            elif f.type == "list[float] | None":
                if not (isinstance(v, list) and len(v) == 2):
                    raise self.fail(where, f"expected [low, high], got {v!r}")
                v = [self.number(where, required=True, raw=x) for x in v]
            elif f.type == "bool":
                if not isinstance(v, bool):
                    raise self.fail(where, f"expected true or false, got {v!r}")
            elif f.type == "dict[str, dict[str, float]] | None":
                v = self.table(where, v)
            elif f.type == "str" or f.type == "str | None":
                v = str(v)
            values[f.name] = v
        known = {f.name for f in fields(cls)}
        return cls(**values, extra={k: v for k, v in entry.items() if k not in known})

    def table(self, key: str, value: Any) -> dict[str, dict[str, float]]:
        """{name: {name: number}}, as a finding's capacity_factor."""
        out = {}
        for k, row in self.mapping(key, value).items():
            if not isinstance(row, Mapping):
                raise self.fail(f"{key}.{k}", f"expected an object of numbers, got {row!r}")
            out[str(k)] = {str(n): self.number(f"{key}.{k}.{n}", True, x) for n, x in row.items()}
        return out

    def ints(self, key: str) -> list[int]:
        value = self.raw.get(key) or []
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool)
                                                  for v in value):
            raise self.fail(key, "expected a list of integers")
        return list(value)

    def notes(self) -> list[dict[str, str]]:
        out = []
        for note in self.raw.get("notes") or []:
            if isinstance(note, str):  # a reader that gave plain strings
                out.append({"kind": "other", "message": note})
            elif isinstance(note, Mapping) and "message" in note:
                out.append({"kind": str(note.get("kind", "other")), "message": str(note["message"])})
            else:
                raise self.fail("notes", "expected a list of {kind, message} objects")
        return out


def job_info(trace: Any, steps: int, ops: int) -> JobInfo:
    """The job facts of a trace: shape from its metadata, and which workers it really holds."""
    meta, o = trace.meta, trace.ops
    pp = max(int(meta.pp_size), int(o["stage"].max()) + 1 if len(o["stage"]) else 1)
    cells = np.unique(o["dp_rank"].astype(np.int64) * pp + o["stage"])
    expected = {(d, p) for d in range(meta.dp_size) for p in range(pp)}
    have = {(int(c // pp), int(c % pp)) for c in cells}
    return JobInfo(name=str(meta.name), run_id=str(meta.run_id), dp=meta.dp_size,
                   pp=meta.pp_size, tp=meta.tp_size, dsp=meta.dsp_size, vpp=meta.vpp_size,
                   world_size=meta.world_size, steps=int(steps), ops=int(ops),
                   source=str(trace.source), ranks_read=int(len(np.unique(o["rank"]))),
                   workers_read=len(have),
                   missing_workers=[[d, p] for d, p in sorted(expected - have)])


def findings_from(entries: list[Mapping[str, Any]]) -> list[Finding]:
    """Diagnosis records (dicts from `diagnose`) as Findings, unknown fields kept in extra."""
    known = {f.name for f in fields(Finding)} - {"extra"}
    out = []
    for e in entries:
        e = plain(e)
        out.append(Finding(**{k: v for k, v in e.items() if k in known and v is not None},
                           extra={k: v for k, v in e.items() if k not in known}))
        out[-1].cause, out[-1].evidence = str(out[-1].cause), str(out[-1].evidence or "")
    return out


def summary_from(summary: Mapping[str, Any] | None) -> DiagnosisSummary | None:
    """The diagnosis summary dict as a DiagnosisSummary."""
    if summary is None:
        return None
    known = {f.name for f in fields(DiagnosisSummary)} - {"extra"}
    summary = plain(summary)
    return DiagnosisSummary(**{k: v for k, v in summary.items() if k in known},
                            extra={k: v for k, v in summary.items() if k not in known})


def scores_from(entries: list[Mapping[str, Any]]) -> list[WorkerScore]:
    """Worker-score records ({dp, pp, score, ...}) as WorkerScores, extra fields kept."""
    return [WorkerScore(int(e["dp"]), int(e["pp"]), float(e["score"]),
                        plain({k: v for k, v in e.items() if k not in ("dp", "pp", "score")}))
            for e in entries]


def reader_notes(trace: Any) -> list[dict[str, str]]:
    """The reader's notes of a trace (Trace.notes; older readers left strings in meta.extra)."""
    notes = [dict(n) for n in trace.notes]
    if not notes:
        notes = [{"kind": "other", "message": str(m)} for m in trace.meta.extra.get("notes") or []]
    return notes
