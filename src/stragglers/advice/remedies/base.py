"""What every remedy shares: the base class, the shape of a refusal, the prediction interval."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stragglers.advice.context import AdviceContext
from stragglers.advice.plan import RemedyAdvice
from stragglers.advice.remedies.details import Details
from stragglers.whatif.confidence import GAIN, gain_is_real, ratio_interval


class RemedyBase:
    """A remedy (implements `stragglers.protocols.Remedy`); `variants` lists its settings to price."""

    name = "remedy"
    runtime_switchable = False
    exact = False

    @classmethod
    def variants(cls, ctx: AdviceContext) -> Sequence[RemedyBase]:
        """The settings of this remedy worth predicting on this job (default: one)."""
        return [cls()]

    def predict(self, ctx: AdviceContext) -> RemedyAdvice:  # pragma: no cover - abstract
        raise NotImplementedError

    def refuse(self, why: str, **fields) -> RemedyAdvice:
        """The advice for a remedy that does not apply to this job."""
        return RemedyAdvice(self.name, False, why, runtime_switchable=self.runtime_switchable,
                            exact=self.exact, **fields)

    def priced(self, ctx: AdviceContext, step_s: float | np.ndarray, method: str, cost: str,
               switch_on: str, details: Details | None = None, why_small: str | None = None,
               interval: list[float] | None = None) -> RemedyAdvice:
        """The advice for a predicted step time (per step: an array over the analysed steps).

        Refused unless the gain is real (`gain_is_real`, the diagnosis's GAIN): with `why_small`
        below it, or when the interval's low end is: per-step predictions get a bootstrap
        interval over steps (`speedup_interval`); a prediction made otherwise may pass its own."""
        if isinstance(step_s, np.ndarray):
            interval = speedup_interval(ctx.baseline_step_times, step_s)
            step_s = float(step_s.mean())
        speedup = ctx.baseline_step_s / step_s if step_s > 0 else None
        low = interval[0] if interval is not None else None
        applies = speedup is not None and gain_is_real(speedup, low, GAIN)
        why = None
        if speedup is None or speedup < GAIN.min_gain:
            gain = f"×{speedup:.3f}" if speedup is not None else "nothing"
            why = (why_small + "; " if why_small else "") + \
                f"predicted {gain}, below the ×{GAIN.min_gain} worth switching on"
        elif not applies and interval is not None:
            why = (f"predicted ×{speedup:.3f}, but its {100 * GAIN.confidence:.0f}% interval "
                   f"over the job's steps [×{interval[0]:.3f}, ×{interval[1]:.3f}] reaches below "
                   f"the ×{GAIN.min_gain} worth switching on: not clear of this job's "
                   "step-to-step noise")
        return RemedyAdvice(self.name, applies, why, step_s, speedup, method, cost, switch_on,
                            self.runtime_switchable, self.exact,
                            details if details is not None else Details(), interval)


def speedup_interval(baseline: np.ndarray, remedy: np.ndarray) -> list[float] | None:
    """The diagnosis's bootstrap interval of mean(baseline) / mean(remedy) over the steps
    (paired, seeded) at its settings (GAIN); None with fewer than 4 usable steps."""
    baseline, remedy = np.asarray(baseline, float), np.asarray(remedy, float)
    ok = np.isfinite(baseline) & np.isfinite(remedy) & (remedy > 0)
    if ok.sum() < 4:
        return None
    return list(ratio_interval(baseline[ok], remedy[ok], GAIN))
