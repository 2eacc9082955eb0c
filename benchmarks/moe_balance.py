"""Expert imbalance on a real MoE job: the diagnosis's predicted gain of balanced routing against
the measured gain, running both.

Pairs of `examples/train_moe.py` runs under torchrun (`--ranks` gloo ranks, one expert each, EP
over all of them), one with a hot expert (`--hot-expert R/2 --routing-skew P`), one with balanced
routing (`--balanced`), same seed, alternated so the machine's load falls on both alike. The
skewed run is analysed: its `expert_imbalance` finding predicts the speedup of balanced routing
(`speedup_if_fixed`, on the replay's basis without launch delays, and the measured step with
those seconds taken off, as `stragglers advise` prices it). Measured: the mean step time of
the skewed run over the balanced one's (warm-up steps left out, as the analysis leaves them),
and the same on the replay's basis (each run's replay without launch delays).

    .venv/bin/python benchmarks/moe_balance.py [--pairs 3] [--steps 16] [--skew 0.6] [--ranks 4]

The prediction assumes what the analysis assumes of every job, a device per rank: with more
ranks than cores the ranks share CPUs, the waiting ranks give theirs to the busy one, and the
measured gain of balanced routing is smaller than on dedicated devices (or a loss).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from stragglers.trace.load import load_trace  # noqa: E402
from stragglers.whatif import analyze  # noqa: E402
from stragglers.whatif.grid import build_grid  # noqa: E402
from stragglers.whatif.metrics import WhatIf  # noqa: E402


def run(out: Path, steps: int, args: list[str], ranks: int = 4) -> None:
    """One run of the MoE example on `ranks` gloo ranks."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={ranks}",
           str(REPO / "examples" / "train_moe.py"), "--steps", str(steps), "--d-expert", "1024",
           "--out", str(out), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    subprocess.run(cmd, check=True, env=env, cwd=REPO, capture_output=True, timeout=900)


def step_times(trace, warmup: list[int]):
    """(mean measured step time, mean replayed step time without launch delays)."""
    grid = build_grid(trace)
    grid = grid.select_steps(~np.isin(grid.steps, warmup))
    w = WhatIf.build(grid)
    return float(w.t_base.mean()), float(w.t_nodelay.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--skew", type=float, default=0.6)
    ap.add_argument("--ranks", type=int, default=4,
                    help="EP ranks (one expert each); more ranks than cores share them, and "
                         "the machine then measures total work, not the slowest rank")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="moe-balance-") as root:
        for i in range(args.pairs):
            hot, even = Path(root) / f"hot{i}", Path(root) / f"even{i}"
            hot_rank = args.ranks // 2
            run(hot, args.steps, ["--hot-expert", str(hot_rank), "--routing-skew",
                                  str(args.skew), "--seed", str(i)], args.ranks)
            run(even, args.steps, ["--balanced", "--seed", str(i)], args.ranks)
            t_hot, t_even = load_trace(hot), load_trace(even)
            result = analyze(t_hot)
            warmup = [int(s) for s in result.warmup_steps]
            finding = next((f for f in result.diagnosis if f.cause == "expert_imbalance"), None)
            hot_base, hot_nodelay = step_times(t_hot, warmup)
            even_base, even_nodelay = step_times(t_even, warmup)
            predicted = finding.speedup_if_fixed if finding else None
            # advise's footing: the seconds the replay saves, off the measured step
            saved = hot_nodelay - hot_nodelay / predicted if predicted else 0.0
            rows.append({"first": result.diagnosis[0].cause,
                         "ranks": result.diagnosis[0].where.ranks,
                         "predicted": predicted, "predicted_measured": hot_base / (hot_base - saved),
                         "measured": hot_base / even_base,
                         "measured_nodelay": hot_nodelay / even_nodelay})
            r = rows[-1]
            print(f"pair {i}: first finding {r['first']} {r['ranks']}; predicted ×{predicted:.3f} "
                  f"(replay basis), ×{r['predicted_measured']:.3f} (off the measured step); "
                  f"measured ×{r['measured']:.3f} (steps), ×{r['measured_nodelay']:.3f} "
                  f"(replay basis)", flush=True)
    for key, against in (("predicted", "measured_nodelay"), ("predicted_measured", "measured")):
        errors = [abs((r[key] - 1) - (r[against] - 1)) / (r[against] - 1) for r in rows
                  if r[key] and r[against] > 1]
        print(f"{key} vs {against}: gain error per pair "
              + ", ".join(f"{100 * e:.0f}%" for e in errors)
              + (f"; median {100 * statistics.median(errors):.0f}% (goal ≤ 15%)" if errors else ""))


if __name__ == "__main__":
    main()
