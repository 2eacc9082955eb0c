"""StragglAR AllReduce: schedules, executor, cost model, straggler detection and a DDP hook.

torch is imported lazily so `stragglers.collectives.schedule`/`cost_model` work without it.
"""

from __future__ import annotations

_LAZY = {
    "stragglar_all_reduce": "stragglers.collectives.executor",
    "prepare_subgroups": "stragglers.collectives.executor",
    "StragglarRun": "stragglers.collectives.executor",
    "StragglarHookState": "stragglers.collectives.ddp_hook",
    "stragglar_hook": "stragglers.collectives.ddp_hook",
    "synthesize": "stragglers.collectives.schedule",
    "verify": "stragglers.collectives.schedule",
    "StragglerDetector": "stragglers.collectives.detection",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)
