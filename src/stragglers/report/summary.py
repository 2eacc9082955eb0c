"""What every report shows, worded once: an AnalysisResult laid out for people."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from stragglers import wording
from stragglers.trace.model import NOTE_KINDS
from stragglers.whatif.diagnosis import FIXES
from stragglers.whatif.result import AnalysisResult, Finding, Where, WorkerRef

# The heatmap colour scale of SMon (docs/monitor.md §4; the HTML report keeps SMon's fixed scale).
HEATMAP_RANGE = (1.0, 1.5)

CAUSE_TITLES = {
    "worker_fault": "Worker fault",
    "slow_group": "Slow group of workers (heterogeneous capacity)",
    "stage_imbalance": "Stage partitioning imbalance",
    "sequence_imbalance": "Sequence-length imbalance",
    "expert_imbalance": "Expert load imbalance (MoE routing)",
    "gc": "Garbage-collection pauses",
    "communication": "Communication straggler",
    "host_stall": "Host-side stall",
    "cpu_contention": "CPU contention",
    "unexplained": "Unexplained slowdown",
    "none": "No straggler",
    "partial": "Partial trace: no job-wide verdict",
}
NOTE_TITLES = {"ranks": "ranks", "layout": "layout", "clock": "clock alignment",
               "dropped": "dropped", "other": "note"}
# What "launch-delay slowdown" means (reports print it as "launch-delay slowdown = …").
LAUNCH_DELAY_MEANING = (
    "measured step time / step time replayed without launch delays (gaps before an op starts "
    "that no dependency explains: data loading, Python, host work). It comes on top of S and "
    "is not counted in it.")
WHERE_LABELS = {"dp": ("DP rank", "DP ranks"), "pp": ("PP stage", "PP stages"),
                "steps": ("step", "steps"), "optypes": ("op type", "op types"),
                "workers": ("worker", "workers"), "ranks": ("rank", "ranks"),
                "hosts": ("host", "hosts")}


def as_result(result: AnalysisResult | Mapping[str, Any]) -> AnalysisResult:
    """The result itself, or one read from its JSON form (a saved `--json` file)."""
    return result if isinstance(result, AnalysisResult) else AnalysisResult.from_dict(result)


@dataclass
class WorkerGrid:
    """S_w laid out as [stage, dp] (NaN where a worker has no score)."""

    dp_ranks: list[int]
    stages: list[int]
    values: np.ndarray

    @classmethod
    def of(cls, result: AnalysisResult) -> "WorkerGrid":
        """The grid of a result's worker scores."""
        cells = [(s.dp, s.pp, s.score) for s in result.worker_scores]
        dp_ranks = sorted({c[0] for c in cells})
        stages = sorted({c[1] for c in cells})
        col = {d: i for i, d in enumerate(dp_ranks)}
        row = {p: i for i, p in enumerate(stages)}
        values = np.full((len(stages), len(dp_ranks)), np.nan)
        for d, p, v in cells:
            values[row[p], col[d]] = v
        return cls(dp_ranks, stages, values)

    def hottest(self, k: int = 5) -> list[tuple[int, int, float]]:
        """The k workers with the highest S_w as (dp, pp, S_w)."""
        if not self.values.size:
            return []
        flat = np.where(np.isnan(self.values), -np.inf, self.values).ravel()
        order = np.argsort(-flat, kind="stable")[:k]
        width = self.values.shape[1]
        return [(self.dp_ranks[i % width], self.stages[i // width], float(flat[i]))
                for i in order if np.isfinite(flat[i])]


def title_of(finding: Finding) -> str:
    """The heading of a finding."""
    return CAUSE_TITLES.get(finding.cause, finding.cause.replace("_", " ").capitalize())


def advice_of(finding: Finding) -> str:
    """What to do about a finding (results saved without a fix get the standard one)."""
    return "" if finding.cause in ("none", "unexplained", "partial") else (finding.fix or FIXES.get(finding.cause, ""))


def attribution_note(result: AnalysisResult) -> str:
    """Why a result has no attribution tables."""
    if result.slowdown < result.decompose_threshold:
        return (f"Attribution skipped: S = {fmt(result.slowdown)} < {result.decompose_threshold}, "
                "so there is no slowdown worth splitting up.")
    return "This result carries no attribution (by op type, stage, DP rank or worker)."


def shape_words(result: AnalysisResult, sep: str = " × ", upper: bool = False) -> str:
    """'dp 4 × pp 4 × tp 2' (dsp only when > 1); from the mesh where the trace gives it:
    'dp 2 × tp 2 (4 workers per stage)' (a worker per TP/CP rank), ep and cp when > 1."""
    job = result.job
    parts = []
    if job.parallel:
        for k in ("dp", "tp", "cp", "ep", "pp"):
            v = job.parallel.get(k)
            if v is not None and (k in ("dp", "pp") or v != 1):
                parts.append(f"{k.upper() if upper else k} {v}")
        text = sep.join(parts)
        if job.dp is not None and job.dp != job.parallel.get("dp"):
            text += f" ({job.dp} workers per stage)"
        return text
    for k in ("dp", "pp", "tp", "dsp"):
        v = getattr(job, k)
        if v is not None and (k != "dsp" or v != 1):
            parts.append(f"{k.upper() if upper else k} {v}")
    return sep.join(parts)


def coverage_words(result: AnalysisResult) -> str | None:
    """How many of the job's DP × PP workers the trace holds, and which are missing."""
    job = result.job
    if job.workers_read is None or job.dp is None or job.pp is None:
        return None
    count = job.missing_count if job.missing_count is not None else len(job.missing_workers)
    expected = job.workers_read + count
    text = f"{job.workers_read} of {expected} DP×PP workers traced"
    if job.ranks_read is not None and job.world_size and job.ranks_read != job.workers_read:
        text += f" ({job.ranks_read} ranks of world size {job.world_size})"
    if job.missing_workers:
        by_stage: dict[int, list[int]] = {}
        for d, p in job.missing_workers:
            by_stage.setdefault(p, []).append(d)
        text += "; missing: " + "; ".join(f"pp {p}: dp {wording.ranges(sorted(ds), dash='–')}"
                                         for p, ds in sorted(by_stage.items()))
        if count > len(job.missing_workers):
            text += f" and {count - len(job.missing_workers):,} more"
    return text


def fix_fraction_words(name: str, value: float | None, what: str) -> str | None:
    """Why a fix fraction lies outside [0, 1], when it does."""
    if value is None or not math.isfinite(value) or 0 <= value <= 1:
        return None
    if value > 1:
        return (f"{name} > 1: fixing {what} alone beats the straggler-free reference (which "
                "holds every op at the job-wide mean; the other ops run faster than that)")
    return (f"{name} < 0: fixing {what} alone makes steps slower ({what} already runs faster "
            "than the job-wide mean; it is not where the slowdown comes from)")


def speedup_words(value: float | None) -> str:
    """'1.25× faster' (or 'no faster' for gains that round away)."""
    if value is None or not math.isfinite(value):
        return ""
    return f"{value:.2f}× faster"


def interval_words(lo: float, hi: float) -> str:
    """' (interval 1.21–1.29)', with a third decimal when two would print one number twice, and
    ' (the same on every resample of the steps)' when the interval has no width at all."""
    for digits in (2, 3):
        a, b = f"{lo:.{digits}f}", f"{hi:.{digits}f}"
        if a != b:
            return f" (interval {a}–{b})"
    return " (the same on every resample of the steps)"


def prediction_words(finding: Finding) -> str:
    """'1.25× faster (interval 1.21–1.29)', 'at most …' for upper bounds; '' when none."""
    text = speedup_words(finding.speedup_if_fixed)
    if not text:
        return ""
    if finding.interval:
        text += interval_words(finding.interval.low, finding.interval.high)
    else:
        text += " (one step analysed: no interval)"
    if finding.upper_bound:
        text = f"at most {text}: an upper bound, what a perfect fix would buy"
    return text


def share_words(share: float | None, what: str = "this fix") -> str:
    """How much of the straggler excess a fix removes, with shares past 100% explained."""
    if share is None or not math.isfinite(share):
        return ""
    if share > 1:
        return (f"{what} removes all of the straggler excess and more ({share:.0%} of it): the "
                "straggler-free reference holds every op at the job-wide mean, and the fixed job "
                "runs faster than that")
    if share < 0:
        return f"{what} alone would not shorten steps (share {share:.0%})"
    return f"{what} removes {share:.0%} of the straggler excess"


def after_others_words(finding: Finding) -> str:
    """What fixing a cause buys once the other listed causes are fixed, when it differs."""
    after, alone = finding.speedup_after_others, finding.speedup_if_fixed
    if after is None or alone is None or abs(after - alone) < 0.005:
        return ""
    return f"once the other causes are fixed, fixing this one too: {after:.2f}× faster"


def combined_words(result: AnalysisResult) -> list[str]:
    """The combined prediction (every listed cause fixed) and the unexplained remainder."""
    summary = result.diagnosis_summary
    if summary is None or summary.all_fixed is None:
        return []
    causes = [f for f in result.diagnosis if f.cause not in ("none", "unexplained", "partial")]
    which = "the one listed cause" if len(causes) == 1 else f"all {len(causes)} listed causes together"
    text = f"Fixing {which}: {summary.all_fixed:.2f}× faster"
    if summary.all_fixed_interval:
        text += interval_words(summary.all_fixed_interval.low, summary.all_fixed_interval.high)
    lines = [text]
    if summary.explained is not None:
        if summary.explained > 1:
            lines.append("together they explain all of the straggler excess "
                         f"({summary.explained:.0%} of it; see the shares past 100% above)")
        else:
            lines.append(f"together they explain {max(summary.explained, 0):.0%} of the straggler "
                         f"excess; unexplained: {summary.unexplained or 0:.0%}")
    if summary.noise_floor is not None:
        lines.append(f"noise floor: S = {summary.noise_floor:.3f} from measurement jitter alone")
    return lines


def notes_by_kind(result: AnalysisResult) -> list[tuple[str, str]]:
    """The reader's notes as (title, message), ordered by NOTE_KINDS."""
    order = {k: i for i, k in enumerate(NOTE_KINDS)}
    notes = sorted(result.notes, key=lambda n: order.get(n.kind, len(order)))
    return [(NOTE_TITLES.get(n.kind, n.kind), n.message) for n in notes]


def describe_where(where: Where) -> str:
    """Words for a diagnosis location, e.g. 'worker dp 0 / pp 3; steps 5, 9'."""
    parts = []
    fields: list[tuple[str, Sequence[WorkerRef | int | str]]] = []
    if where.workers:  # the workers name their DP ranks, stages, ranks and hosts
        fields.append(("workers", where.workers))
    elif len(where.dp) == 1 and len(where.pp) == 1:  # one DP rank and one stage: one worker
        parts.append(f"worker dp {where.dp[0]} / pp {where.pp[0]}")
        fields += [("ranks", where.ranks), ("hosts", where.hosts)]
    else:
        fields += [("dp", where.dp), ("pp", where.pp), ("ranks", where.ranks),
                   ("hosts", where.hosts)]
    fields += [("steps", where.steps), ("optypes", where.optypes)]
    for key, items in fields:
        if not items:
            continue
        one, many = WHERE_LABELS.get(key, (key, key))
        shown = ", ".join(_item_words(v) for v in items[:8])
        if len(items) > 8:
            shown += f", … ({len(items)} in all)"
        parts.append(f"{one if len(items) == 1 else many} {shown}")
    if where.scope:
        parts.append(f"among the {where.scope}")
    return "; ".join(parts) or "whole job"


def _item_words(value: WorkerRef | int | str) -> str:
    """One item of a location in words: a worker with its rank and host, else the value."""
    if isinstance(value, WorkerRef):
        place = [f"rank {value.rank}"] if value.rank is not None else []
        place += [value.host] if value.host else []
        return f"dp {value.dp} / pp {value.pp}" + (f" ({', '.join(place)})" if place else "")
    return str(value)


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
