"""How long `stragglers.trace.synth.generate` takes for 1M, 4M and 16M-op jobs.

Goal: a 16M-op job in well under a minute. Each size runs in a fresh process (for its peak RSS);
the baseline, measured in the same process right before, is the floor any generator pays:
drawing one lognormal noise value and one exponential launch delay per op.

    .venv/bin/python benchmarks/synth_generate.py [--sizes 1e6 4e6 16e6] [--vpp 1]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

from results import Figure, Run, write

SHAPE = dict(dp=16, pp=8, microbatches=16)


def one(ops_target: int, vpp: int, injections: bool) -> dict:
    """Generate one job of about ops_target ops; return timings and peak memory."""
    import numpy as np

    from stragglers.trace.synth import generate

    per_step = len(generate(**SHAPE, vpp=vpp, steps=1))
    steps = max(1, round(ops_target / per_step))
    rng = np.random.default_rng(0)
    t = time.perf_counter()
    floor = np.exp(0.02 * rng.standard_normal(ops_target)) + rng.exponential(2e-5, ops_target)
    floor_s = time.perf_counter() - t
    del floor
    extra = dict(slow_worker=(3, 5, 1.5), heavy_last_stage=1.2, gc=(0.1, 0.2),
                 seq_imbalance="lognormal") if injections else {}
    t = time.perf_counter()
    trace = generate(**SHAPE, vpp=vpp, steps=steps, seed=1, **extra)
    gen_s = time.perf_counter() - t
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"ops": len(trace), "steps": steps, "vpp": vpp, "injections": injections,
            "generate_s": round(gen_s, 3), "floor_s": round(floor_s, 3),
            "ratio": round(gen_s / floor_s, 1), "peak_rss_mb": round(peak_mb),
            "mops_per_s": round(len(trace) / gen_s / 1e6, 2)}


def main() -> None:
    """Run every size in its own process and print one line each."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", nargs="+", type=float, default=[1e6, 4e6, 16e6])
    ap.add_argument("--vpp", type=int, default=1)
    ap.add_argument("--injections", action="store_true", help="all compute injections on")
    ap.add_argument("--one", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one(int(args.one), args.vpp, args.injections)))
        return
    print(f"job shape {SHAPE}, vpp {args.vpp}, injections {args.injections}")
    figures = []
    for size in args.sizes:
        cmd = [sys.executable, __file__, "--one", str(size), "--vpp", str(args.vpp)]
        if args.injections:
            cmd.append("--injections")
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        goal = "" if r["ops"] < 8e6 else ("  goal (< 60 s) met" if r["generate_s"] < 60
                                           else "  goal (< 60 s) MISSED")
        print(f"{r['ops']:>11,} ops ({r['steps']} steps): generate {r['generate_s']:6.2f} s "
              f"= {r['ratio']}x the sampling floor {r['floor_s']:.2f} s, "
              f"{r['mops_per_s']} Mops/s, peak RSS {r['peak_rss_mb']} MB{goal}")
        big = r["ops"] >= 8e6
        figures.append(Figure(
            name=f"generate {r['ops']:,} ops ({r['steps']} steps), vpp {args.vpp}"
                 + (", injections" if args.injections else ""),
            value=f"{r['generate_s']:.2f} s, peak RSS {r['peak_rss_mb']} MB",
            goal="< 60 s" if big else "", met=(r["generate_s"] < 60) if big else None,
            anchor=f"sampling floor {r['floor_s']:.2f} s in the same process ({r['ratio']}x)"))
    write(Run(benchmark="Synthetic job generation time", issue="",
              command=" ".join([".venv/bin/python benchmarks/synth_generate.py", *sys.argv[1:]]),
              figures=figures))


if __name__ == "__main__":
    main()
