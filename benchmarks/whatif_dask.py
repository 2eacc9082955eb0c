"""The what-if of a run directory in one process against step partitions on a Dask LocalCluster
of 1 and 2 worker processes (issue 32, item 3): wall time, peak memory (the driver and its
worker processes together, sampled every 50 ms) and S, side by side in one run.

    .venv/bin/python benchmarks/whatif_dask.py [--dp 256 --pp 4 --steps 20 --microbatches 8]
    .venv/bin/python benchmarks/whatif_dask.py --before /tmp/old/src   # an older tree too

Each configuration runs in a fresh Python process so its peak memory is its own; with --before,
each runs on the older tree right before this one (the machine is shared: only ratios of runs
side by side say anything). The run is written by write_run (a row group per block of steps);
`--chunk K` writes a row group per K steps instead, `--one-group` one per file (runs written
before row groups by steps).

The split of the work is reported beside the wall times, since wall-clock scaling cannot show
on a machine whose cores other processes share (2 workers on 2 shared cores): CPU seconds of
the driver and of each worker during the analysis (the cluster's start left out), and the rows
and compressed bytes each worker decoded. Partitions that each read only their own row groups
decode the run once between them; partitions of one-group files decode it once each.
"""

from __future__ import annotations

import argparse
import json
import os
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
    import re
    from stragglers.whatif.dask_runner import analyze_with_client, dask_client
    def cpu():
        u = resource.getrusage(resource.RUSAGE_SELF)
        return u.ru_utime + u.ru_stime
    told = []
    with dask_client(workers=int(mode)) as client:
        # the workers import the analysis first: the cluster's start and imports left out
        client.run(lambda: __import__("stragglers.whatif.partitioned"))
        before = client.run(cpu)
        t1, c1 = time.perf_counter(), cpu()
        r, _ = analyze_with_client(client, run, progress=told.append)
        t2, c2 = time.perf_counter(), cpu()
        after = client.run(cpu)
    per_worker = {}
    for i, w in enumerate(sorted(after)):
        m = next((re.fullmatch(r"read by worker \S+: (\d+) partitions, ([\d,]+) rows, "
                               r"([\d,]+) bytes decoded", x) for x in told
                  if x.startswith(f"read by worker {w}:")), None)
        # a tree from before the per-worker reading counts (--before) does not tell them
        per_worker[f"worker {i + 1}"] = {"cpu_s": after[w] - before[w]} if m is None else {
            "cpu_s": after[w] - before[w], "partitions": int(m.group(1)),
            "rows_read": int(m.group(2).replace(",", "")),
            "bytes_read": int(m.group(3).replace(",", ""))}
wall = time.perf_counter() - t0
analysis = (t2 - t1) if mode != "single" else wall
time.sleep(0.1)
# CPU seconds of this process and of its waited-for children (the cluster's worker processes)
own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
out = {"wall_s": wall, "analysis_s": analysis, "peak_bytes": peak[0], "slowdown": r.slowdown,
       "cpu_driver_s": own.ru_utime + own.ru_stime,
       "cpu_workers_s": kids.ru_utime + kids.ru_stime,
       "by_dp_rank": r.by_dp_rank, "diagnosis": [f.cause for f in r.diagnosis]}
if mode != "single":
    out.update(cpu_driver_analysis_s=c2 - c1, workers=per_worker)
