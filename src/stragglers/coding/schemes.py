"""One entry point to build any code by name, with the documented fallbacks."""

from __future__ import annotations

import warnings

from stragglers.coding.expander import ExpanderCode
from stragglers.coding.mds import CyclicMDSCode
from stragglers.coding.protocol import GradientCode, check_n_s
from stragglers.coding.repetition import (CyclicRepetitionCode, FractionalRepetitionCode,
                                          ignore_stragglers, wait_for_all)
from stragglers.coding.stability import DEFAULT_TOLERANCE, check_stability
from stragglers.errors import InputError

SCHEMES = ("wait-for-all", "ignore-stragglers", "frc", "cyclic-repetition", "cyclic-mds",
           "cyclic-mds-real", "cyclic-mds-complex", "expander")


def make_code(scheme: str, n: int, s: int, *, d: int | None = None, seed: int = 0,
              decoder: str = "optimal", dtype: str = "float32",
              tolerance: float = DEFAULT_TOLERANCE, on_unstable: str = "raise") -> GradientCode:
    """Build code `scheme` for n workers and s stragglers, then run the stability guard.

    "cyclic-mds" picks the real code when n−s is odd and otherwise falls back (FRC when
    (s+1) | n, else the complex code) with a warning; "cyclic-mds-real" with n−s even does the
    same fallback. Expander codes default to d = s+1 (or s+2 when n·(s+1) is odd).
    """
    if scheme not in SCHEMES:
        raise InputError("scheme", "scheme", f"expected one of {', '.join(SCHEMES)}, got {scheme!r}")
    check_n_s(scheme, n, s)
    if scheme == "wait-for-all":
        code: GradientCode = wait_for_all(n)
    elif scheme == "ignore-stragglers":
        code = ignore_stragglers(n, s)
    elif scheme == "frc":
        code = FractionalRepetitionCode(n, s)
    elif scheme == "cyclic-repetition":
        code = CyclicRepetitionCode(n, s, seed)
    elif scheme == "cyclic-mds-complex":
        code = CyclicMDSCode(n, s, "complex")
    elif scheme in ("cyclic-mds", "cyclic-mds-real"):
        code = _cyclic_mds_real_or_fallback(n, s)
    else:
        if d is None:
            d = s + 1 if (n * (s + 1)) % 2 == 0 else s + 2
            d = min(max(d, 1), n - 1)
        code = ExpanderCode(n, s, d, seed, decoder)
    check_stability(code, dtype, tolerance, on_unstable)
    return code


def _cyclic_mds_real_or_fallback(n: int, s: int) -> GradientCode:
    if (n - s) % 2 == 1:
        return CyclicMDSCode(n, s, "real")
    if n % (s + 1) == 0:
        warnings.warn(f"no real cyclic MDS code exists for n={n}, s={s} (n-s even); "
                      f"using fractional repetition instead", RuntimeWarning, stacklevel=3)
        return FractionalRepetitionCode(n, s)
    warnings.warn(f"no real cyclic MDS code exists for n={n}, s={s} (n-s even); using the "
                  f"complex cyclic MDS code instead (workers send complex combinations)",
                  RuntimeWarning, stacklevel=3)
    return CyclicMDSCode(n, s, "complex")
