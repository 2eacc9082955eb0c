"""Repetition codes (Tandon et al. 2017) and the two uncoded baselines."""

from __future__ import annotations

import numpy as np

from stragglers.coding.matrix_code import DecodingVector, MatrixCode, check_n_s
from stragglers.errors import InputError


class FractionalRepetitionCode(MatrixCode):
    """FRC: n/(s+1) groups of s+1 workers, each group holds the same s+1 parts and sends their sum."""

    name = "frc"
    uniform_decoding = True  # one 0/1 coefficient per group, whatever the survivors
    decoder = "group-sum"

    def __init__(self, n: int, s: int):
        check_n_s(self.name, n, s)
        if n % (s + 1):
            raise InputError(self.name, "s", f"fractional repetition needs (s+1) | n; "
                                             f"got n = {n}, s = {s}")
        size = s + 1
        B = np.zeros((n, n))
        for i in range(n):
            g = i // size
            B[i, g * size:(g + 1) * size] = 1.0
        super().__init__(n, s, B)

    def group(self, worker: int) -> int:
        """The group index of a worker."""
        return worker // (self.s + 1)

    def _decode(self, K: list[int]) -> DecodingVector:
        # 0/1 weights: the first survivor of each group; no arithmetic beyond a sum
        a = np.zeros(self.n)
        seen: set[int] = set()
        for k in K:
            if self.group(k) not in seen:
                seen.add(self.group(k))
                a[k] = 1.0
        if len(seen) != self.n // (self.s + 1):  # unreachable with >= n-s survivors
            raise InputError(self.name, "survivors", f"a whole group straggled: {K}")
        return DecodingVector(self, K, a, "group-sum")


class CyclicRepetitionCode(MatrixCode):
    """Tandon's cyclic code: worker i holds parts i..i+s (mod n) with random real weights."""

    name = "cyclic-repetition"

    def __init__(self, n: int, s: int, seed: int = 0):
        check_n_s(self.name, n, s)
        rng = np.random.default_rng(seed)
        # H (s × n) with H·1 = 0; every row of B lies in ker(H), which contains 1 and has dim n−s
        H = rng.standard_normal((s, n))
        H -= H.mean(axis=1, keepdims=True)
        B = np.zeros((n, n))
        for i in range(n):
            rest = [(i + k) % n for k in range(1, s + 1)]
            B[i, i] = 1.0
            if s:
                B[i, rest] = np.linalg.solve(H[:, rest], -H[:, i])
        self.H = H
        super().__init__(n, s, B)


class IdentityCode(MatrixCode):
    """B = I: wait-for-all (s = 0) or ignore-stragglers (sum n−s arrivals, scale n/(n−s))."""

    uniform_decoding = True
    decoder = "scaled-sum"

    def __init__(self, n: int, s: int):
        check_n_s("identity", n, s)
        super().__init__(n, s, np.eye(n))
        self.name = "wait-for-all" if s == 0 else "ignore-stragglers"
        self.exact = s == 0

    def _decode(self, K: list[int]) -> DecodingVector:
        a = np.zeros(self.n)
        a[K] = self.n / len(K)
        return DecodingVector(self, K, a, "scaled-sum" if self.s else "sum")

    def error_bound(self) -> float:
        """Worst-case ‖aᵀB − 1ᵀ‖₂ with n−s survivors: exactly √(ns/(n−s))."""
        return float(np.sqrt(self.n * self.s / (self.n - self.s)))

    def worst_case_condition(self) -> float:
        """Always 1: the rows of I are orthonormal."""
        return 1.0


def wait_for_all(n: int) -> IdentityCode:
    """The synchronous baseline: every worker sends its own part's gradient; wait for all n."""
    return IdentityCode(n, 0)


def ignore_stragglers(n: int, s: int) -> IdentityCode:
    """The uncoded baseline: use the first n−s gradients and rescale by n/(n−s)."""
    return IdentityCode(n, s)