print(json.dumps(out))
"""


def run_one(run: Path, mode: str, src: str | None = None) -> dict:
    """One configuration in a fresh process (on the source tree `src`, default: installed)."""
    env = {**os.environ, "PYTHONPATH": src} if src else None
    load_before = os.getloadavg()[0]  # the machine's state around this configuration's run
    proc = subprocess.run([sys.executable, "-c", CHILD, str(run), mode], capture_output=True,
                          text=True, timeout=3600, env=env)
    if proc.returncode:
        raise SystemExit(f"{mode}: {proc.stderr.strip().splitlines()[-1]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]),
            "load": (load_before, os.getloadavg()[0])}


LABELS = {"single": "one process", "1": "Dask LocalCluster, 1 worker",
          "2": "Dask LocalCluster, 2 workers"}


def _write_chunked(path: Path, trace, chunk: int) -> Path:
    """The trace as a run directory whose rank files hold a row group per `chunk` steps (0:
    one row group per file)."""
    import numpy as np
    import pyarrow.parquet as pq

    from stragglers.trace.columns import columns_to_table
    from stragglers.trace.runformat import CODEC, rank_file_name, write_meta

    write_meta(path, trace.meta)
    ops = trace.ops
    for rank in np.unique(ops["rank"]):
        rows = np.flatnonzero(ops["rank"] == rank)
        table = columns_to_table({k: v[rows] for k, v in ops.items()})
        step = ops["step"][rows]
        with pq.ParquetWriter(path / rank_file_name(int(rank)), table.schema,
                              compression=CODEC) as w:
            if not chunk:
                w.write_table(table)
                continue
            for lo in range(int(step.min()), int(step.max()) + 1, chunk):
                w.write_table(table.take(np.flatnonzero((step >= lo) & (step < lo + chunk))))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=256)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=0,
                    help="steps per row group in each rank file (0: write_run's sizing)")
    ap.add_argument("--one-group", action="store_true",
                    help="one row group per rank file (runs written before row groups by steps)")
    ap.add_argument("--before", default=None,
                    help="an older tree run too, side by side: its src/ folder or a git "
                         "revision")
    args = ap.parse_args()
    from stragglers.trace.runformat import write_run
    from stragglers.trace.synth import generate

    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        trace = generate(dp=args.dp, pp=args.pp, microbatches=args.microbatches,
                         steps=args.steps, slow_worker=(args.dp // 3, args.pp - 1, 1.5), seed=0)
        ops = len(trace)
        run = (_write_chunked(Path(tmp) / "run", trace, 0 if args.one_group else args.chunk)
               if args.chunk or args.one_group else write_run(Path(tmp) / "run", trace))
        import pyarrow.parquet as pq
        groups = pq.read_metadata(next(run.glob("rank-*.parquet"))).num_row_groups
        del trace
        print(f"job: dp {args.dp} × pp {args.pp} × {args.steps} steps, {args.microbatches} "
              f"microbatches, {ops:,} ops (generated and written in "
              f"{time.perf_counter() - t0:.1f} s); {groups} row group(s) per rank file",
              flush=True)
        rows = {}
        from trees import source_tree
        before = source_tree(args.before) if args.before else None
        for mode in LABELS:
            for src in ([before] if before else []) + [None]:
                key = mode + (" (before)" if src else "")
                rows[key] = run_one(run, mode, src)
                print(key, json.dumps({k: v for k, v in rows[key].items() if k != "by_dp_rank"}),
                      flush=True)
    print(f"{'configuration':<44}{'wall s':>8}{'analysis s':>12}{'peak MB':>9}"
          f"{'CPU driver s':>14}{'CPU workers s':>15}  S")
    for key, r in rows.items():
        print(f"{_label(key):<44}{r['wall_s']:>8.2f}{r['analysis_s']:>12.2f}"
              f"{r['peak_bytes'] / 2**20:>9.0f}{r['cpu_driver_s']:>14.1f}"
              f"{r['cpu_workers_s']:>15.1f}  {r['slowdown']!r}")
    base = rows["single"]
    same = all(r["slowdown"] == base["slowdown"] and r["by_dp_rank"] == base["by_dp_rank"]
               and r["diagnosis"] == base["diagnosis"] for r in rows.values())
    print(f"S, S per DP rank and the causes identical in every configuration: {same}")
    gain = rows["1"]["analysis_s"] / rows["2"]["analysis_s"]
    print(f"analysis (cluster started) 1 → 2 workers: {gain:.2f}× (scaling efficiency "
          f"{gain / 2:.0%}); wall includes starting the LocalCluster")
    splits = {key: _split(r) for key, r in rows.items() if "workers" in r}
    for key, text in splits.items():
        print(f"{_label(key)}: {text}")
    from results import Figure, Run, write

    figures = [Figure(name=f"{_label(key)}, analysis time", value=f"{r['analysis_s']:.2f} s",
                      note=f"wall {r['wall_s']:.2f} s, peak {r['peak_bytes'] / 2**20:.0f} MB, "
                           f"CPU driver {r['cpu_driver_s']:.1f} s, workers "
                           f"{r['cpu_workers_s']:.1f} s; load {r['load'][0]:.1f} → "
                           f"{r['load'][1]:.1f} over it")
               for key, r in rows.items()]
    for mode in LABELS:
        now, then = rows[mode], rows.get(mode + " (before)")
        if then:
            cpu = now["cpu_driver_s"] + now["cpu_workers_s"]
            cpu_then = then["cpu_driver_s"] + then["cpu_workers_s"]
            figures.append(Figure(
                name=f"{LABELS[mode]}: this tree vs before",
                value=f"analysis {now['analysis_s'] / then['analysis_s']:.2f}×, CPU "
                      f"{cpu / cpu_then:.2f}× ({cpu:.1f} vs {cpu_then:.1f} s)",
                anchor="the tree given by --before, run just before it on the same run"))
    figures += [Figure(name=f"{_label(key)}, work split", value=text,
                       note=f"{groups} row group(s) per rank file")
                for key, text in splits.items()]
    figures += [Figure(name="Dask 1 → 2 workers (analysis)", value=f"{gain:.2f}×",
                       note=f"scaling efficiency {gain / 2:.0%}"),
                Figure(name="S, S per DP rank and causes identical", value=str(same))]
    argv = " ".join(a if not a.startswith("/") else "OLD_TREE/src" for a in sys.argv[1:])
    write(Run(benchmark=f"What-if on Dask, {ops:,} ops: one process vs 1 and 2 workers",
              issue="32", command=f".venv/bin/python benchmarks/whatif_dask.py {argv}".strip(),
              figures=figures), name="whatif_dask" + (f"_chunk{args.chunk}" if args.chunk else "")
          + ("_one_group" if args.one_group else ""))


def _split(r: dict) -> str:
    """'driver 3.1 CPU-s; worker 1: 4.2 CPU-s, 2 partitions, 0.93M rows (12.1 MB) decoded; …'."""
    parts = [f"driver {r['cpu_driver_analysis_s']:.1f} CPU-s"]
    for name, w in r["workers"].items():
        if "rows_read" not in w:   # a tree from before the reading counts
            parts.append(f"{name}: {w['cpu_s']:.1f} CPU-s")
            continue
        parts.append(f"{name}: {w['cpu_s']:.1f} CPU-s, {w['partitions']} partitions, "
                     f"{w['rows_read'] / 1e6:.2f}M rows ({w['bytes_read'] / 1e6:.1f} MB) decoded")
    return "; ".join(parts)


def _label(key: str) -> str:
    """'2 (before)' → 'Dask LocalCluster, 2 workers, tree before'."""
    mode, _, before = key.partition(" ")
    return LABELS[mode] + (", tree before" if before else "")

if __name__ == "__main__":
    main()
