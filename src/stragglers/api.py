"""The top-level verbs of the public API that take a user's path as well as a loaded trace."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable

from stragglers.trace.model import Trace

if TYPE_CHECKING:
    from stragglers.whatif.result import AnalysisResult


def analyze(source: "Trace | str | Path", *, steps: list[int] | str | None = None, meta: "str | Path | None" = None,
            dp_size: int | None = None, pp_size: int | None = None,
            progress: Callable[[str], None] | None = None, tp_size: int | None = None
            ) -> AnalysisResult:
    """What-if analysis of a trace or of the trace at `source` (run dir, NDTimeline, profiler JSON)."""
    from stragglers.trace.load import load_trace, parse_steps
    from stragglers.whatif._analyze import analyze as analyze_trace

    trace = source if isinstance(source, Trace) else load_trace(
        source, meta, dp_size=dp_size, pp_size=pp_size, tp_size=tp_size)
    if isinstance(steps, str) and steps != "all":
        steps = parse_steps(steps)
    return analyze_trace(trace, steps, progress)
