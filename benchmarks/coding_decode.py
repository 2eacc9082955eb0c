"""Decode time for n = 64: closed form vs least squares, side by side in one run.

    .venv/bin/python benchmarks/coding_decode.py
Goal: every decode for n = 64 under 1 ms.
"""

import time
import warnings

import numpy as np

from stragglers.coding import make_code, stability_report
from stragglers.coding.protocol import least_squares_decoding

N = 64
REPEATS = 200


def median_us(fn, sets) -> float:
    """Median wall time of fn(K) over the survivor sets, in microseconds."""
    times = []
    for K in sets:
        t0 = time.perf_counter()
        fn(K)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e6)


def main() -> None:
    """Print one row per (scheme, s)."""
    rng = np.random.default_rng(0)
    rows = []
    cases = [("cyclic-mds-real", s) for s in (1, 3, 5, 7)]
    cases += [("cyclic-mds-complex", s) for s in (1, 2, 4, 8)]
    cases += [("frc", s) for s in (1, 3, 7)]
    cases += [("cyclic-repetition", s) for s in (1, 4)]
    cases += [("expander", s) for s in (4, 8)]
    for scheme, s in cases:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            code = make_code(scheme, N, s, on_unstable="ignore")
        sets = [list(rng.permutation(N)[: N - s]) for _ in range(REPEATS)]
        ours = median_us(code.decode, sets)
        lstsq = median_us(lambda K: least_squares_decoding(code, K), sets)
        worst = max(code.decode(K).residual for K in sets[:20])
        verdict = "stable" if stability_report(code).stable else "guard refuses in float32"
        rows.append((code.name, s, code.decode(sets[0]).method, ours, lstsq, worst, verdict))
    print(f"n = {N}, median over {REPEATS} random survivor sets of size n - s")
    print(f"{'code':<20}{'s':>3}  {'method':<12}{'decode us':>10}{'lstsq us':>10}{'speedup':>9}"
          f"{'max resid':>11}  guard (float32)")
    for name, s, method, ours, lstsq, worst, verdict in rows:
        print(f"{name:<20}{s:>3}  {method:<12}{ours:>10.1f}{lstsq:>10.1f}{lstsq / ours:>9.2f}"
              f"{worst:>11.1e}  {verdict}")
    slowest = max(r[3] for r in rows)
    print(f"slowest decode: {slowest:.1f} us -> goal (< 1000 us) {'met' if slowest < 1000 else 'MISSED'}")


if __name__ == "__main__":
    main()
