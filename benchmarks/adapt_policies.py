"""BSP vs AntDT-DD vs AntDT-ND under the same injected stragglers, 4 workers, in one run.

    .venv/bin/python benchmarks/adapt_policies.py [--steps 40] [--sample-time 0.02]

Patterns (speeds are injected by sleeping b x sample_time / speed, see heterogeneity.py):
  free        speeds 1,1,1,1                      the straggler-free reference
  hetero      speeds 1,1,1,0.33 (deterministic)  bsp, dd, nd
  persistent  rank 3 3x slower from step 3        bsp, dd, nd (ND may KILL_RESTART it)
Ideal throughput = sum of speeds / sample_time. Steady state = steps after --skip (the
controller's first window and the action lag); the whole-run number is printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import Figure, Run, write

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "train_adaptive.py"


def run(name: str, policy: str, extra: list[str], args, root: Path) -> dict:
    work = root / name
    shutil.rmtree(work, ignore_errors=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "--max-restarts", "1", str(EXAMPLE), "--policy", policy, "--steps", str(args.steps),
           "--global-batch", str(args.global_batch), "--memory-cap", str(args.memory_cap),
           "--sample-time", str(args.sample_time), "--workdir", str(work),
           "--restart-cost", str(args.restart_cost), *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    wall = time.time() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{name}/{policy} failed:\n{proc.stderr[-3000:]}")
    rows = [json.loads(l) for l in (work / "metrics.jsonl").read_text().splitlines()]
    return {"rows": rows, "wall_s": wall}


def throughput(rows: list[dict], first_step: int, inc: int | None = None) -> float:
    """Samples/s over steps > first_step (of one incarnation), from rank 0's step timestamps."""
    sel = [r for r in rows if r["step"] > first_step and (inc is None or r["inc"] == inc)]
    if len(sel) < 3:
        return float("nan")
    return sum(r["samples"] for r in sel[1:]) / (sel[-1]["t"] - sel[0]["t"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sample-time", type=float, default=0.02)
    p.add_argument("--global-batch", type=int, default=128)
    p.add_argument("--memory-cap", type=int, default=32, help="samples per micro-batch")
    p.add_argument("--skip", type=int, default=10, help="steps left out of the steady state")
    p.add_argument("--restart-cost", type=float, default=10.0)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="adapt-policies-"))
    hetero = ["--speeds", "1,1,1,0.33"]
    persistent = ["--speeds", "1,1,1,1", "--persistent-rank", "3", "--persistent-start", "3"]
    runs = {("free", "bsp"): run("free", "bsp", ["--speeds", "1,1,1,1"], args, root)}
    for pattern, extra in (("hetero", hetero), ("persistent", persistent)):
        for policy in ("bsp", "dd", "nd"):
            print(f"running {pattern}/{policy} ...", file=sys.stderr, flush=True)
            runs[(pattern, policy)] = run(f"{pattern}-{policy}", policy, extra, args, root)
    ideal_hetero = (1 + 1 + 1 + 0.33) / args.sample_time
    free = throughput(runs[("free", "bsp")]["rows"], args.skip)
    # The same ideal with a speed-1 worker's *measured* throughput (sleep + real compute + sync)
    # from the straggler-free run, instead of the nominal 1 / sample_time.
    measured_ideal = free * (1 + 1 + 1 + 0.33) / 4
    out = {"ideal_hetero_samples_per_s": ideal_hetero, "free_bsp_samples_per_s": free,
           "measured_ideal_hetero_samples_per_s": measured_ideal}
    for (pattern, policy), r in runs.items():
        rows = r["rows"]
        incs = sorted({x["inc"] for x in rows})
        last = [x for x in rows if x["inc"] == incs[-1]]
        entry = {"steady_samples_per_s": throughput(last, max(args.skip, last[0]["step"] + 2)),
                 "whole_run_samples_per_s": throughput(rows, 0), "wall_s": r["wall_s"],
                 "incarnations": len(incs), "final_batch_sizes": rows[-1]["batch_sizes"]}
        if len(incs) > 1:
            later = [x for x in rows if x["inc"] == incs[-1]]
            entry["after_restart_samples_per_s"] = throughput(rows, later[0]["step"] + 2, incs[-1])
            last_old = [x for x in rows if x["inc"] == incs[0]][-1]
            entry["restart_gap_s"] = later[0]["t"] - last_old["t"]
            entry["restart_at_step"] = last_old["step"]
        out[f"{pattern}/{policy}"] = entry
    dd, bsp = out["hetero/dd"]["steady_samples_per_s"], out["hetero/bsp"]["steady_samples_per_s"]
    nd_after = out["persistent/nd"].get("after_restart_samples_per_s", float("nan"))
    out["goals"] = {
        "dd_vs_ideal": dd / ideal_hetero, "dd_vs_ideal_met": dd / ideal_hetero >= 0.9,
        "dd_vs_measured_ideal": dd / measured_ideal,
        "dd_vs_bsp": dd / bsp, "dd_vs_bsp_met": dd / bsp >= 1.8,
        "nd_after_restart_vs_free": nd_after / free, "nd_after_restart_met": nd_after / free >= 0.9,
    }
    print(json.dumps(out, indent=1, default=lambda x: round(x, 3)))
    record(args, out)


def record(args, out: dict) -> None:
    """The figures, for BENCHMARKS.md (benchmarks/results/adapt_policies.json)."""
    g = out["goals"]
    write(Run(
        benchmark="AntDT policies under injected stragglers (4 torchrun ranks, CPU)", issue="6",
        command=f".venv/bin/python benchmarks/adapt_policies.py --steps {args.steps}"
                f" --sample-time {args.sample_time:g} --global-batch {args.global_batch}",
        figures=[
            Figure(name="DD steady throughput / ideal (speeds 1,1,1,0.33)",
                   value=f"{g['dd_vs_ideal']:.2f}", goal=">= 0.90", met=g["dd_vs_ideal_met"],
                   anchor=f"measured ideal: {g['dd_vs_measured_ideal']:.2f}"),
            Figure(name="DD / BSP steady throughput (speeds 1,1,1,0.33)",
                   value=f"{g['dd_vs_bsp']:.2f}x", goal=">= 1.8x", met=g["dd_vs_bsp_met"]),
            Figure(name="ND after KILL_RESTART / straggler-free (rank 3 3x slow)",
                   value=f"{g['nd_after_restart_vs_free']:.2f}", goal=">= 0.90",
                   met=g["nd_after_restart_met"]),
        ],
        table=[{"case": case, "steady samples/s": f"{e['steady_samples_per_s']:.1f}",
                "whole run": f"{e['whole_run_samples_per_s']:.1f}",
                "incarnations": str(e["incarnations"])}
               for case, e in out.items() if "/" in case]))


if __name__ == "__main__":
    main()
