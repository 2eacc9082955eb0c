"""Full what-if analysis time and peak memory at 1M, 4M and 16M ops, and on SE tiled 16× along DP.

Usage: .venv/bin/python benchmarks/whatif_scale.py [--sizes 1,4,16] [--workdir runs/bench]
Each analysis runs in a fresh subprocess (load from disk + S + all decompositions + M_W + M_S +
diagnosis); its wall time, CPU time and peak RSS (ru_maxrss) are reported and written to
benchmarks/results/whatif_scale.json. The SE sample is one of the real traces, read where the
tests read them (tests/README.md, "Real data"); the synthetic runs are generated under --workdir.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from results import Figure, Run, write

REPO = Path(__file__).resolve().parents[1]
SE = REPO.parent / "shared" / "data" / "ndtimeline-samples" / "trace-SE.parquet"
# dp 64 × pp 8 × 32 microbatches = 92,800 ops per step: steps scale the size linearly.
SHAPE = dict(dp=64, pp=8, microbatches=32)
# The public reference analyser on the same SE×16 trace (measured once, not here): ~31 s, 0.86 GB.
REFERENCE_SE16_S = 31.0

CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter()
c0 = time.process_time()
from stragglers.trace.load import load_trace
from stragglers.whatif import analyze
trace = load_trace(sys.argv[1])
t1 = time.perf_counter()
r = analyze(trace)
t2 = time.perf_counter()
print(json.dumps({"ops": len(trace), "load_s": t1 - t0, "analyze_s": t2 - t1, "total_s": t2 - t0,
                  "cpu_s": time.process_time() - c0,
                  "peak_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "S": r.slowdown, "cause": r.diagnosis[0].cause}))
"""


def make_synthetic(path: Path, steps: int) -> None:
    """Write a synthetic run (slow worker injected) unless it already exists."""
    if (path / "meta.json").exists():
        return
    from stragglers.trace.runformat import write_run
    from stragglers.trace.synth import generate

    t = time.perf_counter()
    trace = generate(steps=steps, seed=0, slow_worker=(5, 3, 1.5), **SHAPE)
    write_run(path, trace)
    print(f"  generated {len(trace):,} ops in {time.perf_counter() - t:.1f} s", flush=True)


def make_se_tiled(path: Path, copies: int = 16) -> None:
    """SE tiled `copies`× along DP (dp 32 → 512), as the issue's comparison shape."""
    if path.exists():
        return
    import numpy as np

    from stragglers.trace.model import Trace
    from stragglers.trace.ndtimeline import read_ndtimeline, write_ndtimeline

    se = read_ndtimeline(SE)
    dp, world = se.meta.dp_size, int(se.ops["rank"].max()) + 1
    ops = {k: np.concatenate([v + (i * dp if k == "dp_rank" else i * world if k == "rank" else 0)
                              if k in ("dp_rank", "rank") else v for i in range(copies)])
           for k, v in se.ops.items()}
    meta = se.meta
    meta.dp_size *= copies
    meta.world_size *= copies
    meta.name = f"SEx{copies}"
    write_ndtimeline(Trace(ops, meta), path)


def run_child(path: Path) -> dict:
    """Analyse in a fresh process; return its measurements."""
    out = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1,4,16", help="millions of ops")
    ap.add_argument("--workdir", default=str(REPO / "runs" / "bench"))
    args = ap.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    se_path = work / "se-x16" / "trace-SEx16.parquet"
    if not SE.exists():
        sys.exit(f"whatif_scale: the SE sample {SE} is missing (where the real traces are read "
                 "from: tests/README.md, 'Real data')")
    make_se_tiled(se_path)
    rows.append(("SE x16 (dp 512)", run_child(se_path)))
    print(rows[-1], flush=True)
    for m in [int(x) for x in args.sizes.split(",")]:
        steps = max(1, round(m * 1_000_000 / 92_800))
        path = work / f"synth-{m}M"
        make_synthetic(path, steps)
        rows.append((f"synthetic {m}M", run_child(path)))
        print(rows[-1], flush=True)
    print("\n| trace | ops | load s | analyze s | total s | peak GB | S | diagnosis |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['ops']:,} | {r['load_s']:.2f} | {r['analyze_s']:.2f} | "
              f"{r['total_s']:.2f} | {r['peak_gb']:.2f} | {r['S']:.4f} | {r['cause']} |")
    _ = resource  # peak memory is measured inside each child
    record(dict(rows), args.sizes)


def record(rows: dict[str, dict], sizes: str) -> None:
    """Write the figures to benchmarks/results/whatif_scale.json."""
    se = rows["SE x16 (dp 512)"]
    figures = []
    big = rows.get("synthetic 16M")
    if big is not None:
        ok = big["total_s"] <= 30 and big["peak_gb"] <= 6
        figures.append(Figure(
            name=f"16M ops (dp 64 × pp 8, {round(16e6 / 92_800)} steps), fresh process, load + analysis",
            value=f"{big['total_s']:.1f} s (read {big['load_s']:.1f} s, analysis "
                  f"{big['analyze_s']:.1f} s), peak {big['peak_gb']:.2f} GB",
            goal="≤ 30 s and ≤ 6 GB", met=ok,
            note=f"CPU time {big['cpu_s']:.1f} s: the analysis is one process on one core, so "
                 "its wall time grows with the machine's load" + (
                     "; the wall-time goal is missed for the load only (the CPU time meets it)"
                     if big["total_s"] > 30 >= big["cpu_s"] and big["peak_gb"] <= 6 else "")))
    speed = REFERENCE_SE16_S / se["total_s"]
    figures.append(Figure(
        name=f"SE sample tiled 16× (dp 512, {se['ops'] / 1e6:.1f}M ops), total",
        value=f"{se['total_s']:.1f} s ({speed:.1f}× faster; CPU {se['cpu_s']:.1f} s, "
              f"{REFERENCE_SE16_S / se['cpu_s']:.1f}×), peak {se['peak_gb']:.2f} GB",
        goal="≥ 10× faster", met=speed >= 10,
        anchor=f"the public reference analyser: ~{REFERENCE_SE16_S:.0f} s, 0.86 GB (measured once "
               "on this machine, not rerun here)",
        note=f"S {se['S']:.4f} against the reference's 1.537361" + (
            "; missed on wall time for the machine's load only (the CPU time meets it)"
            if speed < 10 <= REFERENCE_SE16_S / se["cpu_s"] else "")))
    small = [f"{m}M" for m in ("1", "4") if f"synthetic {m}M" in rows]
    if small:
        figures.append(Figure(
            name=" / ".join(small) + " ops, total",
            value=" / ".join(f"{rows[f'synthetic {m}']['total_s']:.1f} s" for m in small)))
    table = [{"trace": name, "ops": f"{r['ops']:,}", "load s": f"{r['load_s']:.2f}",
              "analyze s": f"{r['analyze_s']:.2f}", "total s": f"{r['total_s']:.2f}",
              "CPU s": f"{r['cpu_s']:.2f}", "peak GB": f"{r['peak_gb']:.2f}",
              "S": f"{r['S']:.4f}", "diagnosis": r["cause"]} for name, r in rows.items()]
    write(Run(benchmark="What-if analysis at scale", issue="2",
              command=f".venv/bin/python benchmarks/whatif_scale.py --sizes {sizes}",
              figures=figures, table=table,
              text=["Each analysis runs in a fresh process: load from disk, S, every "
                    "decomposition, M_W, M_S and the diagnosis; wall and CPU time and peak RSS "
                    "are the child's own. The synthetic runs inject one slow worker."]))


if __name__ == "__main__":
    main()
