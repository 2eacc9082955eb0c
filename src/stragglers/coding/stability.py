"""The numerical-stability guard (docs/gradient-coding.md §3): refuse or warn before an unstable code is used.

What it bounds. Let G be the n part gradients (rows g_j, as the workers computed them),
g = Σ_j g_j, and ĝ what the aggregator decodes from the messages of a survivor set K when
the messages are sent in `dtype` (worker i computes f_i = Σ_j B_ij g_j in that dtype, the
aggregator combines in float64). Then, for every G,

    ‖ĝ − g‖₂ ≤ ρ(K)·‖G‖_F,   ρ(K) = ‖aᵀB − 1ᵀ‖₂ + (γ_msg + 2γ₆₄)·Σ_{k∈K} |a_k|·‖b_k‖₂

with γ_m = m·u/(1 − m·u) (u the unit roundoff): γ_msg covers the worker's d products and sums,
the rounding of its weights and of the message (γ_{d+2}; γ_{4(d+2)} for complex messages),
γ₆₄ the float64 combine and the float64 evaluation of the residual. ‖·‖_F is the natural scale:
for independent part gradients ‖G‖_F ≈ ‖g‖, for aligned ones ‖G‖_F = ‖g‖/√n; no bound
relative to ‖g‖ itself exists (the parts may cancel). For approximate codes (expander,
ignore-stragglers) the residual is the code's designed approximation, reported separately;
the guard bounds the numerical part.

The guard refuses a code when max_K ρ(K) may exceed the tolerance. The maximum is taken over
*every* survivor set of size n − s: exactly (every set, or every set up to rotation for cyclic
codes) when that is affordable, otherwise by an analytic bound (cyclic MDS codes; codes whose
decoding is the same for every set). A code for which neither is possible is refused as
uncertified.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from math import comb

import numpy as np

from stragglers.coding.matrix_code import MatrixCode
from stragglers.errors import InputError, StragglersError

log = logging.getLogger(__name__)

UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8, "float32": 2.0 ** -24,
                 "float64": 2.0 ** -53}
U64 = 2.0 ** -53
DEFAULT_TOLERANCE = 1e-3
MAX_SETS = 20000  # survivor sets decoded one by one when certifying exhaustively
MAX_WORK = 5e8  # and at most this many flops (sets × n × (n−s)²): about a second on an idle core


class UnstableCodeError(StragglersError):
    """The code's worst-case decoding error exceeds the tolerance; the message says what to use."""


def gamma(m: int, u: float) -> float:
    """γ_m = m·u/(1 − m·u): the rounding-error factor of m floating-point operations."""
    if m * u >= 1:
        return float("inf")
    return m * u / (1 - m * u)


def message_gamma(code: MatrixCode, dtype: str) -> float:
    """γ of one worker message in `dtype`: its d products and sums, weight and message rounding."""
    d = code.parts_per_worker
    u = UNIT_ROUNDOFF[dtype]
    return gamma(4 * (d + 2), u) if code.is_complex else gamma(d + 2, u)


def decode_error_bound(decoding, dtype: str = "float32") -> float:
    """ρ(K) of one decoding (module docstring): ‖ĝ − g‖₂ ≤ ρ·‖G‖_F, residual included for
    exact codes, numerical part only for approximate ones."""
    code = decoding.code
    numerical = (message_gamma(code, dtype) + 2 * gamma(code.n + 2, U64)) * decoding.amplification
    return (decoding.residual if code.exact else 0.0) + numerical


@dataclass(frozen=True)
class StabilityReport:
    """The guard's verdict for one code and message dtype."""

    code: str
    n: int
    s: int
    dtype: str
    worst_condition: float  # κ(B_K) of the contiguous survivor set (informative)
    worst_relative_error: float  # max_K ρ(K): ‖ĝ − g‖₂ ≤ this·‖G‖_F for every survivor set
    tolerance: float
    recommendation: str
    method: str = "exhaustive"  # exhaustive | rotations | uniform | analytic | uncertified
    sets_checked: int = 0
    worst_survivors: tuple[int, ...] | None = None
    approximation_error: float = 0.0  # worst ‖aᵀB − 1ᵀ‖₂ of approximate codes

    @property
    def stable(self) -> bool:
        """True when the certified worst-case relative error is within the tolerance."""
        return self.method != "uncertified" and self.worst_relative_error <= self.tolerance

    def message(self) -> str:
        """One line: the verdict, the numbers and what to use instead."""
        verdict = "stable" if self.stable else "UNSTABLE"
        how = {"exhaustive": f"all {self.sets_checked} survivor sets",
               "rotations": f"all survivor sets ({self.sets_checked} up to rotation)",
               "uniform": "every survivor set (same decoding for all)",
               "analytic": "an analytic bound over every survivor set",
               "uncertified": f"no certificate: {comb(self.n, self.s)} survivor sets are too many "
                              f"to check and this code has no analytic bound"}[self.method]
        approx = (f", approximation error ‖aᵀB−1ᵀ‖ up to {self.approximation_error:.3g} by design"
                  if self.approximation_error else "")
        return (f"{self.code} n={self.n} s={self.s} with {self.dtype} messages is {verdict}: "
                f"worst decode error {self.worst_relative_error:.3g}·‖G‖_F over {how} "
                f"(tolerance {self.tolerance:g}; κ of a contiguous set "
                f"{self.worst_condition:.3g}){approx}"
                + ("" if self.stable else f"; {self.recommendation}"))


