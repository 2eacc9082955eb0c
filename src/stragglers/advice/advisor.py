"""`advise()`: every registered remedy's prediction on one job, ranked."""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from stragglers.advice.config import AdviseConfig, advise_config
from stragglers.advice.context import AdviceContext
from stragglers.advice.plan import Plan
from stragglers.errors import InputError
from stragglers.trace.model import Trace

if TYPE_CHECKING:
    from stragglers.whatif.metrics import WhatIf
    from stragglers.whatif.result import AnalysisResult

log = logging.getLogger(__name__)


def _remedies():
    """The remedy registry, with every remedy module imported (they register on import)."""
    from stragglers.advice.remedies import adapt, mitigate, tolerate  # noqa: F401
    from stragglers.protocols import REMEDIES

    return REMEDIES


def advise(result_or_trace: AnalysisResult | Trace | str | Path, *, trace: Trace | None = None,
           whatif: WhatIf | None = None, remedies: list[str] | None = None,
           config: AdviseConfig | None = None,
           **settings: Any) -> Plan:
    """A ranked plan of remedies for one job: predicted step time and speedup of each, by replay.

    `result_or_trace`: a Trace, a run directory / trace path, or an AnalysisResult (then pass the
    `trace` it came from; `whatif` too, to skip re-building the model). `config`: the job's
    AdviseConfig (link, global_batch, batch_sizes, remaining_steps, restart_cost_s, devices,
    max_s, threshold, compute_curves, gc_sync_pause_s); `settings` given as keywords change
    those fields. `remedies` limits the plan to these registered names.
    """
    from stragglers.whatif._analyze import analyze_with_model

    config = advise_config(config, settings)   # checked before the (slow) analysis
    source = result_or_trace
    if isinstance(source, (str, Path)):
        from stragglers.trace.load import load_trace

        source = load_trace(source)
    if isinstance(source, Trace):
        trace = source
        result, whatif = analyze_with_model(trace)
    else:
        result = source
        if trace is None:
            raise InputError("advise", "trace", "an analysis result alone cannot be replayed; "
                             "pass the trace it came from (trace=...) or the trace itself")
        if whatif is None:
            result, whatif = analyze_with_model(trace)
    ctx = AdviceContext(trace, result, whatif, config)
    registry = _remedies()
    names = remedies or registry.names()
    advice = []
    for name in names:
        cls = registry.get(name, "remedies")
        for remedy in cls.variants(ctx):
            advice.append(remedy.predict(ctx))
            log.info("%s: %s", advice[-1].name, advice[-1].predicted_speedup)
    notes = []
    if result.sim_error is not None and result.sim_error > 0.05:
        notes.append(f"the replay misses the measured step time by {100 * result.sim_error:.1f}% "
                     "(> 5%): predictions are less certain")
    if result.straggling is None:
        notes.append(f"S = {result.slowdown:.3f} over a partial trace: whether the job "
                     "straggles is unknown (trace every rank)")
    elif not result.straggling:
        notes.append(f"S = {result.slowdown:.3f}: the job is not straggling")
    measured = float(result.t_base) if result.t_base is not None else math.nan
    return Plan(result.job.name, measured, ctx.baseline_step_s, advice, notes)

