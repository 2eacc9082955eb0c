"""One entry point to build any code by name, with the documented fallbacks.

Each scheme is a factory registered in `stragglers.protocols.GRADIENT_CODES` (name →
factory(n, s, d=, seed=, decoder=)), so `make_code` looks names up instead of branching.
"""

from __future__ import annotations

import warnings

from stragglers.coding.expander import ExpanderCode
from stragglers.coding.mds import CyclicMDSCode
from stragglers.coding.matrix_code import MatrixCode, check_n_s
from stragglers.coding.repetition import (CyclicRepetitionCode, FractionalRepetitionCode,
                                          ignore_stragglers, wait_for_all)
from stragglers.coding.stability import DEFAULT_TOLERANCE, check_stability, check_tolerance
from stragglers.errors import InputError
from stragglers.protocols import GRADIENT_CODES


def _no_options(scheme: str, d, decoder) -> None:
    # options that do not apply are refused, not silently ignored
    if d is not None:
        raise InputError(scheme, "d", f"the degree d applies to the 'expander' scheme only, "
                                      f"not {scheme!r}")
    if decoder is not None:
        raise InputError(scheme, "decoder", f"scheme {scheme!r} has one decoder; 'decoder' "
                                            f"applies to 'expander' and 'cyclic-mds*' only")


def _mds_decoder(scheme: str, d, decoder) -> str:
    if d is not None:
        raise InputError(scheme, "d", f"the degree d applies to the 'expander' scheme only, "
                                      f"not {scheme!r}")
    return "lstsq" if decoder is None else decoder


@GRADIENT_CODES.register("wait-for-all")
def _wait_for_all(n, s, *, d=None, seed=0, decoder=None):
    """B = I, s = 0: wait for every worker (s must be 0)."""
    _no_options("wait-for-all", d, decoder)
    if s != 0:
        raise InputError("wait-for-all", "s", f"wait-for-all tolerates no stragglers: expected "
                                              f"s = 0, got {s}")
    return wait_for_all(n)


@GRADIENT_CODES.register("ignore-stragglers")
def _ignore(n, s, *, d=None, seed=0, decoder=None):
    """B = I: sum the first n−s gradients and scale by n/(n−s)."""
    _no_options("ignore-stragglers", d, decoder)
    return ignore_stragglers(n, s)


@GRADIENT_CODES.register("frc")
def _frc(n, s, *, d=None, seed=0, decoder=None):
    """Fractional repetition; needs (s+1) | n."""
    _no_options("frc", d, decoder)
    return FractionalRepetitionCode(n, s)


@GRADIENT_CODES.register("cyclic-repetition")
def _cyclic_repetition(n, s, *, d=None, seed=0, decoder=None):
    """Tandon's cyclic code with random coefficients."""
    _no_options("cyclic-repetition", d, decoder)
    return CyclicRepetitionCode(n, s, seed)


@GRADIENT_CODES.register("cyclic-mds")
def _cyclic_mds(n, s, *, d=None, seed=0, decoder=None):
    """Real cyclic MDS when n−s is odd, else FRC when (s+1) | n, else complex (with a warning)."""
    return _cyclic_mds_real_or_fallback(n, s, _mds_decoder("cyclic-mds", d, decoder))


@GRADIENT_CODES.register("cyclic-mds-real")
def _cyclic_mds_real(n, s, *, d=None, seed=0, decoder=None):
    """The real cyclic MDS code (same fallback as cyclic-mds when n−s is even)."""
    return _cyclic_mds_real_or_fallback(n, s, _mds_decoder("cyclic-mds-real", d, decoder))


@GRADIENT_CODES.register("cyclic-mds-complex")
def _cyclic_mds_complex(n, s, *, d=None, seed=0, decoder=None):
    """The complex cyclic MDS code (any n, s; workers send complex combinations)."""
    return CyclicMDSCode(n, s, "complex", _mds_decoder("cyclic-mds-complex", d, decoder))


@GRADIENT_CODES.register("expander")
def _expander(n, s, *, d=None, seed=0, decoder=None):
    """Approximate code from a random d-regular graph (default d = s+1, or s+2 if n·(s+1) odd)."""
    if d is None:
        d = s + 1 if (n * (s + 1)) % 2 == 0 else s + 2
        d = min(max(d, 1), n - 1)
    return ExpanderCode(n, s, d, seed, "optimal" if decoder is None else decoder)


SCHEMES = tuple(GRADIENT_CODES.names())


def make_code(scheme: str, n: int, s: int, *, d: int | None = None, seed: int = 0,
              decoder: str | None = None, dtype: str = "float32",
              tolerance: float = DEFAULT_TOLERANCE, on_unstable: str = "raise") -> MatrixCode:
    """Build code `scheme` for n workers and s stragglers, then run the stability guard.

    "cyclic-mds" picks the real code when n−s is odd and otherwise falls back (FRC when
    (s+1) | n, else the complex code) with a warning; "cyclic-mds-real" with n−s even does the
    same fallback. Expander codes default to d = s+1 (or s+2 when n·(s+1) is odd). `d` and
    `decoder` are refused for schemes they do not apply to. The guard certifies the decode
    error of messages in `dtype` over every survivor set (see `stability`).
    """
    factory = GRADIENT_CODES.get(scheme, "scheme")
    check_n_s(scheme, n, s)
    check_tolerance(tolerance)   # before building: a big code takes a while
    code = factory(n, s, d=d, seed=seed, decoder=decoder)
    check_stability(code, dtype, tolerance, on_unstable)
    return code


def _cyclic_mds_real_or_fallback(n: int, s: int, decoder: str) -> MatrixCode:
    if (n - s) % 2 == 1:
        return CyclicMDSCode(n, s, "real", decoder)
    if n % (s + 1) == 0:
        warnings.warn(f"no real cyclic MDS code exists for n={n}, s={s} (n-s even); "
                      f"using fractional repetition instead", RuntimeWarning, stacklevel=4)
        return FractionalRepetitionCode(n, s)
    warnings.warn(f"no real cyclic MDS code exists for n={n}, s={s} (n-s even); using the "
                  f"complex cyclic MDS code instead (workers send complex combinations)",
                  RuntimeWarning, stacklevel=4)
    return CyclicMDSCode(n, s, "complex", decoder)
