"""The opt-in controller policy that applies the best runtime-switchable remedy, then checks it.

Fed one step at a time with every rank's `StepTiming` (in-job detection: the ranks all-gather
their timings, so every rank feeds the same numbers and takes the same decisions — the property
that keeps a switch of the DDP hook from deadlocking). Per window of `window` steps:

    observe → advise on the window → APPLY the best runtime remedy (StragglAR hook, re-split
    batches, planned GC) if it predicts at least `apply_gain` → `settle` steps ignored → one
    window measured → KEEP it if it made the step at least `keep_gain` faster, else ROLLBACK
    (and never try it again)

The windows come either from the policy's own count of fed steps (`observe`, one step at a
time) or from the live monitor (`observe_window`, one closed window as an op table: see
stragglers.advice.live). Torch-free: the training loop carries out the decisions (see
examples/train_advised.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping, TypedDict

import msgspec
import numpy as np

from stragglers.advice.config import AdviseConfig, advise_config
from stragglers.advice.plan import Plan, RemedyAdvice
from stragglers.advice.remedies.details import BatchSplit, DiagnosedDetails, StragglarDetails
from stragglers.advice.window import StepTiming, window_step_time, window_trace
from stragglers.errors import InputError
from stragglers.trace.jsontypes import JsonObject
from stragglers.trace.model import Trace

log = logging.getLogger(__name__)

APPLY, KEEP, ROLLBACK = "apply", "keep", "rollback"
RUNTIME_REMEDIES = ("stragglar", "antdt-dd", "planned-gc")
# StragglAR's persistent-mode hook needs this many calls to name the straggler after a switch.
STRAGGLAR_WARMUP = 5
# An applied remedy is kept when the measured window after it is at least this much faster
# than the window before: hysteresis after an APPLY at ×apply_gain, two measured windows
# compared (no interval), so not the gain test a plan's remedies pass (MIN_GAIN).
KEEP_GAIN = 1.02


class SplitParams(msgspec.Struct):
    """antdt-dd: each rank's batch from now on."""

    batch_sizes: list[int]


class GCParams(msgspec.Struct):
    """planned-gc: collect on every rank every this many steps."""

    every: int


class StragglarParams(msgspec.Struct):
    """stragglar: the straggler the remedy found at the first bucket (None: the hook finds it)."""

    straggler: int | None


# What the training loop needs to switch a remedy on (ActDecision.params), one type per remedy.
ActParams = SplitParams | GCParams | StragglarParams


class ActDecisionJson(TypedDict):
    """An ActDecision as plain values (the params as a JSON object)."""

    kind: str
    remedy: str
    step: int
    params: JsonObject
    baseline_step_s: float | None
    predicted_step_s: float | None
    predicted_speedup: float | None
    measured_step_s: float | None
    measured_speedup: float | None
    reason: str
    source: str


@dataclass
class ActDecision:
    """One decision: apply / keep / rollback a remedy at `step`, with its prediction and measurement."""

    kind: str
    remedy: str
    step: int
    params: ActParams
    baseline_step_s: float | None = None    # measured in the window before
    predicted_step_s: float | None = None
    predicted_speedup: float | None = None
    measured_step_s: float | None = None    # measured in the window after (keep / rollback)
    measured_speedup: float | None = None
    reason: str = ""
    source: str = ""                        # the window it was decided on (e.g. a monitor's)

    def to_dict(self) -> ActDecisionJson:
        """Plain values (the params as a JSON object)."""
        return ActDecisionJson(
            kind=self.kind, remedy=self.remedy, step=self.step,
            params=msgspec.to_builtins(self.params), baseline_step_s=self.baseline_step_s,
            predicted_step_s=self.predicted_step_s, predicted_speedup=self.predicted_speedup,
            measured_step_s=self.measured_step_s, measured_speedup=self.measured_speedup,
            reason=self.reason, source=self.source)


@dataclass(frozen=True)
class Forced:
    """A runtime remedy applied at the first window whatever the plan says, with its settings."""

    name: str
    batch_sizes: list[int] | None = None    # antdt-dd: the split (default: the plan's)
    every: int | None = None                # planned-gc: collect every this many steps


