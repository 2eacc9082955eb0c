"""The what-if of a run directory in one process against step partitions on a Dask LocalCluster
of 1 and 2 worker processes (issue 32, item 3): wall time, peak memory (the driver and its
worker processes together, sampled every 50 ms) and S, side by side in one run.

    .venv/bin/python benchmarks/whatif_dask.py [--dp 256 --pp 4 --steps 20 --microbatches 8]

Each configuration runs in a fresh Python process so its peak memory is its own.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import json, resource, sys, threading, time
import psutil
me = psutil.Process()
peak = [0]
def sample():
    while True:
        procs = [me] + me.children(recursive=True)
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        peak[0] = max(peak[0], total)
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
run, mode = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
if mode == "single":
    from stragglers.trace.runformat import read_run
    from stragglers.whatif import analyze
    r = analyze(read_run(run))
else:
    from stragglers.whatif.dask_runner import analyze_with_client, dask_client
    with dask_client(workers=int(mode)) as client:
        t1 = time.perf_counter()
        r, _ = analyze_with_client(client, run)
        t2 = time.perf_counter()
wall = time.perf_counter() - t0
analysis = (t2 - t1) if mode != "single" else wall
time.sleep(0.1)
# CPU seconds of this process and of its waited-for children (the cluster's worker processes)
own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
print(json.dumps({"wall_s": wall, "analysis_s": analysis, "peak_bytes": peak[0], "slowdown": r.slowdown,
                  "cpu_driver_s": own.ru_utime + own.ru_stime,
                  "cpu_workers_s": kids.ru_utime + kids.ru_stime,
                  "by_dp_rank": r.by_dp_rank, "diagnosis": [f.cause for f in r.diagnosis]}))
"""


def run_one(run: Path, mode: str) -> dict:
    """One configuration in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", CHILD, str(run), mode], capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode:
        raise SystemExit(f"{mode}: {proc.stderr.strip().splitlines()[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=256)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--microbatches", type=int, default=8)
    args = ap.parse_args()
    from stragglers.trace.runformat import write_run
    from stragglers.trace.synth import generate

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        trace = generate(dp=args.dp, pp=args.pp, microbatches=args.microbatches,
                         steps=args.steps, slow_worker=(args.dp // 3, args.pp - 1, 1.5), seed=0)
        ops = len(trace)
        run = write_run(Path(tmp) / "run", trace)
        del trace
        print(f"job: dp {args.dp} × pp {args.pp} × {args.steps} steps, {args.microbatches} "
              f"microbatches, {ops:,} ops (generated and written in "
              f"{time.perf_counter() - t0:.1f} s)")
        rows = {mode: run_one(run, mode) for mode in ("single", "1", "2")}
    base = rows["single"]
    labels = {"single": "one process", "1": "Dask LocalCluster, 1 worker",
              "2": "Dask LocalCluster, 2 workers"}
    print(f"{'configuration':<30}{'wall s':>8}{'analysis s':>12}{'peak MB':>9}"
          f"{'CPU driver s':>14}{'CPU workers s':>15}  S")
    for mode, label in labels.items():
        r = rows[mode]
        print(f"{label:<30}{r['wall_s']:>8.2f}{r['analysis_s']:>12.2f}"
              f"{r['peak_bytes'] / 2**20:>9.0f}{r['cpu_driver_s']:>14.1f}"
              f"{r['cpu_workers_s']:>15.1f}  {r['slowdown']!r}")
    same = all(rows[m]["slowdown"] == base["slowdown"] and rows[m]["by_dp_rank"] ==
               base["by_dp_rank"] and rows[m]["diagnosis"] == base["diagnosis"] for m in rows)
    print(f"S, S per DP rank and the causes identical in all three: {same}")
    gain = rows["1"]["analysis_s"] / rows["2"]["analysis_s"]
    print(f"analysis (cluster started) 1 → 2 workers: {gain:.2f}× (scaling efficiency "
          f"{gain / 2:.0%}); wall includes starting the LocalCluster")
    from results import Figure, Run, write

    figures = [Figure(name=f"{label}, analysis time", value=f"{rows[m]['analysis_s']:.2f} s",
                      note=f"wall {rows[m]['wall_s']:.2f} s, peak "
                           f"{rows[m]['peak_bytes'] / 2**20:.0f} MB, CPU driver "
                           f"{rows[m]['cpu_driver_s']:.1f} s, workers "
                           f"{rows[m]['cpu_workers_s']:.1f} s; shared, loaded machine")
               for m, label in labels.items()]
    figures += [Figure(name="Dask 1 → 2 workers (analysis)", value=f"{gain:.2f}×",
                       note=f"scaling efficiency {gain / 2:.0%}"),
                Figure(name="S, S per DP rank and causes identical", value=str(same))]
    argv = " ".join(sys.argv[1:])
    write(Run(benchmark=f"What-if on Dask, {ops:,} ops: one process vs 1 and 2 workers",
              issue="32", command=f".venv/bin/python benchmarks/whatif_dask.py {argv}".strip(),
              figures=figures))

if __name__ == "__main__":
    main()
