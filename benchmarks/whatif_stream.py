"""The what-if of a big run directory (issue 32, item 3): the whole trace read at once, the run
streamed by step partitions in one process, and step partitions on a Dask LocalCluster of 1 and
2 workers, side by side: wall time, peak memory and S.

    .venv/bin/python benchmarks/whatif_stream.py --dp 64 --pp 8 --microbatches 32 --steps 172
    .venv/bin/python benchmarks/whatif_stream.py --dp 1280 --pp 8 --microbatches 35 --steps 50 \\
        --chunk 2 --modes stream,1,2     # 10,240 ranks × 50 steps: 101M ops (--generate-only
                                         # first writes the run, ~2.6 GB, without analysing)
    .venv/bin/python benchmarks/whatif_stream.py --modes stream --before /tmp/old/src
                                    # each mode on an older tree too, side by side

The run is generated a few steps at a time (`--chunk`) and written in the run format, one
Parquet file per rank with a row group per chunk (a recorder's flushes), so generating it
never holds the job either; it is kept in --workdir and reused. Each configuration runs in a
fresh process; peak memory is the process and its children (Dask's workers) together, RSS
sampled every 50 ms, and the process's own ru_maxrss. The figures go to
benchmarks/results/whatif_stream_<size>.json (benchmarks/results.py).
"""

from __future__ import annotations

import argparse
import json
import os
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
stage = ["start"]          # the step of the analysis its progress last named
stage_peak = {}
def sample():
    while True:
        total = 0
        for p in [me] + me.children(recursive=True):
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
        peak[0] = max(peak[0], total)
        stage_peak[stage[0]] = max(stage_peak.get(stage[0], 0), total)
        time.sleep(0.05)
threading.Thread(target=sample, daemon=True).start()
run, mode = sys.argv[1], sys.argv[2]
t0 = time.perf_counter()
setup = 0.0
phases, at = {}, [t0, "reading", time.process_time()]
phases_cpu = {}
told = []
workers = {}
snap = {}                  # Dask workers' CPU seconds when reading ends (set below)
def tick(msg):
    # reading: the step partitions (on the workers, with Dask); analysis: the grid, model,
    # replays, attribution and diagnosis (the progress messages after the last one is read)
    now, cpu = time.perf_counter(), time.process_time()
    phases[at[1]] = phases.get(at[1], 0.0) + now - at[0]
    phases_cpu[at[1]] = phases_cpu.get(at[1], 0.0) + cpu - at[2]
    at[0], at[2] = now, cpu
    if msg.startswith("assembling"):
        at[1] = "analysis"
        if "client" in snap:       # each worker's CPU in reading vs in its replays
            snap["read"] = snap["client"].run(process_cpu)
    stage[0] = ("reading" if "partitions" in msg or msg.startswith("read") else
                msg.split(":")[0])
    told.append(msg)
def process_cpu():
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime
if mode == "whole":
    from stragglers.trace.runformat import read_run
    from stragglers.whatif import analyze
    r = analyze(read_run(run))
elif mode == "stream":
    from stragglers.whatif.partitioned import analyze_run
    at[0], at[2] = time.perf_counter(), time.process_time()   # (the import: wall, not reading)
    r, _ = analyze_run(run, progress=tick)
    tick("end")
else:
    import re
    from stragglers.whatif.dask_runner import analyze_with_client, dask_client
    with dask_client(workers=int(mode)) as client:
        snap["client"] = client
        setup = time.perf_counter() - t0
        # the workers import the analysis first: the cluster's start and imports left out
        client.run(lambda: __import__("stragglers.whatif.partitioned"))
        before = client.run(process_cpu)
        at[0], at[2] = time.perf_counter(), time.process_time()
        r, _ = analyze_with_client(client, run, progress=tick)
        tick("end")
        after = client.run(process_cpu)
    # the work split: each worker's CPU seconds in the analysis, rows and bytes it decoded
    for i, w in enumerate(sorted(after)):
        m = next((re.fullmatch(r"read by worker \S+: (\d+) partitions, ([\d,]+) rows, "
                               r"([\d,]+) bytes decoded", x) for x in told
                  if x.startswith(f"read by worker {w}:")), None)
        workers[f"worker {i + 1}"] = {"cpu_s": round(after[w] - before[w], 2)}
        if w in snap.get("read", {}):   # (when the tree's progress told the reading's end)
            workers[f"worker {i + 1}"]["cpu_reading_s"] = round(snap["read"][w] - before[w], 2)
        if m is not None:   # a tree from before the per-worker reading counts (--before): none
            workers[f"worker {i + 1}"].update(
                partitions=int(m.group(1)), rows_read=int(m.group(2).replace(",", "")),
                bytes_read=int(m.group(3).replace(",", "")))
