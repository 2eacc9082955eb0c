"""Cyclic MDS gradient codes over the reals and the complex numbers (Raviv et al. 2018).

Row i of B is x^i·g(x) mod (x^n − 1) for a generator g of degree s whose roots are s
consecutive n-th roots of unity not containing 1. aᵀB = 1ᵀ ⇔ a(x)g(x) ≡ 1 + x + … + x^{n−1};
evaluating at the n−s non-roots ω^m turns that into a transposed Vandermonde system on the
survivor nodes z_k = ω^k, solved here in closed form in O(n·s).
"""

from __future__ import annotations

import numpy as np

from stragglers.coding.protocol import Decoding, GradientCode, check_n_s, least_squares_decoding
from stragglers.errors import InputError


class CyclicMDSCode(GradientCode):
    """Cyclic MDS code: `field="real"` (needs n−s odd) or `field="complex"` (any n, s)."""

    def __init__(self, n: int, s: int, field: str = "real"):
        check_n_s("cyclic-mds", n, s)
        if field not in ("real", "complex"):
            raise InputError("cyclic-mds", "field", f"expected 'real' or 'complex', got {field!r}")
        if field == "real" and (n - s) % 2 == 0:
            raise InputError("cyclic-mds", "s", f"the real cyclic MDS code needs n - s odd; got "
                                                f"n = {n}, s = {s} (use field='complex', or FRC "
                                                f"when (s+1) | n)")
        self.field = field
        self.name = f"cyclic-mds-{field}"
        # first root exponent: complex code roots ω^1..ω^s, real code roots centred on −1 = ω^{n/2}
        self.first_root = 1 if field == "complex" else (n - s + 1) // 2
        roots = np.exp(2j * np.pi * (self.first_root + np.arange(s)) / n)
        coeffs = np.poly(roots)[::-1] if s else np.ones(1, dtype=complex)  # ascending powers
        if field == "real":
            coeffs = coeffs.real.copy()
        self.generator = coeffs
        B = np.zeros((n, n), dtype=coeffs.dtype)
        for i in range(n):
            B[i, (i + np.arange(s + 1)) % n] = coeffs
        self.g_at_1 = coeffs.sum()
        super().__init__(n, s, B)

    def _decode(self, K: list[int]) -> Decoding:
        if len(K) > self.needed:
            # more survivors than needed: min-norm least squares over all of them (never worse)
            return least_squares_decoding(self, K)
        a = np.zeros(self.n, dtype=complex)
        a[K] = closed_form_coefficients(self.n, self.s, self.first_root, self.g_at_1, K)
        if self.field == "real":
            a = a.real.copy()
        return Decoding(self, K, a, "closed-form")

    def worst_case_condition(self) -> float:
        """Worst decode condition: stragglers in one contiguous block (survivors on one arc)."""
        return self.decode(range(self.needed)).condition_number


def closed_form_coefficients(n: int, s: int, first_root: int, g_at_1: complex,
                             K: list[int]) -> np.ndarray:
    """The decoding coefficients a_K of a cyclic MDS code in closed form, in O(n·s) operations.

    With b_k = a_k z_k^{shift}, the system is Σ_k b_k z_k^t = c·δ_{t,t0} (t = 0..N−1, N = n−s),
    whose solution is b_k = c·[x^{t0}] L_k(x) for the Lagrange basis L_k on the nodes z_K. The
    coefficient is read off by a length-n DFT of L_k; since the nodes are n-th roots of unity,
    every product over survivors turns into one over the s stragglers S:
    Π_{j∈K, j≠k}(z_k − z_j) = n z_k^{-1} / Π_{m∈S}(z_k − ω^m), which keeps the arithmetic short
    and accurate (no products of n−s factors). For the complex code (t0 = N−1) this equals the
    spec's Lagrange form a_k = (n/g(1))·z_k^{N−1}/Π_{j∈K, j≠k}(z_k − z_j).
    """
    K = np.asarray(K)
    S = np.setdiff1d(np.arange(n), K)
    shift = first_root + s  # exponent of the first non-root: m = shift + t, t = 0..N−1
    t0 = (n - shift) % n  # the moment that must equal n/g(1) (m ≡ 0); all others vanish
    c = n / g_at_1
    omega = np.exp(2j * np.pi * np.arange(n) / n)
    zK, zS = omega[K], omega[S]
    b = omega[(-K * t0) % n].astype(complex)  # z_k^{-t0}, exact exponent arithmetic
    if s:
        D = zK[:, None] - zS[None, :]  # N × s
        prod_K = D.prod(axis=1)  # Π_{m∈S}(z_k − ω^m)
        DS = zS[:, None] - zS[None, :]
        np.fill_diagonal(DS, 1.0)
        P_S = n * omega[(-S) % n] / DS.prod(axis=1)  # P(ω^m) = Π_{j∈K}(ω^m − z_j)
        weights = P_S * omega[(-S * t0) % n]
        b = b - (zK * prod_K / n) * (D ** -1 @ weights)
    return (c / n) * b * omega[(-K * shift) % n]
