"""stragglers: find, explain and remove stragglers in distributed deep-learning training.

    import stragglers as st
    result = st.analyze("runs/job")          # what-if analysis of a recorded run
    st.print_report(result)

Every public name is importable from here. Imports are lazy: `import stragglers` loads nothing
heavy, the analysis path (load_trace, analyze, reports) never imports torch, and the names that
need torch (Recorder, stragglar_all_reduce, train_coded, ...) import it on first use.
"""

from __future__ import annotations

import logging

from stragglers.lazy import lazy_exports

__version__ = "0.2.0"

# One logger tree, quiet unless the application (or `stragglers -v`) configures logging.
logging.getLogger("stragglers").addHandler(logging.NullHandler())

# public name -> module that defines it, grouped by capability
_LAZY = {
    # Understand: traces, what-if analysis, reports
    "analyze": "stragglers.api",
    "load_trace": "stragglers.trace.load",
    "parse_steps": "stragglers.trace.load",
    "convert": "stragglers.trace.convert",
    "AnalysisResult": "stragglers.whatif.result",
    "Trace": "stragglers.trace.model",
    "JobMeta": "stragglers.trace.model",
    "print_report": "stragglers.report",
    "write_html": "stragglers.report",
    "write_perfetto": "stragglers.report",
    "advise": ("stragglers.advice.advisor", "advise"),
    "AdviseConfig": "stragglers.advice.config",
    "AdvisePolicy": "stragglers.advice.act",
    # Record
    "Recorder": "stragglers.record",
    "attach": "stragglers.record",
    # Tolerate: StragglAR and gradient coding
    "stragglar_all_reduce": "stragglers.collectives",
    "stragglar_hook": "stragglers.collectives",
    "StragglarHookState": "stragglers.collectives",
    "StragglerDetector": "stragglers.collectives",
    "make_code": "stragglers.coding",
    "check_stability": "stragglers.coding",
    # Mitigate
    "PlannedGC": "stragglers.mitigate",
    "balance_sequences": "stragglers.mitigate",
    "suggest_stage_split": "stragglers.mitigate",
    # Surface: errors and configuration
    "StragglersError": "stragglers.errors",
    "InputError": "stragglers.errors",
    "EnvironmentFailure": "stragglers.errors",
    "MissingExtraError": "stragglers.errors",
    "Config": "stragglers.config",
    "synth": ("stragglers.trace.synth", "generate"),
    "SynthSpec": "stragglers.trace.synth.spec",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY)
__all__ = [*__all__, "__version__"]
