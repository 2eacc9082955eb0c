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
from typing import TYPE_CHECKING

from stragglers.lazy import lazy_exports

__version__ = "0.2.0"

# One logger tree, quiet unless the application (or `stragglers -v`) configures logging.
logging.getLogger("stragglers").addHandler(logging.NullHandler())

# public name -> module that defines it, grouped by capability
_LAZY: dict[str, str | tuple[str, str]] = {
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

if TYPE_CHECKING:   # the same names for type checkers, which do not run __getattr__
    from stragglers.advice.act import AdvisePolicy
    from stragglers.advice.advisor import advise
    from stragglers.advice.config import AdviseConfig
    from stragglers.api import analyze
    from stragglers.coding.schemes import make_code
    from stragglers.coding.stability import check_stability
    from stragglers.collectives.ddp_hook import StragglarHookState, stragglar_hook
    from stragglers.collectives.detection import StragglerDetector
    from stragglers.collectives.executor import stragglar_all_reduce
    from stragglers.config import Config
    from stragglers.errors import EnvironmentFailure, InputError, MissingExtraError, StragglersError
    from stragglers.mitigate.planned_gc import PlannedGC
    from stragglers.mitigate.sequences import balance_sequences
    from stragglers.mitigate.stages import suggest_stage_split
    from stragglers.record._attach import attach
    from stragglers.record.recorder import Recorder
    from stragglers.report.console import print_report
    from stragglers.report.html import write_html
    from stragglers.report.perfetto import write_perfetto
    from stragglers.trace.convert import convert
    from stragglers.trace.load import load_trace, parse_steps
    from stragglers.trace.model import JobMeta, Trace
    from stragglers.trace.synth._generate import generate as synth
    from stragglers.trace.synth.spec import SynthSpec
    from stragglers.whatif.result import AnalysisResult
__all__ = [*__all__, "__version__"]
