"""What-if analysis: dependency model, replay, idealisation, metrics and diagnosis (docs/whatif.md).

Pure functions of an op table (`stragglers.trace.model.Trace`); no torch.
"""

from __future__ import annotations

from stragglers.lazy import lazy_exports

_LAZY = {
    "analyze": "stragglers.whatif._analyze",
    "AnalysisResult": "stragglers.whatif.result",
    "analyze_with_model": "stragglers.whatif._analyze",
    "timelines": "stragglers.whatif._analyze",
    "WhatIf": "stragglers.whatif.metrics",
    "build_grid": "stragglers.whatif.grid",
    "replay": "stragglers.whatif._replay",
    "diagnose": "stragglers.whatif.diagnosis",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY)
