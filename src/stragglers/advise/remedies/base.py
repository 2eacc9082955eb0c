"""What every remedy shares: the base class and the shape of a refusal."""

from __future__ import annotations

from stragglers.advise.context import AdviceContext
from stragglers.advise.plan import MIN_GAIN, RemedyAdvice


class RemedyBase:
    """A remedy (implements `stragglers.protocols.Remedy`); `variants` lists its settings to price."""

    name = "remedy"
    runtime_switchable = False
    exact = False

    @classmethod
    def variants(cls, ctx: AdviceContext) -> list["RemedyBase"]:
        """The settings of this remedy worth predicting on this job (default: one)."""
        return [cls()]

    def predict(self, ctx: AdviceContext) -> RemedyAdvice:  # pragma: no cover - abstract
        raise NotImplementedError

    def refuse(self, why: str, **fields) -> RemedyAdvice:
        """The advice for a remedy that does not apply to this job."""
        return RemedyAdvice(self.name, False, why, runtime_switchable=self.runtime_switchable,
                            exact=self.exact, **fields)

    def priced(self, ctx: AdviceContext, step_s: float, method: str, cost: str, switch_on: str,
               details: dict | None = None, why_small: str | None = None) -> RemedyAdvice:
        """The advice for a predicted step time; below MIN_GAIN it is refused with `why_small`."""
        speedup = ctx.baseline_step_s / step_s if step_s > 0 else None
        applies = speedup is not None and speedup >= MIN_GAIN
        why = None
        if not applies:
            gain = f"×{speedup:.3f}" if speedup is not None else "nothing"
            why = (why_small + "; " if why_small else "") + \
                f"predicted {gain}, below the ×{MIN_GAIN} worth switching on"
        return RemedyAdvice(self.name, applies, why, step_s, speedup, method, cost, switch_on,
                            self.runtime_switchable, self.exact, details or {})
