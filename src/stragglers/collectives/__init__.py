"""StragglAR AllReduce: schedules, executor, cost model, straggler detection and a DDP hook.

`import stragglers.collectives` loads nothing; each name loads its module on first use, so
the torch-free parts (`synthesize`, `verify`, `lower_bound_rounds`, `StragglerDetector`, the
cost model) work without torch.

Public names (`__all__`):

* schedules (no torch): `synthesize(n)`, `verify(schedule)`, `lower_bound_rounds(n)`, `Schedule`
* the collective (torch): `stragglar_all_reduce`, `StragglarRun`, `prepare_subgroups`
* the DDP hook (torch): `StragglarHookState`, `stragglar_hook`
* detection (no torch): `StragglerDetector`
* cost model (no torch): `LinkModel`, `algorithm_time`, `break_even_delay`, `speedup_over_ring`
* device helpers (torch): `control_device`, `Stopwatch`
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stragglers.lazy import lazy_exports

_LAZY = {
    "stragglar_all_reduce": "stragglers.collectives.executor",
    "prepare_subgroups": "stragglers.collectives.executor",
    "StragglarRun": "stragglers.collectives.executor",
    "StragglarHookState": "stragglers.collectives.ddp_hook",
    "stragglar_hook": "stragglers.collectives.ddp_hook",
    "synthesize": "stragglers.collectives.schedule",
    "verify": "stragglers.collectives.schedule",
    "lower_bound_rounds": "stragglers.collectives.schedule",
    "Schedule": "stragglers.collectives.schedule",
    "StragglerDetector": "stragglers.collectives.detection",
    "LinkModel": "stragglers.collectives.cost_model",
    "algorithm_time": "stragglers.collectives.cost_model",
    "break_even_delay": "stragglers.collectives.cost_model",
    "speedup_over_ring": "stragglers.collectives.cost_model",
    "control_device": "stragglers.collectives.devices",
    "Stopwatch": "stragglers.collectives.devices",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY)

if TYPE_CHECKING:   # the same names for type checkers, which do not run __getattr__
    from stragglers.collectives.cost_model import (LinkModel, algorithm_time, break_even_delay,
                                                   speedup_over_ring)
    from stragglers.collectives.ddp_hook import StragglarHookState, stragglar_hook
    from stragglers.collectives.detection import StragglerDetector
    from stragglers.collectives.devices import Stopwatch, control_device
    from stragglers.collectives.executor import (StragglarRun, prepare_subgroups,
                                                 stragglar_all_reduce)
    from stragglers.collectives.schedule import Schedule, lower_bound_rounds, synthesize, verify
