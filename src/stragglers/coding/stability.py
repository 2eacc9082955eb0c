"""The numerical-stability guard (spec §3): refuse or warn before an unstable code is used.

Decoding multiplies the workers' messages by a; their rounding errors (unit roundoff u of the
message dtype) are amplified by up to the condition number κ of B_K. The guard estimates the
worst-case relative error of the recovered gradient as κ_worst·u and compares it with a tolerance.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np

from stragglers.coding.protocol import GradientCode
from stragglers.errors import InputError, StragglersError

UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24,
                 "float64": 2.0 ** -53}
DEFAULT_TOLERANCE = 1e-3


class UnstableCodeError(StragglersError):
    """The code's worst-case decoding error exceeds the tolerance; the message says what to use."""


@dataclass(frozen=True)
class StabilityReport:
    """The guard's verdict for one code and message dtype."""

    code: str
    n: int
    s: int
    dtype: str
    worst_condition: float
    worst_relative_error: float
    tolerance: float
    recommendation: str

    @property
    def stable(self) -> bool:
        """True when the estimated worst-case relative error is within the tolerance."""
        return self.worst_relative_error <= self.tolerance

    def message(self) -> str:
        """One line: the verdict, the numbers and what to use instead."""
        verdict = "stable" if self.stable else "UNSTABLE"
        return (f"{self.code} n={self.n} s={self.s} with {self.dtype} messages is {verdict}: "
                f"worst condition number {self.worst_condition:.3g}, worst relative gradient "
                f"error ~{self.worst_relative_error:.3g} (tolerance {self.tolerance:g})"
                + ("" if self.stable else f"; {self.recommendation}"))


def recommend_stable(n: int, s: int) -> str:
    """A stable alternative for (n, s): FRC when (s+1) | n, else an expander code."""
    if n % (s + 1) == 0:
        return f"use fractional repetition (scheme 'frc', exact, 0/1 weights) for n={n}, s={s}"
    d = s + 1 if (n * (s + 1)) % 2 == 0 else s + 2
    return (f"use fractional repetition with an n divisible by s+1, or the approximate expander "
            f"code (scheme 'expander', d={min(d, n - 1)}) for n={n}, s={s}")


def stability_report(code: GradientCode, dtype: str = "float32",
                     tolerance: float = DEFAULT_TOLERANCE) -> StabilityReport:
    """Estimate the worst-case decoding error of `code` with messages in `dtype`."""
    if dtype not in UNIT_ROUNDOFF:
        raise InputError("stability", "dtype", f"expected one of {sorted(UNIT_ROUNDOFF)}, "
                                               f"got {dtype!r}")
    kappa = code.worst_case_condition()
    err = kappa * UNIT_ROUNDOFF[dtype]
    return StabilityReport(code.name, code.n, code.s, dtype, kappa, float(err), tolerance,
                           recommend_stable(code.n, code.s))


def check_stability(code: GradientCode, dtype: str = "float32",
                    tolerance: float = DEFAULT_TOLERANCE, on_unstable: str = "raise"
                    ) -> StabilityReport:
    """Refuse (`on_unstable="raise"`) or warn (`"warn"`) when the code is unstable for `dtype`."""
    if on_unstable not in ("raise", "warn", "ignore"):
        raise InputError("stability", "on_unstable",
                         f"expected 'raise', 'warn' or 'ignore', got {on_unstable!r}")
    report = stability_report(code, dtype, tolerance)
    if not report.stable and np.isfinite(tolerance):
        if on_unstable == "raise":
            raise UnstableCodeError(report.message())
        if on_unstable == "warn":
            warnings.warn(report.message(), RuntimeWarning, stacklevel=2)
    return report
