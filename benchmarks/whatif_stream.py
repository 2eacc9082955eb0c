"""The what-if of a big run directory (issue 32, item 3): the whole trace read at once, the run
streamed by step partitions in one process, and step partitions on a Dask LocalCluster of 1 and
2 workers, side by side: wall time, peak memory and S.

    .venv/bin/python benchmarks/whatif_stream.py --dp 64 --pp 8 --microbatches 32 --steps 172
    .venv/bin/python benchmarks/whatif_stream.py --dp 1280 --pp 8 --microbatches 35 --steps 50 \\
        --modes stream,1,2          # 10,240 ranks × 50 steps: 101M ops

The run is generated a few steps at a time (`--chunk`) and written in the run format, one
Parquet file per rank with a row group per chunk (a recorder's flushes), so generating it
never holds the job either; it is kept in --workdir and reused. Each configuration runs in a
fresh process; peak memory is the process and its children (Dask's workers) together, RSS
sampled every 50 ms, and the process's own ru_maxrss.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, resource, sys, threading, time
import psutil
me = psutil.Process()
peak = [0]
def sample():
    while True:
        total = 0
        for p in [me] + me.children(recursive=True):
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        peak[0] = max(peak[0], total)
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
run, mode = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
setup = 0.0
if mode == "whole":
    from stragglers.trace.runformat import read_run
    from stragglers.whatif import analyze
    r = analyze(read_run(run))
elif mode == "stream":
    from stragglers.whatif.partitioned import analyze_run
    r, _ = analyze_run(run)
else:
    from stragglers.whatif.dask_runner import analyze_with_client, dask_client
    with dask_client(workers=int(mode)) as client:
        setup = time.perf_counter() - t0
        r, _ = analyze_with_client(client, run)
wall = time.perf_counter() - t0
time.sleep(0.1)
print(json.dumps({"wall_s": wall, "analysis_s": wall - setup, "peak_bytes": peak[0],
                  "maxrss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "slowdown": r.slowdown, "ops": r.job.ops, "steps": len(r.steps_analysed),
                  "by_dp_rank": r.by_dp_rank, "diagnosis": [f.cause for f in r.diagnosis]}))
"""

LABELS = {"whole": "one process, whole trace (read_run + analyze)",
          "stream": "one process, streamed (analyze RUN)",
          "1": "Dask LocalCluster, 1 worker", "2": "Dask LocalCluster, 2 workers"}


def write_run_streamed(path: Path, dp: int, pp: int, microbatches: int, steps: int, chunk: int,
                       seed: int = 0) -> int:
    """A synthetic job (one slow worker) generated `chunk` steps at a time into a run directory:
    one file per rank, a row group per chunk. Returns its ops."""
    import numpy as np
    import pyarrow.parquet as pq

    from stragglers.trace.columns import columns_to_table
    from stragglers.trace.runformat import CODEC, rank_file_name, write_meta
    from stragglers.trace.synth import generate

    path.mkdir(parents=True, exist_ok=True)
    writers: dict[int, pq.ParquetWriter] = {}
    clock, ops_written = 0.0, 0
    try:
        for c, first in enumerate(range(0, steps, chunk)):
            trace = generate(dp=dp, pp=pp, microbatches=microbatches,
                             steps=min(chunk, steps - first), seed=seed + c,
                             slow_worker=(dp // 3, pp - 1, 1.5))
            ops = trace.ops
            ops["step"] += first
            ops["start_ts"] += clock
            clock = float((ops["start_ts"] + ops["duration"]).max()) + 1e-3
            order = np.argsort(ops["rank"], kind="stable")
            table = columns_to_table({k: v[order] for k, v in ops.items()})
            ranks = ops["rank"][order]
            bounds = np.searchsorted(ranks, np.arange(dp * pp + 1))
            del ops, order, trace.ops
            for r in range(dp * pp):
                if r not in writers:
                    writers[r] = pq.ParquetWriter(path / rank_file_name(r), table.schema,
                                                  compression=CODEC)
                writers[r].write_table(table.slice(bounds[r], bounds[r + 1] - bounds[r]))
            ops_written += table.num_rows
            if c == 0:
                trace.meta.name = f"synth-dp{dp}-pp{pp}-{steps}steps"
                write_meta(path, trace.meta)
            del table
            print(f"  steps {first}-{min(first + chunk, steps) - 1} written "
                  f"({ops_written:,} ops)", flush=True)
    finally:
        for w in writers.values():
            w.close()
    return ops_written


def run_one(run: Path, mode: str) -> dict:
    """One configuration in a fresh process."""
    proc = subprocess.run([sys.executable, "-c", CHILD, str(run), mode], capture_output=True,
                          text=True, timeout=7200)
    if proc.returncode:
        tail = (proc.stderr.strip().splitlines() or ["killed (no output)"])[-1]
        return {"error": f"exit {proc.returncode}: {tail}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=64)
    ap.add_argument("--pp", type=int, default=8)
    ap.add_argument("--microbatches", type=int, default=32)
    ap.add_argument("--steps", type=int, default=172)
    ap.add_argument("--chunk", type=int, default=5, help="steps per generated chunk / row group")
    ap.add_argument("--modes", default="whole,stream,1,2")
    ap.add_argument("--workdir", default=str(REPO / "runs" / "bench"))
    args = ap.parse_args()
    run = Path(args.workdir) / (f"stream-dp{args.dp}-pp{args.pp}-mb{args.microbatches}-"
                                f"{args.steps}steps-chunk{args.chunk}")
    if not (run / "meta.json").exists():
        t0 = time.perf_counter()
        ops = write_run_streamed(run, args.dp, args.pp, args.microbatches, args.steps,
                                 args.chunk)
        print(f"generated {ops:,} ops in {time.perf_counter() - t0:.0f} s", flush=True)
    size = sum(f.stat().st_size for f in run.iterdir())
    print(f"job: dp {args.dp} × pp {args.pp} ({args.dp * args.pp:,} ranks) × {args.steps} steps, "
          f"{args.microbatches} microbatches; {run} ({size / 2**30:.1f} GiB)", flush=True)
    rows = {}
    for mode in args.modes.split(","):
        rows[mode] = run_one(run, mode)
        print(mode, json.dumps({k: v for k, v in rows[mode].items() if k != "by_dp_rank"}),
              flush=True)
    print(f"\n| configuration | ops | wall s | analysis s | peak GB (tree) | maxrss GB | S |")
    print("|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        if "error" in r:
            print(f"| {LABELS[mode]} | – | – | – | – | – | {r['error']} |")
            continue
        print(f"| {LABELS[mode]} | {r['ops']:,} | {r['wall_s']:.1f} | {r['analysis_s']:.1f} | "
              f"{r['peak_bytes'] / 1e9:.2f} | {r['maxrss_bytes'] / 1e9:.2f} | "
              f"{r['slowdown']!r} |")
    done = [r for r in rows.values() if "error" not in r]
    same = all(r["slowdown"] == done[0]["slowdown"] and r["by_dp_rank"] == done[0]["by_dp_rank"]
               and r["diagnosis"] == done[0]["diagnosis"] for r in done)
    print(f"S, S per DP rank and the causes identical in every configuration that ran: {same}")
    if "error" not in rows.get("1", {"error": 1}) and "error" not in rows.get("2", {"error": 1}):
        gain = rows["1"]["analysis_s"] / rows["2"]["analysis_s"]
        print(f"Dask 1 → 2 workers (cluster started): {gain:.2f}× (scaling efficiency "
              f"{gain / 2:.0%})")


if __name__ == "__main__":
    main()
