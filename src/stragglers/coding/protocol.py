"""The interface every gradient code offers: encoding matrix, parts per worker, decoder."""

from __future__ import annotations

from functools import cached_property
from typing import Sequence

import numpy as np

from stragglers.errors import InputError


class Decoding:
    """A decoding vector for one survivor set: aᵀB ≈ 1ᵀ with a supported on the survivors."""

    def __init__(self, code: "GradientCode", survivors: Sequence[int], coefficients: np.ndarray,
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
    def condition_number(self) -> float:
        """σ_max/σ_min of the survivors' rows B_K (nonzero singular values): error amplification."""
        return condition_number(self.code.B[list(self.survivors)])

    def combine(self, messages: np.ndarray) -> np.ndarray:
        """Σ_k a_k f_k in float64 (complex codes: the real part) for messages stacked by survivor."""
        a = self.coefficients[list(self.survivors)]
        out = a @ np.asarray(messages, dtype=np.result_type(a.dtype, np.float64))
        return np.real(out) if np.iscomplexobj(out) else out

    def __repr__(self) -> str:
        return (f"Decoding(code={self.code.name}, survivors={list(self.survivors)}, "
                f"method={self.method})")


def condition_number(rows: np.ndarray) -> float:
    """2-norm condition number over the nonzero singular values (repeated rows are harmless)."""
    sv = np.linalg.svd(np.asarray(rows), compute_uv=False)
    if sv.size == 0 or sv[0] == 0:
        return float("inf")
    nonzero = sv[sv > sv[0] * max(rows.shape) * np.finfo(np.float64).eps]
    return float(nonzero[0] / nonzero[-1])


class GradientCode:
    """Base class: n workers, n data parts, encoding matrix B; tolerates s stragglers."""

    name = "code"
    exact = True  # exact codes recover Σ g_j from any n−s survivors

    def __init__(self, n: int, s: int, B: np.ndarray):
        self.n = n
        self.s = s
        self.B = B

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
        self._check_worker(worker)
        return tuple(int(j) for j in np.flatnonzero(self.B[worker] != 0))

    def weights(self, worker: int) -> np.ndarray:
        """Worker `worker`'s encoding weights on its parts (same order as parts())."""
        return self.B[worker, list(self.parts(worker))]

    def decode(self, survivors: Sequence[int]) -> Decoding:
        """A decoding vector supported on `survivors` (at least n−s distinct workers)."""
        K = self._check_survivors(survivors)
        return self._decode(K)

    def _decode(self, K: list[int]) -> Decoding:
        return least_squares_decoding(self, K)

    def worst_case_condition(self) -> float:
        """The worst condition number of a decode over survivor sets of size n−s (estimated)."""
        rng = np.random.default_rng(0)
        sets = [list(range(self.needed))]
        sets += [sorted(rng.choice(self.n, self.needed, replace=False)) for _ in range(24)]
        return max(self.decode(K).condition_number for K in sets)

    def describe(self) -> dict:
        """A plain summary (name, n, s, parts per worker, exactness)."""
        return {"name": self.name, "n": self.n, "s": self.s, "exact": self.exact,
                "parts_per_worker": max(len(self.parts(i)) for i in range(self.n)),
                "complex": self.is_complex}

    def _check_worker(self, worker: int) -> None:
        if not 0 <= int(worker) < self.n:
            raise InputError(self.name, "worker", f"expected 0 <= worker < {self.n}, got {worker}")

    def _check_survivors(self, survivors: Sequence[int]) -> list[int]:
        K = [int(k) for k in survivors]
        if len(set(K)) != len(K):
            raise InputError(self.name, "survivors", f"expected distinct workers, got {K}")
        for k in K:
            self._check_worker(k)
        if len(K) < self.needed:
            raise InputError(self.name, "survivors",
                             f"expected at least n-s = {self.needed} survivors, got {len(K)}")
        return K

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={self.n}, s={self.s})"


def least_squares_decoding(code: GradientCode, K: list[int], method: str = "lstsq") -> Decoding:
    """General fallback: min-norm a on K with B_Kᵀ a = 1, solved in float64 (O(n·|K|²))."""
    BK = code.B[K]
    ones = np.ones(code.n, dtype=BK.dtype)
    aK, *_ = np.linalg.lstsq(BK.T, ones, rcond=None)
    a = np.zeros(code.n, dtype=aK.dtype)
    a[K] = aK
    return Decoding(code, K, a, method)


def check_n_s(source: str, n: int, s: int) -> None:
    """Validate the basic parameters: n >= 1 workers, 0 <= s < n stragglers."""
    if not isinstance(n, (int, np.integer)) or n < 1:
        raise InputError(source, "n", f"expected a positive number of workers, got {n!r}")
    if not isinstance(s, (int, np.integer)) or not 0 <= s < n:
        raise InputError(source, "s", f"expected 0 <= s < n = {n} stragglers, got {s!r}")
