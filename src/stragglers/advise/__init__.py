"""Advise and act: what each remedy would buy on this job, and the loop that applies the best one.

`advise(trace_or_result)` replays the job with each remedy's modified durations (the what-if
engine, no torch) and returns a ranked `Plan`. `stragglers.advise.act` holds the opt-in
controller policy that applies the best runtime-switchable remedy in a running job, checks the
next windows against the prediction and rolls back a remedy that did not pay, on windows it
counts itself or on the live monitor's (`stragglers.advise.live`); its torch side (the
switchable DDP hook) is imported lazily.
"""

from __future__ import annotations

from stragglers.lazy import callable_module, lazy_exports

_LAZY = {
    "advise": "stragglers.advise.advisor",
    "Plan": "stragglers.advise.plan",
    "RemedyAdvice": "stragglers.advise.plan",
    "JobKnobs": "stragglers.advise.context",
    "load_calibration": "stragglers.advise.context",
    "AdvisePolicy": "stragglers.advise.act",
    "ActDecision": "stragglers.advise.act",
    "StepTiming": "stragglers.advise.window",
    "window_trace": "stragglers.advise.window",
    "SwitchableCommHook": "stragglers.advise.hooks",
    "MonitorWindows": "stragglers.advise.live",
    "TimingPublisher": "stragglers.advise.live",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _LAZY)


# `stragglers.advise` names both the function (the top-level lazy export) and this package;
# importing any submodule (e.g. `stragglers.advise.act`) binds the package to that name on
# `stragglers`: calling the package calls the function.
callable_module(__name__)
