"""What-if analysis: dependency model, replay, idealisation, metrics and diagnosis (specs/whatif.md).

Pure functions of an op table (`stragglers.trace.model.Trace`); no torch.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "analyze": "stragglers.whatif.analyze",
    "analyze_with_model": "stragglers.whatif.analyze",
    "timelines": "stragglers.whatif.analyze",
    "WhatIf": "stragglers.whatif.metrics",
    "build_grid": "stragglers.whatif.grid",
    "replay": "stragglers.whatif.replay",
    "diagnose": "stragglers.whatif.diagnosis",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'stragglers.whatif' has no attribute {name!r}")
