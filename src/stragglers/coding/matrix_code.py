"""The base class of every gradient code given by its encoding matrix B, and its decoding vectors.

It implements the interface `stragglers.protocols.GradientCode` (and `Decoding`).
"""

from __future__ import annotations

import numbers
from functools import cached_property
from typing import TYPE_CHECKING, Sequence

import msgspec
import numpy as np

from stragglers.errors import InputError


class CodeSummary(msgspec.Struct, kw_only=True):
    """What `stragglers coding info` prints first about a code."""

    name: str
    n: int
    s: int
    exact: bool
    parts_per_worker: int
    complex: bool
    decoder: str


class DecodingVector:
    """A decoding vector for one survivor set: aᵀB ≈ 1ᵀ with a supported on the survivors."""

    def __init__(self, code: "MatrixCode", survivors: Sequence[int], coefficients: np.ndarray,
                 method: str):
        self.code = code
        self.survivors = tuple(int(k) for k in survivors)
        self.coefficients = coefficients  # length n, zero outside the survivors
        self.method = method

    @cached_property
    def residual(self) -> float:
        """‖aᵀB − 1ᵀ‖₂: 0 (to rounding) for exact codes, the error factor for approximate ones."""
        combo = self.coefficients @ self.code.B
        return float(np.linalg.norm(combo - 1.0))

    @cached_property
    def amplification(self) -> float:
        """Σ_k |a_k|·‖b_k‖₂: how much the rounding of the messages is amplified (see stability)."""
        K = list(self.survivors)
        rows = np.linalg.norm(self.code.B[K], axis=1)
        return float(np.abs(self.coefficients[K]) @ rows)

    @cached_property
    def condition_number(self) -> float:
        """σ_max/σ_min of the survivors' rows B_K (nonzero singular values): error amplification."""
        return condition_number(self.code.B[list(self.survivors)])

    def combine(self, messages: np.ndarray) -> np.ndarray:
        """Σ_k a_k f_k in float64 (complex codes: the real part) for messages stacked by survivor."""
        messages = np.asarray(messages)
        if messages.ndim == 0 or messages.shape[0] != len(self.survivors):
            got = messages.shape[0] if messages.ndim else "a scalar"
            raise InputError(self.code.name, "messages", f"expected one message per survivor "
                                                         f"({len(self.survivors)} rows), got {got}")
        a = self.coefficients[list(self.survivors)]
        out = a @ messages.astype(np.result_type(a.dtype, np.float64), copy=False)
        return np.real(out) if np.iscomplexobj(out) else out

    def __repr__(self) -> str:
        return (f"DecodingVector(code={self.code.name}, survivors={list(self.survivors)}, "
                f"method={self.method})")


def condition_number(rows: np.ndarray) -> float:
    """2-norm condition number over the nonzero singular values (repeated rows are harmless)."""
    sv = np.linalg.svd(np.asarray(rows), compute_uv=False)
    if sv.size == 0 or sv[0] == 0:
        return float("inf")
    nonzero = sv[sv > sv[0] * max(rows.shape) * np.finfo(np.float64).eps]
    return float(nonzero[0] / nonzero[-1])


def worker_id(code_name: str, field: str, value: object) -> int:
    """`value` as a worker id: an integer (or an integral float); anything else is an InputError."""
    if isinstance(value, bool) or not isinstance(value, (numbers.Integral, numbers.Real)):
        raise InputError(code_name, field, f"expected integer worker ids, got {value!r}")
    if not isinstance(value, numbers.Integral):
        if not float(value).is_integer():
            raise InputError(code_name, field, f"expected integer worker ids, got {value!r}")
    return int(float(value)) if not isinstance(value, numbers.Integral) else int(value)