wall = time.perf_counter() - t0
time.sleep(0.1)
# CPU seconds of this process and of its waited-for children (Dask's worker processes, once
# the cluster is closed): the same work on more CPUs than the machine gives shows as wall only
own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
cpu = {"driver": own.ru_utime + own.ru_stime, "workers": kids.ru_utime + kids.ru_stime}
read = next((x for x in told if x.startswith("read ") and " rows (" in x), "")
print(json.dumps({"wall_s": wall, "analysis_s": wall - setup, "peak_bytes": peak[0],
                  "workers": workers, "read": read,
                  "phases": phases if mode != "whole" else {}, "cpu_s": cpu,
                  "phases_cpu": phases_cpu if mode != "whole" else {},
                  "peak_by_step_GB": {k: round(v / 1e9, 2) for k, v in stage_peak.items()},
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


def run_one(run: Path, mode: str, src: str | None = None) -> dict:
    """One configuration in a fresh process (on the source tree `src`, default: installed)."""
    env = {**os.environ, "PYTHONPATH": src} if src else None
    proc = subprocess.run([sys.executable, "-c", CHILD, str(run), mode], capture_output=True,
                          text=True, timeout=7200, env=env)
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
    ap.add_argument("--generate-only", action="store_true",
                    help="write the run into --workdir (kept for later runs) and stop")
    ap.add_argument("--before", default=None,
                    help="an older tree run as well, each mode right before this tree's (the "
                         "ratios are of the same run): its src/ folder or a git revision")
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
    if args.generate_only:
        return
    configs = [(mode, None) for mode in args.modes.split(",")]
    if args.before:
        from trees import source_tree
        before = source_tree(args.before)
        configs = [c for mode, _ in configs for c in ((mode, before), (mode, None))]
    rows = {}
    for mode, src in configs:
        key = mode + (" (before)" if src else "")
        rows[key] = run_one(run, mode, src)
        print(key, json.dumps({k: v for k, v in rows[key].items() if k != "by_dp_rank"}),
              flush=True)
    print("\n| configuration | ops | wall s | analysis s | peak GB (tree) | maxrss GB | S |")
    print("|---|---|---|---|---|---|---|")
    for key, r in rows.items():
        label = _label(key)
        if "error" in r:
            print(f"| {label} | – | – | – | – | – | {r['error']} |")
            continue
        print(f"| {label} | {r['ops']:,} | {r['wall_s']:.1f} | {r['analysis_s']:.1f} | "
              f"{r['peak_bytes'] / 1e9:.2f} | {r['maxrss_bytes'] / 1e9:.2f} | "
              f"{r['slowdown']!r} |")
    done = [r for r in rows.values() if "error" not in r]
    same = all(r["slowdown"] == done[0]["slowdown"] and r["by_dp_rank"] == done[0]["by_dp_rank"]
               and r["diagnosis"] == done[0]["diagnosis"] for r in done)
    print(f"S, S per DP rank and the causes identical in every configuration that ran: {same}")
    for key, r in rows.items():
        if "error" not in r:
            print(f"{_label(key)}: {_breakdown(r)}")
            print(f"  peak GB by step of the analysis: {r.get('peak_by_step_GB')}")
    for mode in args.modes.split(","):
        now, then = rows.get(mode, {}), rows.get(mode + " (before)", {})
        if "error" not in now and now and "error" not in then and then:
            print(f"{_label(mode)}: wall {now['wall_s'] / then['wall_s']:.2f}×, peak "
                  f"{now['peak_bytes'] / then['peak_bytes']:.2f}× the tree before")
    gain = None
    if "error" not in rows.get("1", {"error": 1}) and "error" not in rows.get("2", {"error": 1}):
        gain = rows["1"]["analysis_s"] / rows["2"]["analysis_s"]
        print(f"Dask 1 → 2 workers (cluster started): {gain:.2f}× (scaling efficiency "
              f"{gain / 2:.0%})")
    _write(args, rows, same, gain)


def _public(argv: list[str]) -> list[str]:
    """The arguments as the results show them: no path outside the repository (the work
    directory left out, an older tree named by its role)."""
    out, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--workdir":
            skip = True
        elif a == "--before":
            out += [a, argv[i + 1] if not Path(argv[i + 1]).is_dir() else "OLD_TREE/src"]
            skip = True
        elif not a.startswith(("--workdir=", "--before=")):
            out.append(a)
    return out


def _breakdown(r: dict) -> str:
    """'reading 9.1 s, analysis 8.2 s; CPU driver 17.0 s, workers 0.0 s; worker 1: …'."""
    phases = ", ".join(f"{k} {v:.1f} s" for k, v in r.get("phases", {}).items())
    cpu = r.get("cpu_s", {})
    by_cpu = ", ".join(f"{k} {v:.1f}" for k, v in r.get("phases_cpu", {}).items())
    split = "".join(f"; {name}: {w['cpu_s']:.1f} CPU-s"
                    + (f" ({w['cpu_reading_s']:.1f} reading)" if "cpu_reading_s" in w else "")
                    + (f", {w['partitions']} partitions, {w['rows_read'] / 1e6:.2f}M rows "
                       f"({w['bytes_read'] / 1e6:.0f} MB) decoded" if "rows_read" in w else "")
                    for name, w in r.get("workers", {}).items())
    return (phases + "; " if phases else "") + (f"driver CPU-s {by_cpu}; " if by_cpu else "") + (
        f"CPU driver {cpu.get('driver', 0):.1f} s, workers {cpu.get('workers', 0):.1f} s"
        + split + (f"; {r['read']}" if r.get("read") else ""))


def _label(key: str) -> str:
    """The table's name of a configuration ('stream (before)': on the tree before)."""
    mode, _, before = key.partition(" ")
    return LABELS[mode] + (", tree before" if before else "")


def _write(args, rows: dict, same: bool, gain: float | None) -> None:
    """The figures, via benchmarks/results.py (results/whatif_stream_<ops>.json)."""
    from results import Figure, Run, write

    done = {k: r for k, r in rows.items() if "error" not in r}
    if not done:
        return
    ops = next(iter(done.values()))["ops"]
    big = ops >= 50_000_000
    figures = []
    for key, r in done.items():
        single = not key[0].isdigit()
        mem_goal = ("<= 8 GB" if big else "<= 3 GB") if single and " " not in key else ""
        figures.append(Figure(name=f"{ops / 1e6:.0f}M ops, {_label(key)}, peak RSS",
                              value=f"{r['peak_bytes'] / 1e9:.2f} GB", goal=mem_goal,
                              met=(r["peak_bytes"] <= (8e9 if big else 3e9)) if mem_goal else None,
                              note=f"S = {r['slowdown']!r}; diagnosis {r['diagnosis']}"))
        time_goal = "<= 10 s" if not big and key == "stream" else ""
        figures.append(Figure(name=f"{ops / 1e6:.0f}M ops, {_label(key)}, wall time",
                              value=f"{r['wall_s']:.1f} s", goal=time_goal,
                              met=(r["wall_s"] <= 10.0) if time_goal else None,
                              note=f"{_breakdown(r)}; a wall time, so judged at the run's "
                                   "load (beside it)"))
    for mode in args.modes.split(","):
        now, then = done.get(mode), done.get(mode + " (before)")
        if now and then:
            cpu, cpu_then = (sum(r["cpu_s"].values()) for r in (now, then))
            read, read_then = (r.get("phases_cpu", {}).get("reading", 0.0) for r in (now, then))
            figures.append(Figure(name=f"{ops / 1e6:.0f}M ops, {_label(mode)}: this tree vs before",
                                  value=f"CPU {cpu / cpu_then:.2f}× ({cpu:.1f} vs {cpu_then:.1f} "
                                        f"s; reading {read:.1f} vs {read_then:.1f} s), wall "
                                        f"{now['wall_s'] / then['wall_s']:.2f}×, peak "
                                        f"{now['peak_bytes'] / then['peak_bytes']:.2f}×",
                                  anchor="the tree given by --before, run just before it on "
                                         "the same run"))
    if gain is not None:
        figures.append(Figure(name=f"{ops / 1e6:.0f}M ops, Dask 1 → 2 workers", value=f"{gain:.2f}×",
                              note=f"scaling efficiency {gain / 2:.0%}"))
    figures.append(Figure(name="S, S per DP rank and causes identical in every configuration",
                          value=str(same)))
    argv = " ".join(_public(sys.argv[1:]))
    write(Run(benchmark=f"What-if of {ops / 1e6:.0f}M ops, streamed / on Dask", issue="32",
              command=f".venv/bin/python benchmarks/whatif_stream.py {argv}".strip(),
              figures=figures),
          name=f"whatif_stream_{'100M' if big else f'{ops / 1e6:.0f}M'}")

if __name__ == "__main__":
    main()
