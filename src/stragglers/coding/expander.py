"""Approximate gradient codes from d-regular expander graphs (Raviv et al. 2018, §5).

B = A_G/d for a random d-regular graph G on the n workers: worker i holds the parts of its d
neighbours. Decoders: fixed u = n/(n−s)·1_K (free, unbiased under uniformly random stragglers)
and optimal u = argmin ‖uᵀB − 1ᵀ‖₂ over supp(u) ⊆ K (least squares). The fixed decoder obeys
‖uᵀB − 1ᵀ‖₂ ≤ (λ/d)·√(ns/(n−s)) for λ the second largest |eigenvalue| of A_G.
"""

from __future__ import annotations

import msgspec
import numpy as np

from stragglers.coding.matrix_code import (CodeSummary, DecodingVector, MatrixCode, check_n_s,
                                           least_squares_decoding)
from stragglers.errors import InputError, StragglersError


def random_regular_graph(n: int, d: int, seed: int = 0, tries: int = 200) -> np.ndarray:
    """Adjacency matrix of a uniform-ish random simple connected d-regular graph (Steger–Wormald)."""
    if not 1 <= d < n or (n * d) % 2:
        raise InputError("expander", "d", f"expected 1 <= d < n = {n} with n·d even, got d = {d}")
    rng = np.random.default_rng(seed)
    for _ in range(tries):
        A = _pair_points(n, d, rng)
        if A is not None and (d == 1 or _connected(A)):
            return A
    raise StragglersError(f"could not draw a connected simple {d}-regular graph on {n} vertices "
                          f"in {tries} tries; try another seed or d")


def _pair_points(n: int, d: int, rng: np.random.Generator) -> np.ndarray | None:
    # pair the n·d half-edges at random, refusing loops and repeated edges; restart if stuck
    A = np.zeros((n, n))
    points = list(np.repeat(np.arange(n), d))
    while points:
        for _ in range(50):
            i, j = rng.choice(len(points), 2, replace=False)
            u, v = points[i], points[j]
            if u != v and A[u, v] == 0:
                break
        else:
            return None
        A[u, v] = A[v, u] = 1.0
        for idx in sorted((i, j), reverse=True):
            points.pop(idx)
    return A


def _connected(A: np.ndarray) -> bool:
    seen = {0}
    frontier = [0]
    while frontier:
        nxt = np.flatnonzero(A[frontier].sum(axis=0))
        frontier = [int(v) for v in nxt if v not in seen]
        seen.update(frontier)
    return len(seen) == len(A)


def second_eigenvalue(A: np.ndarray) -> float:
    """λ: the second largest absolute eigenvalue of a symmetric adjacency matrix."""
    ev = np.sort(np.abs(np.linalg.eigvalsh(A)))
    return float(ev[-2])


class ExpanderSummary(CodeSummary, kw_only=True, rename={"lam": "lambda"}):
    """A code's summary plus the expander's degree, λ and worst-case errors."""

    d: int
    lam: float
    fixed_decoder_bound: float
    ignore_stragglers_error: float


class ExpanderCode(MatrixCode):
    """Approximate code B = A_G/d; `decoder` is "fixed" (n/(n−s)·1_K) or "optimal" (least squares)."""

    name = "expander"
    exact = False
    # the optimal decoder falls back to the fixed one when its coefficients would amplify the
    # message rounding more than this many times the fixed decoder does (so the guard can
    # bound every survivor set without enumerating them)
    OPTIMAL_CAP = 4.0

    def __init__(self, n: int, s: int, d: int, seed: int = 0, decoder: str = "optimal"):
        check_n_s(self.name, n, s)
        if decoder not in ("fixed", "optimal"):
            raise InputError(self.name, "decoder", f"expected 'fixed' or 'optimal', got {decoder!r}")
        self.d = d
        self.decoder = decoder
        self.uniform_decoding = decoder == "fixed"  # same |u| and row norms for every set
        self.adjacency = random_regular_graph(n, d, seed)
        self.lam = second_eigenvalue(self.adjacency)
        super().__init__(n, s, self.adjacency / d)

    def error_bound(self) -> float:
        """Worst-case ‖uᵀB − 1ᵀ‖₂ of the fixed decoder: (λ/d)·√(ns/(n−s))."""
        return self.lam / self.d * float(np.sqrt(self.n * self.s / (self.n - self.s)))

    def ignore_stragglers_error(self) -> float:
        """The same worst case for B = I (ignoring stragglers): √(ns/(n−s))."""
        return float(np.sqrt(self.n * self.s / (self.n - self.s)))

    def lower_bound(self) -> float:
        """No scheme with each part on <= d workers beats √⌊s/d⌋ in the worst case."""
        return float(np.sqrt(self.s // self.d))

    def decode_fixed(self, survivors) -> DecodingVector:
        """The fixed decoder u = n/(n−s)·1_K, no computation."""
        K = self._check_survivors(survivors)
        u = np.zeros(self.n)
        u[K] = self.n / len(K)
        return DecodingVector(self, K, u, "fixed")

    def decode_optimal(self, survivors) -> DecodingVector:
        """The optimal decoder argmin ‖uᵀB − 1ᵀ‖₂ with supp(u) ⊆ K (float64 least squares).

        Falls back to the fixed decoder (method "fixed (fallback)") when least squares is not
        better than it or would amplify rounding more than OPTIMAL_CAP times the fixed one:
        the result is never worse than the fixed decoder's bound, and numerically bounded.
        """
        K = self._check_survivors(survivors)
        best = least_squares_decoding(self, K, "optimal")
        fixed = self.decode_fixed(K)
        if best.residual > fixed.residual or \
                best.amplification > self.OPTIMAL_CAP * fixed.amplification:
            return DecodingVector(self, K, fixed.coefficients, "fixed (fallback)")
        return best

    def amplification_bound(self) -> float:
        """Σ_k |u_k|·‖b_k‖₂ <= n/√d (fixed), OPTIMAL_CAP times that (optimal), every set."""
        fixed = self.n / np.sqrt(self.d)
        return fixed if self.decoder == "fixed" else self.OPTIMAL_CAP * fixed

    def _decode(self, K: list[int]) -> DecodingVector:
        return self.decode_fixed(K) if self.decoder == "fixed" else self.decode_optimal(K)

    def describe(self) -> ExpanderSummary:
        """Summary plus d, λ, the decoder and its worst-case error bound."""
        base = msgspec.structs.asdict(super().describe())
        return ExpanderSummary(**base, d=self.d, lam=self.lam,
                               fixed_decoder_bound=self.error_bound(),
                               ignore_stragglers_error=self.ignore_stragglers_error())