class MatrixCode:
    """A gradient code given by its encoding matrix B: n workers, n data parts, s stragglers."""

    name = "code"
    exact = True  # exact codes recover Σ g_j from any n−s survivors
    # True when every survivor set decodes with the same |a| pattern (FRC, B = I, fixed
    # expander decoder): the guard then needs one set, not all of them
    uniform_decoding = False
    # True when B is circulant (row i+1 is row i shifted): rotations of a survivor set decode
    # alike, so the guard enumerates survivor sets up to rotation
    circulant = False
    decoder = "lstsq"

    def __init__(self, n: int, s: int, B: np.ndarray):
        self.n = n
        self.s = s
        self.B = B
        self._stability: dict = {}  # (dtype, tolerance) -> StabilityReport, filled by the guard

    @property
    def needed(self) -> int:
        """How many arrivals the aggregator waits for (n − s)."""
        return self.n - self.s

    @property
    def is_complex(self) -> bool:
        """True when B has complex entries (workers then send complex combinations)."""
        return np.iscomplexobj(self.B)

    def parts(self, worker: int) -> tuple[int, ...]:
        """The data parts worker `worker` holds: supp(b_worker)."""
        w = self._check_worker(worker)
        return tuple(int(j) for j in np.flatnonzero(self.B[w] != 0))

    def weights(self, worker: int) -> np.ndarray:
        """Worker `worker`'s encoding weights on its parts (same order as parts())."""
        w = self._check_worker(worker)
        return self.B[w, list(self.parts(w))]

    @property
    def parts_per_worker(self) -> int:
        """The largest number of parts one worker holds (d)."""
        return int((self.B != 0).sum(axis=1).max())

    def decode(self, survivors: Sequence[int]) -> DecodingVector:
        """A decoding vector supported on `survivors` (at least n−s distinct workers)."""
        K = self._check_survivors(survivors)
        return self._decode(K)

    def _decode(self, K: list[int]) -> DecodingVector:
        return least_squares_decoding(self, K)

    def worst_case_condition(self) -> float:
        """The condition number of B_K for the contiguous survivor set 0..n−s−1 (informative:
        the guard bounds the decode error itself, over every survivor set)."""
        return self.decode(range(self.needed)).condition_number

    def amplification_bound(self) -> float | None:
        """An upper bound on Σ_k |a_k|·‖b_k‖₂ over every survivor set, or None if unknown."""
        return None

    def residual_bound(self) -> float | None:
        """An upper bound on the decoder's residual ‖aᵀB − 1ᵀ‖₂ over every set, or None."""
        return None

    def describe(self) -> CodeSummary:
        """A summary (name, n, s, parts per worker, exactness, decoder)."""
        return CodeSummary(name=self.name, n=self.n, s=self.s, exact=self.exact,
                           parts_per_worker=self.parts_per_worker, complex=self.is_complex,
                           decoder=self.decoder)

    def _check_worker(self, worker: object, field: str = "worker") -> int:
        w = worker_id(self.name, field, worker)
        if not 0 <= w < self.n:
            raise InputError(self.name, field, f"expected 0 <= worker < {self.n}, got {worker!r}")
        return w

    def _check_survivors(self, survivors: Sequence[int]) -> list[int]:
        if isinstance(survivors, (str, bytes)) or not hasattr(survivors, "__iter__"):
            raise InputError(self.name, "survivors", f"expected a sequence of worker ids, "
                                                     f"got {survivors!r}")
        K = [self._check_worker(k, "survivors") for k in survivors]
        if len(set(K)) != len(K):
            raise InputError(self.name, "survivors", f"expected distinct workers, got {K}")
        if len(K) < self.needed:
            raise InputError(self.name, "survivors",
                             f"expected at least n-s = {self.needed} survivors, got {len(K)}")
        return K

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={self.n}, s={self.s})"


def least_squares_decoding(code: MatrixCode, K: list[int], method: str = "lstsq") -> DecodingVector:
    """General decoder: min-norm a on K with B_Kᵀ a = 1, solved in float64 (SVD least squares,
    backward stable: its residual is at rounding level whatever the conditioning)."""
    BK = code.B[K]
    ones = np.ones(code.n, dtype=BK.dtype)
    aK, *_ = np.linalg.lstsq(BK.T, ones, rcond=None)
    a = np.zeros(code.n, dtype=aK.dtype)
    a[K] = aK
    return DecodingVector(code, K, a, method)


# Codes are dense n × n matrices built and certified with O(n³) linear algebra (an expander
# code's spectrum, least-squares decoders): n = 1,000 takes ~18 s on this 2-core machine under
# load, n = 2,048 a few minutes; n = 100,000 asked for 75 GB.
MAX_WORKERS = 2048


def check_n_s(source: str, n: int, s: int) -> None:
    """Validate the basic parameters: 1 <= n <= MAX_WORKERS workers, 0 <= s < n stragglers."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise InputError(source, "n", f"expected a positive number of workers, got {n!r}")
    if n > MAX_WORKERS:
        raise InputError(source, "n", f"expected at most {MAX_WORKERS} workers (codes are dense "
                         f"n × n matrices built in O(n³) time), got {n}")
    if isinstance(s, bool) or not isinstance(s, (int, np.integer)) or not 0 <= s < n:
        raise InputError(source, "s", f"expected 0 <= s < n = {n} stragglers, got {s!r}")


if TYPE_CHECKING:   # the checker proves the base class and its decoding implement the protocols
    from stragglers.protocols import Decoding, GradientCode

    def _is_gradient_code(code: MatrixCode) -> GradientCode:
        return code

    def _is_decoding(decoding: DecodingVector) -> Decoding:
        return decoding
