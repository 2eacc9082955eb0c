"""The typed advice: one `RemedyAdvice` per remedy, ranked in a `Plan` (what `advise` returns)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TypedDict

from stragglers.advice.remedies.details import Details
from stragglers.trace.jsontypes import JsonObject
from stragglers.whatif.confidence import GAIN
from stragglers.whatif.result import plain

# A remedy must buy at least this much to be worth switching on, and the low end of its
# interval too (a gain inside the job's own noise is not one): the diagnosis's gain test
# (whatif/confidence.py GAIN), the same line as a finding's.
MIN_GAIN = GAIN.min_gain


class RemedyAdviceJson(TypedDict):
    """A RemedyAdvice as `stragglers advise --json` writes it (NaN/inf: None)."""

    name: str
    applies: bool
    why_not: str | None
    predicted_step_s: float | None
    predicted_speedup: float | None
    method: str
    cost: str
    switch_on: str
    runtime_switchable: bool
    exact: bool
    details: JsonObject             # as the remedy's Details type writes them
    interval: list[float | None] | None


@dataclass
class RemedyAdvice:
    """What one remedy would buy on this job, how we know, what it costs, how to switch it on."""

    name: str
    applies: bool
    why_not: str | None = None           # set when applies is False
    predicted_step_s: float | None = None
    predicted_speedup: float | None = None
    method: str = ""                     # how the prediction was made
    cost: str = ""                       # what switching it on costs
    switch_on: str = ""                  # the exact flag, hook or call
    runtime_switchable: bool = False     # can `stragglers.advice.act` apply it in a running job
    exact: bool = False                  # changes no parameters (same update as the plain run)
    details: Details = field(default_factory=Details)   # the remedy's own (remedies/details.py)
    # 90% interval of predicted_speedup: the steps resampled (the job's own step-to-step noise)
    interval: list[float] | None = None

    def to_dict(self) -> RemedyAdviceJson:
        """Plain JSON-ready values (NaN/inf become None); the details as their type writes them."""
        return RemedyAdviceJson(
            name=plain(self.name), applies=plain(self.applies), why_not=plain(self.why_not),
            predicted_step_s=plain(self.predicted_step_s),
            predicted_speedup=plain(self.predicted_speedup), method=plain(self.method),
            cost=plain(self.cost), switch_on=plain(self.switch_on),
            runtime_switchable=plain(self.runtime_switchable), exact=plain(self.exact),
            details=self.details.to_dict(), interval=plain(self.interval))


class PlanJson(TypedDict):
    """A Plan as `stragglers advise --json` writes it (a step time that is NaN: None)."""

    job: str
    measured_step_s: float | None
    baseline_step_s: float | None
    remedies: list[RemedyAdviceJson]   # ranked
    notes: list[str]


@dataclass
class Plan:
    """Remedies ranked best first: applicable ones by predicted speedup, then those that don't apply."""

    job: str
    measured_step_s: float               # mean measured step time (T_base)
    baseline_step_s: float               # the replay with measured durations and launch delays
    remedies: list[RemedyAdvice]
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.remedies = rank(self.remedies)

    def best(self, runtime_only: bool = False, exclude: tuple[str, ...] = ()) -> RemedyAdvice | None:
        """The first-ranked applicable remedy (optionally only runtime-switchable ones)."""
        for r in self.remedies:
            if r.applies and r.name not in exclude and (r.runtime_switchable or not runtime_only):
                return r
        return None

    def get(self, name: str) -> RemedyAdvice | None:
        """The advice for the remedy called `name`, or None."""
        return next((r for r in self.remedies if r.name == name), None)

    def to_dict(self) -> PlanJson:
        """The plan as plain JSON-ready values."""
        return {"job": self.job, "measured_step_s": plain(self.measured_step_s),
                "baseline_step_s": plain(self.baseline_step_s),
                "remedies": [r.to_dict() for r in self.remedies], "notes": list(self.notes)}

    def to_json(self, indent: int | None = 2) -> str:
        """Strict JSON (no NaN tokens)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)


def rank(remedies: list[RemedyAdvice]) -> list[RemedyAdvice]:
    """Applicable remedies by falling predicted speedup, then the rest (same order), stable."""
    def key(r: RemedyAdvice) -> tuple[int, float]:
        speed = r.predicted_speedup if r.predicted_speedup is not None else 0.0
        return (0 if r.applies else 1, -speed if r.applies else 0.0)
    return sorted(remedies, key=key)