def forced(force: Forced | Mapping[str, Any] | None) -> Forced | None:
    """`force` as a Forced ({"name": ..., "every": ...} accepted); InputError naming a bad key."""
    if force is None or isinstance(force, Forced):
        out = force
    else:
        try:
            out = Forced(**force)
        except TypeError:
            raise InputError("AdvisePolicy", "force", f"expected name and optionally "
                             f"batch_sizes or every, got {dict(force)!r}") from None
    if out is not None and out.name not in RUNTIME_REMEDIES:
        raise InputError("AdvisePolicy", "force", f"{out.name!r} cannot be switched at runtime; "
                         f"expected one of {', '.join(RUNTIME_REMEDIES)}")
    return out


class AdvisePolicy:
    """Advise on each window, apply the best runtime remedy, keep it only if it paid.

    Fed every rank's step timings (or the monitor's windows), not the adapt controller's
    ControllerState: not one of CONTROLLER_POLICIES.
    """

    name = "advise"

    def __init__(self, world_size: int, global_batch: int, window: int = 8, settle: int = 2,
                 remedies: tuple[str, ...] = RUNTIME_REMEDIES,
                 force: Forced | Mapping[str, Any] | None = None,
                 apply_gain: float = 1.05, keep_gain: float = KEEP_GAIN, warmup: int = 0,
                 config: AdviseConfig | None = None, **settings: Any):
        if world_size < 2:
            raise InputError("AdvisePolicy", "world_size", f"expected >= 2 ranks, got {world_size}")
        if window < 2 or settle < 0 or warmup < 0:
            raise InputError("AdvisePolicy", "window", "expected window >= 2, settle >= 0 and warmup >= 0")
        bad = [r for r in remedies if r not in RUNTIME_REMEDIES]
        if bad:
            raise InputError("AdvisePolicy", "remedies", f"{bad[0]!r} cannot be switched at "
                             f"runtime; expected some of {', '.join(RUNTIME_REMEDIES)}")
        self.world_size, self.global_batch = world_size, global_batch
        self.window, self.settle, self.remedies = window, settle, tuple(remedies)
        self.force = forced(force)
        # A window is noisy: switch only for a predicted gain well above noise, keep on any gain.
        self.apply_gain, self.keep_gain = apply_gain, keep_gain
        # the job's AdviseConfig, checked now rather than at the first window
        self.config = advise_config(config, settings, "AdvisePolicy")
        n = world_size
        self.batch_sizes = [global_batch // n + (1 if i < global_batch % n else 0) for i in range(n)]
        self.phase = "observe"
        self.buffer: list[list[StepTiming]] = []
        # windows holding an earlier step are not used: the job's first (warm-up) steps, then
        # the settle steps after each switch
        self.ready_from = int(warmup)
        self.active: ActDecision | None = None
        self.rejected: list[str] = []
        self.decisions: list[ActDecision] = []
        self.plans: list[Plan] = []

    def observe(self, timings: list[StepTiming]) -> list[ActDecision]:
        """Feed one step (every rank's timing); returns the decisions it triggers."""
        if self.phase == "done" or timings[0].step < self.ready_from:
            return []
        self.buffer.append(sorted(timings, key=lambda t: t.rank))
        if len(self.buffer) < self.window:
            return []
        window, self.buffer = self.buffer, []
        trace = window_trace(window, global_batch=self.global_batch)
        return self._decide(trace, window[-1][0].step + 1, window_step_time(window))

    def observe_window(self, trace: Trace, slowdown: float | None = None, source: str = "",
                       applied_at: int | None = None) -> list[ActDecision]:
        """Feed one closed window as an op table (the live monitor's); returns the decisions.

        `slowdown` is the monitor's S of the window: below `apply_gain` no remedy can buy
        `apply_gain` (none beats the ideal), so a window the monitor found healthy is not priced.
        `applied_at`: the first step that will run with a decision taken now (a monitor's window
        arrives some steps after it closed; default the step after the window). A window holding
        steps from before a switch has settled is skipped.
        """
        if self.phase == "done" or not len(trace):
            return []
        steps = np.unique(trace.ops["step"])
        if int(steps.min()) < self.ready_from:
            return []
        if self.phase == "observe" and slowdown is not None and slowdown < self.apply_gain:
            return []
        step = max(int(steps.max()) + 1, applied_at if applied_at is not None else 0)
        return self._decide(trace, step, trace_step_time(trace), source)

    def _decide(self, trace: Trace, step: int, measured: float, source: str = "") -> list[ActDecision]:
        new = self._verify(step, measured) if self.phase == "verify" else \
            self._apply(step, trace, measured)
        for d in new:
            d.source = source or trace.source
            log.info("advise/act: %s %s at step %d (%s)", d.kind, d.remedy, d.step, d.reason)
        self.decisions.extend(new)
        return new

    def _apply(self, step: int, trace: Trace, measured: float) -> list[ActDecision]:
        from stragglers.advice.advisor import advise

        plan = advise(trace, config=self.config, batch_sizes=list(self.batch_sizes), max_s=1,
                      remedies=list(self.remedies))
        self.plans.append(plan)
        force = self.force if self.force is not None and \
            self.force.name not in self.rejected else None
        advice: RemedyAdvice | None
        if force is not None:
            name, reason = force.name, "forced"
            advice = plan.get(name)
        else:
            advice = plan.best(runtime_only=True, exclude=tuple(self.rejected))
            if advice is None or advice.predicted_speedup is None or \
                    advice.predicted_speedup < self.apply_gain:
                return []
            name, reason = advice.name, f"best runtime remedy: {advice.method}"
        params = self._params(name, advice, force)
        speedup = advice.predicted_speedup if advice is not None else None
        decision = ActDecision(APPLY, name, step, params, measured,
                               measured / speedup if speedup else None, speedup, reason=reason)
        self.active = decision
        self.phase = "verify"
        self.ready_from = step + max(self.settle, STRAGGLAR_WARMUP if name == "stragglar" else 0)
        if isinstance(params, SplitParams):
            self.batch_sizes = list(params.batch_sizes)
        return [decision]

    @staticmethod
    def _params(name: str, advice: RemedyAdvice | None, force: Forced | None) -> ActParams:
        """What the training loop needs to switch `name` on: the forced settings, else the
        advice's (its details, as the remedy wrote them)."""
        details = advice.details if advice is not None else None
        if name == "antdt-dd":
            sizes = (force.batch_sizes if force is not None else None) or \
                (details.new_batch_sizes if isinstance(details, BatchSplit) else None)
            if sizes is None:
                raise InputError("AdvisePolicy", "force", "antdt-dd needs batch_sizes")
            return SplitParams([int(b) for b in sizes])
        if name == "planned-gc":
            every = force.every if force is not None else None
            if every is None and isinstance(details, DiagnosedDetails) and \
                    isinstance(details.every, int):
                every = details.every
            return GCParams(int(every or 5))
        # stragglar: the straggler the remedy found at the first bucket
        buckets = details.buckets if isinstance(details, StragglarDetails) else []
        return StragglarParams(buckets[0].straggler_dp_rank if buckets else None)

    def _verify(self, step: int, measured: float) -> list[ActDecision]:
        a = self.active
        if a is None or a.baseline_step_s is None:  # verify follows an apply, which sets both
            raise RuntimeError("AdvisePolicy: verifying with no remedy applied")
        speedup = a.baseline_step_s / measured if measured > 0 else 0.0
        paid = speedup >= self.keep_gain
        kind = KEEP if paid else ROLLBACK
        pred = f"predicted ×{a.predicted_speedup:.3f}" if a.predicted_speedup else "no prediction"
        decision = ActDecision(kind, a.remedy, step, a.params, a.baseline_step_s,
                               a.predicted_step_s, a.predicted_speedup, measured, speedup,
                               reason=f"measured ×{speedup:.3f} ({pred}); "
                                      + ("it paid" if paid else f"below ×{self.keep_gain}: "
                                         "rolled back"))
        self.active = None
        if paid:
            self.phase = "done"
        else:
            self.rejected.append(a.remedy)
            self.phase = "observe"
            if a.remedy == "antdt-dd":
                n = self.world_size
                self.batch_sizes = [self.global_batch // n + (1 if i < self.global_batch % n else 0)
                                    for i in range(n)]
            self.ready_from = step + self.settle
        return [decision]


def trace_step_time(trace: Trace) -> float:
    """Mean over the trace's steps of (last op end − first op start) over ranks."""
    o = trace.ops
    steps, inverse = np.unique(o["step"], return_inverse=True)
    end = o["start_ts"] + o["duration"]
    first = np.full(len(steps), np.inf)
    last = np.full(len(steps), -np.inf)
    np.minimum.at(first, inverse, o["start_ts"])
    np.maximum.at(last, inverse, end)
    return float(np.mean(last - first))
