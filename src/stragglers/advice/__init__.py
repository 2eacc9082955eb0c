"""Advice and act: what each remedy would buy on this job, and the loop that applies the best one.

The package is `advice` so that `stragglers.advise` is only ever the function (a package of the
function's name would be bound over it by the first import of one of its submodules).
`advise(trace_or_result)` replays the job with each remedy's modified durations (the what-if
engine, no torch) and returns a ranked `Plan`. `stragglers.advice.act` holds the opt-in
controller policy that applies the best runtime-switchable remedy in a running job, checks the
next windows against the prediction and rolls back a remedy that did not pay, on windows it
counts itself or on the live monitor's (`stragglers.advice.live`); its torch side (the
switchable DDP hook) is imported lazily.
"""

from __future__ import annotations

from stragglers.lazy import lazy_exports

_LAZY = {
    "advise": "stragglers.advice.advisor",
    "Plan": "stragglers.advice.plan",
    "RemedyAdvice": "stragglers.advice.plan",
    "AdviseConfig": "stragglers.advice.config",
    "load_calibration": "stragglers.advice.context",
    "AdvisePolicy": "stragglers.advice.act",
    "ActDecision": "stragglers.advice.act",
    "StepTiming": "stragglers.advice.window",
    "window_trace": "stragglers.advice.window",
    "SwitchableCommHook": "stragglers.advice.hooks",
    "MonitorWindows": "stragglers.advice.live",
    "TimingPublisher": "stragglers.advice.live",
}

# The job's settings were the mutable JobKnobs; they are one validated AdviseConfig.
_RENAMED = {"JobKnobs": "AdviseConfig"}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY, _RENAMED)

