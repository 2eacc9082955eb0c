"""The facts every report shows, read and checked once from an analysis result dict."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from stragglers.errors import InputError
from stragglers.whatif.diagnosis import FIXES

# Thresholds of specs/whatif.md §5 and §7.
STRAGGLING_SLOWDOWN = 1.1
DECOMPOSITION_SLOWDOWN = 1.03
SIM_ERROR_LIMIT = 0.05
# The heatmap colour scale of SMon (specs/whatif.md §9).
HEATMAP_RANGE = (1.0, 1.5)

CAUSE_TITLES = {
    "worker_fault": "Worker fault",
    "stage_imbalance": "Stage partitioning imbalance",
    "sequence_imbalance": "Sequence-length imbalance",
    "gc": "Garbage-collection pauses",
    "communication": "Communication straggler",
    "none": "No straggler",
}
SOURCE = "analysis result"


@dataclass
class Finding:
    """One diagnosed cause, ready to print."""

    cause: str
    title: str
    where: str
    evidence: str
    speedup_if_fixed: float | None
    advice: str


@dataclass
class Summary:
    """A checked, display-ready view of an analysis result dict."""

    job_name: str
    job: dict[str, Any]
    slowdown: float
    waste: float
    sim_error: float | None
    launch_slowdown: float | None
    step_times: dict[str, float | None]
    m_w: float | None
    m_s: float | None
    step_slowdown: list[tuple[int, float]]
    by_optype: list[tuple[str, float]]
    by_stage: list[tuple[int, float]]
    by_dp_rank: list[tuple[int, float]]
    dp_ranks: list[int]
    stages: list[int]
    worker_grid: np.ndarray  # [stage, dp] → S_w, NaN where missing
    diagnosis: list[Finding]
    warnings: list[str] = field(default_factory=list)

    @property
    def straggling(self) -> bool:
        """S ≥ 1.1: the job counts as straggling."""
        return self.slowdown >= STRAGGLING_SLOWDOWN

    @property
    def decomposed(self) -> bool:
        """Whether the attribution (by op type, stage, rank, worker) is present."""
        return bool(self.by_optype or self.by_stage or self.by_dp_rank or self.worker_grid.size)

    @property
    def sim_error_high(self) -> bool:
        """The replay missed the measured step time by more than 5%."""
        return self.sim_error is not None and self.sim_error > SIM_ERROR_LIMIT

    def attribution_note(self) -> str:
        """Why a result has no attribution tables."""
        if self.slowdown < DECOMPOSITION_SLOWDOWN:
            return (f"Attribution skipped: S = {fmt(self.slowdown)} < {DECOMPOSITION_SLOWDOWN}, "
                    "so there is no slowdown worth splitting up.")
        return "This result carries no attribution (by op type, stage, DP rank or worker)."

    def hottest_workers(self, k: int = 5) -> list[tuple[int, int, float]]:
        """The k workers with the highest S_w as (dp, pp, S_w)."""
        grid = self.worker_grid
        if not grid.size:
            return []
        flat = np.where(np.isnan(grid), -np.inf, grid).ravel()
        order = np.argsort(-flat, kind="stable")[:k]
        return [(self.dp_ranks[i % grid.shape[1]], self.stages[i // grid.shape[1]], float(flat[i]))
                for i in order if np.isfinite(flat[i])]


def summarize(result: Mapping[str, Any]) -> Summary:
    """Check an analysis result dict (as `stragglers analyze --json` writes it) and tidy it."""
    if not isinstance(result, Mapping):
        raise InputError(SOURCE, None, f"expected a JSON object, got {type(result).__name__}")
    slowdown = _number(result, "slowdown", required=True)
    waste = _number(result, "waste")
    if waste is None:
        waste = 1.0 - 1.0 / slowdown if slowdown > 0 else 0.0
    job = result.get("job") or {}
    if not isinstance(job, Mapping):
        raise InputError(SOURCE, "job", f"expected an object, got {type(job).__name__}")
    dp_ranks, stages, grid = _worker_grid(result.get("worker_scores"))
    warnings = result.get("warnings") or []
    if not isinstance(warnings, list):
        raise InputError(SOURCE, "warnings", "expected a list of strings")
    return Summary(
        job_name=str(job.get("name") or "unnamed job"),
        job=dict(job),
        slowdown=slowdown,
        waste=waste,
        sim_error=_number(result, "sim_error"),
        launch_slowdown=_number(result, "launch_slowdown"),
        step_times={k: _number(result, k) for k in ("T_base", "T_nodelay", "T_ideal")},
        m_w=_number(result, "M_W"),
        m_s=_number(result, "M_S"),
        step_slowdown=sorted(_int_map(result, "step_slowdown").items()),
        by_optype=sorted(_str_map(result, "by_optype").items(), key=lambda kv: -kv[1]),
        by_stage=sorted(_int_map(result, "by_stage").items()),
        by_dp_rank=sorted(_int_map(result, "by_dp_rank").items()),
        dp_ranks=dp_ranks,
        stages=stages,
        worker_grid=grid,
        diagnosis=[_finding(i, d) for i, d in enumerate(result.get("diagnosis") or [])],
        warnings=[str(w) for w in warnings],
    )


def describe_where(where: Any) -> str:
    """Words for a diagnosis location such as {"dp": [0], "pp": [3], "steps": [5, 9]}."""
    if not where:
        return "whole job"
    if not isinstance(where, Mapping):
        return str(where)
    labels = {"dp": "DP rank", "pp": "PP stage", "steps": "step", "optypes": "op type"}
    parts = []
    where = dict(where)
    dp, pp = where.get("dp"), where.get("pp")
    if isinstance(dp, list) and isinstance(pp, list) and len(dp) == 1 and len(pp) == 1:
        # One DP rank and one stage name one worker.
        parts.append(f"worker dp {dp[0]} / pp {pp[0]}")
        del where["dp"], where["pp"]
    for key, values in where.items():
        items = list(values) if isinstance(values, (list, tuple)) else [values]
        label = labels.get(key, key)
        shown = ", ".join(str(v) for v in items[:8]) + (f", … ({len(items)} in all)"
                                                        if len(items) > 8 else "")
        parts.append(f"{label}{'s' if len(items) > 1 else ''} {shown}")
    return "; ".join(parts)


def fmt(value: float | None, spec: str = ".3f", missing: str = "—") -> str:
    """A number formatted with spec, or a dash when it is missing or not finite."""
    if value is None or not math.isfinite(value):
        return missing
    return format(value, spec)


def fmt_seconds(value: float | None) -> str:
    """A duration in s or ms, whichever reads better."""
    if value is None or not math.isfinite(value):
        return "—"
    return f"{value * 1e3:.1f} ms" if abs(value) < 1 else f"{value:.3f} s"


def _number(result: Mapping[str, Any], key: str, required: bool = False) -> float | None:
    value = result.get(key)
    if value is None:
        if required:
            raise InputError(SOURCE, key, "missing; expected a number")
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
        raise InputError(SOURCE, key, f"expected a number, got {value!r}")
    return float(value)


def _raw_map(result: Mapping[str, Any], key: str) -> Mapping[Any, Any]:
    value = result.get(key) or {}
    if not isinstance(value, Mapping):
        raise InputError(SOURCE, key, f"expected an object, got {type(value).__name__}")
    return value


def _int_map(result: Mapping[str, Any], key: str) -> dict[int, float]:
    # JSON turns integer keys into strings: accept both.
    out: dict[int, float] = {}
    for k, v in _raw_map(result, key).items():
        try:
            out[int(k)] = float(v)
        except (TypeError, ValueError):
            raise InputError(SOURCE, key, f"expected integer keys and numbers, got {k!r}: {v!r}")
    return out


def _str_map(result: Mapping[str, Any], key: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for k, v in _raw_map(result, key).items():
        try:
            out[str(k)] = float(v)
        except (TypeError, ValueError):
            raise InputError(SOURCE, key, f"expected numbers, got {k!r}: {v!r}")
    return out


def _worker_grid(scores: Any) -> tuple[list[int], list[int], np.ndarray]:
    if not scores:
        return [], [], np.zeros((0, 0))
    if not isinstance(scores, list):
        raise InputError(SOURCE, "worker_scores", "expected a list of {dp, pp, score}")
    try:
        cells = [(int(s["dp"]), int(s["pp"]), float(s["score"])) for s in scores]
    except (KeyError, TypeError, ValueError):
        raise InputError(SOURCE, "worker_scores", "expected a list of {dp, pp, score} objects")
    dp_ranks = sorted({c[0] for c in cells})
    stages = sorted({c[1] for c in cells})
    col = {d: i for i, d in enumerate(dp_ranks)}
    row = {p: i for i, p in enumerate(stages)}
    grid = np.full((len(stages), len(dp_ranks)), np.nan)
    for d, p, s in cells:
        grid[row[p], col[d]] = s
    return dp_ranks, stages, grid


def _finding(index: int, entry: Any) -> Finding:
    if not isinstance(entry, Mapping) or "cause" not in entry:
        raise InputError(SOURCE, f"diagnosis[{index}]", "expected an object with a 'cause'")
    cause = str(entry["cause"])
    speedup = entry.get("speedup_if_fixed")
    if speedup is not None:
        try:
            speedup = float(speedup)
        except (TypeError, ValueError):
            raise InputError(SOURCE, f"diagnosis[{index}].speedup_if_fixed",
                             f"expected a number or null, got {speedup!r}")
    return Finding(
        cause=cause,
        title=CAUSE_TITLES.get(cause, cause.replace("_", " ").capitalize()),
        where=describe_where(entry.get("where")),
        evidence=str(entry.get("evidence") or ""),
        speedup_if_fixed=speedup,
        # The diagnosis names the fix; older result files without it get the standard one.
        advice=str(entry.get("fix") or FIXES.get(cause, "")),
    )