def recommend_stable(n: int, s: int) -> str:
    """A stable alternative for (n, s): FRC when (s+1) | n, else an expander code."""
    if n % (s + 1) == 0:
        return f"use fractional repetition (scheme 'frc', exact, 0/1 weights) for n={n}, s={s}"
    d = s + 1 if (n * (s + 1)) % 2 == 0 else s + 2
    return (f"use fractional repetition with an n divisible by s+1, or the approximate expander "
            f"code (scheme 'expander', d={min(d, n - 1)}) for n={n}, s={s}")


def survivor_sets(code: MatrixCode) -> tuple[str, Iterable[tuple[int, ...]]] | None:
    """The survivor sets the guard must check, and how: ("uniform"|"rotations"|"exhaustive", sets),
    or None when there are too many."""
    n, s, N = code.n, code.s, code.needed
    if code.uniform_decoding or s == 0:
        return "uniform", [tuple(range(N))]
    cost = n * N * N + 1
    if code.circulant:
        # every set rotates to one containing worker 0 among the stragglers: C(n−1, s−1) sets
        count = comb(n - 1, s - 1)
        if count <= MAX_SETS and count * cost <= MAX_WORK:
            sets = (tuple(k for k in range(n) if k not in (0,) + rest)
                    for rest in itertools.combinations(range(1, n), s - 1))
            return "rotations", sets
    count = comb(n, s)
    if count <= MAX_SETS and count * cost <= MAX_WORK:
        return "exhaustive", itertools.combinations(range(n), N)
    return None


def _analytic_bound(code: MatrixCode, dtype: str) -> float | None:
    """max_K ρ(K) from the code's own bounds (`amplification_bound`, `residual_bound` for exact
    codes); None when it has none."""
    amp = code.amplification_bound()
    if amp is None:
        return None
    residual = code.residual_bound() if code.exact else 0.0
    if residual is None:
        return None
    return float(residual + (message_gamma(code, dtype) + 2 * gamma(code.n + 2, U64)) * amp)


def check_tolerance(tolerance: float) -> None:
    """The guard's tolerance: a decode error > 0 in units of ‖G‖_F (inf accepts every code)."""
    if not float(tolerance) > 0:   # NaN too
        raise InputError("stability", "tolerance", f"expected a decode error > 0 (in units of "
                         f"‖G‖_F), got {tolerance!r}")


def stability_report(code: MatrixCode, dtype: str = "float32",
                     tolerance: float = DEFAULT_TOLERANCE) -> StabilityReport:
    """Certify the worst-case decoding error of `code` with messages in `dtype`."""
    if dtype not in UNIT_ROUNDOFF:
        raise InputError("stability", "dtype", f"expected one of {sorted(UNIT_ROUNDOFF)}, "
                                               f"got {dtype!r}")
    check_tolerance(tolerance)
    key = (dtype, float(tolerance))
    if key in code._stability:
        return code._stability[key]
    kappa = code.worst_case_condition()
    plan = survivor_sets(code)
    worst, worst_K, checked, approx = 0.0, None, 0, 0.0
    if plan is not None:
        method, sets = plan
        for K in sets:
            dec = code.decode(list(K))
            rho = decode_error_bound(dec, dtype)
            if not code.exact:
                approx = max(approx, dec.residual)
            if rho > worst or worst_K is None:
                worst, worst_K = rho, tuple(K)
            checked += 1
    else:
        bound = _analytic_bound(code, dtype)
        method = "uncertified" if bound is None else "analytic"
        worst = float("inf") if bound is None else bound
    if not code.exact and hasattr(code, "error_bound"):
        approx = max(approx, code.error_bound()) if method not in ("exhaustive", "rotations") \
            else approx
    report = StabilityReport(code.name, code.n, code.s, dtype, kappa, float(worst), tolerance,
                             recommend_stable(code.n, code.s), method, checked, worst_K, approx)
    code._stability[key] = report
    log.debug("%s", report.message())
    return report


def check_stability(code: MatrixCode, dtype: str = "float32",
                    tolerance: float = DEFAULT_TOLERANCE, on_unstable: str = "raise"
                    ) -> StabilityReport:
    """Refuse (`on_unstable="raise"`) or warn (`"warn"`) when the code is unstable for `dtype`."""
    if on_unstable not in ("raise", "warn", "ignore"):
        raise InputError("stability", "on_unstable",
                         f"expected 'raise', 'warn' or 'ignore', got {on_unstable!r}")
    report = stability_report(code, dtype, tolerance)
    if not report.stable and on_unstable != "ignore" and np.isfinite(tolerance):
        if on_unstable == "raise":
            raise UnstableCodeError(report.message())
        warnings.warn(report.message(), RuntimeWarning, stacklevel=2)
    return report
