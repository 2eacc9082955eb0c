"""Decode time and accuracy for n = 64: the closed form vs least squares, side by side.

    .venv/bin/python benchmarks/coding_decode.py
Goal: every decode for n = 64 under 1 ms. Accuracy: the residual ‖aᵀB − 1ᵀ‖₂ over random
survivor sets and over the contiguous one (survivors on an arc: the worst case of cyclic
codes), for the default decoder and, for cyclic MDS codes, the closed form too.
"""

import time
import warnings

import numpy as np
from results import Figure, Run, write

from stragglers.coding import CyclicMDSCode, make_code, stability_report

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


def worst_residual(code, sets) -> float:
    """The largest residual over the random sets and the contiguous survivor set."""
    return max(code.decode(K).residual for K in sets[:20] + [list(range(code.needed))])


def main() -> None:
    """Print one row per (code, s, decoder)."""
    rng = np.random.default_rng(0)
    rows = []
    cases = [("cyclic-mds-real", s) for s in (1, 3, 5, 7, 11)]
    cases += [("cyclic-mds-complex", s) for s in (1, 2, 4, 8, 11)]
    cases += [("frc", s) for s in (1, 3, 7)]
    cases += [("cyclic-repetition", s) for s in (1, 4)]
    cases += [("expander", s) for s in (4, 8)]
    for scheme, s in cases:
        if scheme == "cyclic-mds-real" and (N - s) % 2 == 0:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            codes = [make_code(scheme, N, s, on_unstable="ignore")]
        if scheme.startswith("cyclic-mds"):
            codes.append(CyclicMDSCode(N, s, scheme.rsplit("-", 1)[1], decoder="closed-form"))
        sets = [list(rng.permutation(N)[: N - s]) for _ in range(REPEATS)]
        for code in codes:
            us = median_us(code.decode, sets)
            report = stability_report(code)
            verdict = "stable" if report.stable else f"refused ({report.method})"
            rows.append((code.name, s, code.decoder, us, worst_residual(code, sets), verdict))
    print(f"n = {N}, median over {REPEATS} random survivor sets of size n - s")
    print(f"{'code':<20}{'s':>3}  {'decoder':<12}{'decode us':>10}{'max resid':>11}  guard (float32)")
    for name, s, decoder, us, worst, verdict in rows:
        print(f"{name:<20}{s:>3}  {decoder:<12}{us:>10.1f}{worst:>11.1e}  {verdict}")
    slowest = max(r[3] for r in rows)
    print(f"slowest decode: {slowest:.1f} us -> goal (< 1000 us) {'met' if slowest < 1000 else 'MISSED'}")
    by_decoder: dict[str, float] = {}
    for _, _, decoder, us, _, _ in rows:
        by_decoder[decoder] = max(by_decoder.get(decoder, 0.0), us)
    figures = [Figure(name="slowest decode, n = 64, any code", value=f"{slowest:.0f} µs",
                      goal="< 1 ms", met=slowest < 1000)]
    figures += [Figure(name=f"slowest decode, {decoder}", value=f"{us:.0f} µs", goal="< 1 ms",
                       met=us < 1000) for decoder, us in sorted(by_decoder.items())]
    write(Run(benchmark="Gradient decode time, n = 64", issue="5, 13",
              command=".venv/bin/python benchmarks/coding_decode.py", figures=figures,
              table=grouped(rows)))


def grouped(rows: list[tuple]) -> list[dict[str, str]]:
    """One table row per (code, decoder): its s values, decode times and guard verdicts side by side."""
    out: dict[tuple[str, str], list[tuple]] = {}
    for row in rows:
        out.setdefault((row[0], row[2]), []).append(row)
    return [{"code": name, "decoder": decoder, "s": " / ".join(str(r[1]) for r in rs),
             "decode µs": " / ".join(f"{r[3]:.0f}" for r in rs),
             "max residual": " / ".join(f"{r[4]:.0e}" for r in rs),
             "guard (float32)": " / ".join(dict.fromkeys(r[5] for r in rs))}
            for (name, decoder), rs in out.items()]


if __name__ == "__main__":
    main()
