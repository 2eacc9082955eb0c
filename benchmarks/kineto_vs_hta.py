"""Kineto reader + what-if analysis vs Meta's Holistic Trace Analysis (HTA), side by side.

Two inputs, each analysed by both tools in fresh processes, one after the other:

* cpu:  8 ranks x 120 steps of a real DDP job on gloo (torchrun here, torch.profiler CPU
        traces, rank 5 does 8x the forward work);
* nccl: 8 ranks x 24 steps of NCCL traces (~600 MB of JSON), made by tiling HTA's own sample
        `nccl_parser_config_nccl_data` (3 steps of a real 2-GPU DDP job) eight times per rank,
        with per-rank clock offsets and rank 5 stalling 120 ms at the start of every step (its
        collectives start late; the other ranks' first collective of the step waits for it).

Ours: `read_kineto` + `analyze` (the straggler = the ranks the first finding names).
HTA 0.5.0 (installed with pip into a separate venv, never into this project's):
`TraceAnalysis(trace_dir=...)` + `get_potential_stragglers()`.
Measured: wall time, CPU time (user + sys of the tool's process and all the children it waited
for), and peak memory of the whole process tree (PSS of the tool's process and all its
children, summed, sampled every 20 ms from /proc), plus what each names. The load average
is printed with each row: on a shared machine wall times move with it, CPU times much less.

    .venv/bin/python benchmarks/kineto_vs_hta.py [--cases cpu,nccl] [--work DIR] [--hta-venv DIR]

The inputs are made under runs/kineto-vs-hta and HTA's venv is runs/hta-venv (both ignored by
git), made on the first run with pip from PyPI; HTA's sample is one of the real traces, read where
the tests read them (tests/README.md, "Real data").
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import os
import re
import resource
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from results import Figure, Run, write

REPO = Path(__file__).resolve().parents[1]
SAMPLE = REPO.parent / "shared" / "data" / "kineto-samples" / "nccl_parser_config_nccl_data.json.gz"
WORKER = REPO / "tests" / "trace" / "workers" / "kineto_profile_job.py"
SLOW_RANK = 5
RANKS = 8

OURS = textwrap.dedent("""
    import json, sys, time
    t0 = time.perf_counter()
    from stragglers.trace.kineto import fastdecode, read_kineto
    from stragglers.whatif import analyze
    trace = read_kineto(sys.argv[1])
    t1 = time.perf_counter()
    result = analyze(trace)
    first = next((f for f in result.diagnosis if f.where.ranks), None)
    print(json.dumps({"load_s": t1 - t0, "total_s": time.perf_counter() - t0,
                      "named": first.where.ranks if first else [],
                      "cause": first.cause if first else None, "S": result.slowdown,
                      "decoder": "msgspec" if fastdecode.AVAILABLE else "json"}))
""")
HTA = textwrap.dedent("""
    import json, logging, sys, time
    logging.disable(logging.WARNING)
    t0 = time.perf_counter()
    from hta.trace_analysis import TraceAnalysis
    analysis = TraceAnalysis(trace_dir=sys.argv[1])
    t1 = time.perf_counter()
    try:
        named = [int(r) for r in analysis.get_potential_stragglers()]
        error = None
    except Exception as exc:  # report what HTA says instead of the numbers
        named, error = [], f"{type(exc).__name__}: {exc}"[:200]
    print(json.dumps({"load_s": t1 - t0, "total_s": time.perf_counter() - t0,
                      "named": named, "error": error}))
""")


class TreeMemory:
    """Peak of the summed memory (PSS) of a process and all its descendants (from /proc)."""

    def __init__(self, pid: int, interval: float = 0.02):
        self.pid, self.interval, self.peak = pid, interval, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._tree_rss())
            time.sleep(self.interval)

    def _tree_rss(self) -> int:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
        total, todo = 0, [self.pid]
        while todo:
            p = todo.pop()
            todo += children.get(p, [])
            total += _pss(p)
        return total

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _pss(pid: int) -> int:
    """Proportional set size of a process (pages shared by forked workers counted once over
    all of them, as they are in RAM), else its RSS."""
    for path, key in ((f"/proc/{pid}/smaps_rollup", "Pss:"), (f"/proc/{pid}/status", "VmRSS:")):
        try:
            with open(path) as fh:
                for line in fh:
                    if line.startswith(key):
                        return int(line.split()[1]) * 1024
        except OSError:
            continue
    return 0


def run_tool(python: str, code: str, trace_dir: Path, env: dict | None = None) -> dict:
    """Run one tool in a fresh process; its JSON answer plus wall time, tree peak memory and
    CPU time (user + sys of the process and every child it waited for: HTA's parser pool,
    our parse workers)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.Popen([python, "-c", code, str(trace_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})
    mem = TreeMemory(proc.pid)
    out, err = proc.communicate()
    peak = mem.stop()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    measured = {"wall_s": wall, "cpu_s": cpu, "peak_bytes": peak, "load": os.getloadavg()[0]}
    if proc.returncode != 0:
        return {**measured, "named": [], "error":
                (err.strip().splitlines() or ["exit %d" % proc.returncode])[-1][:200]}
    answer = json.loads(out.strip().splitlines()[-1])
    return {**measured, **answer}


# ---- inputs ---------------------------------------------------------------------------------

def make_cpu_case(out: Path, steps: int = 120) -> Path:
    """A real 8-rank DDP job on gloo, profiled for `steps` steps; rank 5 is slow."""
    if len(list(out.glob("trace_rank-*.json"))) == RANKS:
        return out
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={RANKS}", str(WORKER), str(out), "--inject", "slow",
           "--rank", str(SLOW_RANK), "--steps", str(steps), "--no-shapes"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    subprocess.run(cmd, check=True, capture_output=True, env=env, cwd=REPO, timeout=1800)
    return out


_STEP = re.compile(r"ProfilerStep#(\d+)")


def make_nccl_case(out: Path, blocks: int = 8, stall_us: float = 120_000.0) -> Path:
    """RANKS ranks, each the sample's 3 steps tiled `blocks` times; SLOW_RANK stalls at every
    step start, and the others' first collective of the step waits for it."""
    if len(list(out.glob("rank-*.json"))) == RANKS:
        return out
    out.mkdir(parents=True, exist_ok=True)
    doc = json.loads(gzip.decompress(SAMPLE.read_bytes()))
    events = doc["traceEvents"]
    timed = [e for e in events if isinstance(e.get("ts"), (int, float))]
    t_min = min(e["ts"] for e in timed)
    t_max = max(e["ts"] + e.get("dur", 0) for e in timed)
    steps = sorted((int(_STEP.match(e["name"]).group(1)), e["ts"]) for e in timed
                   if e.get("cat") == "user_annotation" and _STEP.match(e.get("name", "")))
    starts = [ts for _, ts in steps]
    first_step = steps[0][0]
    n_steps = len(steps)
    period = (t_max - t_min) + (n_steps + 1) * stall_us + 1000.0
    # Each step's first collective kernel (GPU time) and its end: every rank waits for the
    # late one there (the sample's broadcasts come before its all-reduces; a collective is
    # one, whatever its kind).
    all_reduce = [e for e in timed if e.get("cat") == "kernel"
                  and e["name"].startswith(("ncclKernel_", "ncclDevKernel_"))]
    first_ar = []
    for i, s in enumerate(starts):
        nxt = starts[i + 1] if i + 1 < n_steps else float("inf")
        mine = sorted((e for e in all_reduce if s <= e["ts"] < nxt), key=lambda e: e["ts"])
        first_ar.append((mine[0]["ts"], mine[0]["ts"] + mine[0]["dur"]) if mine else (s, s))
    optimizer = sorted(e["ts"] for e in timed if e.get("name", "").startswith("Optimizer.step#"))
    cuts = {"start": starts, "gpu": [end for _, end in first_ar], "cpu": []}
    for i, s in enumerate(starts):
        nxt = starts[i + 1] if i + 1 < n_steps else float("inf")
        cuts["cpu"].append(next((t for t in optimizer if s <= t < nxt), nxt))
    ranks = list(range(RANKS))
    info = doc.get("distributedInfo", {})
    for rank in ranks:
        offset = (rank * 137.0) % 400.0  # µs of clock offset between hosts
        tiled = []
        for b in range(blocks):
            base = b * period + offset
            for e in events:
                e2 = copy.copy(e)
                step_mark = _STEP.match(e.get("name", "") or "")
                if isinstance(e.get("ts"), (int, float)) and step_mark:
                    # The step span opens at its usual time and holds the stall.
                    i = sum(1 for s in starts if s < e["ts"] - 1e-9)
                    e2["ts"] = e["ts"] + base + i * stall_us
                    e2["dur"] = e.get("dur", 0) + stall_us
                elif isinstance(e.get("ts"), (int, float)):
                    e2["ts"] = e["ts"] + base + _shift(e, rank, cuts, stall_us)
                    if (rank != SLOW_RANK and e.get("cat") == "kernel"
                            and any(abs(e["ts"] - a) < 1e-9 for a, _ in first_ar)):
                        e2["dur"] = e["dur"] + stall_us  # waits for the late rank
                args = e.get("args")
                if isinstance(args, dict):
                    args = dict(args)
                    if "correlation" in args:
                        args["correlation"] = args["correlation"] + b * 10_000_000
                    if "Process Group Ranks" in args:
                        args["Process Group Ranks"] = str(ranks)
                        args["Group size"] = RANKS
                    e2["args"] = args
                if "id" in e2 and e.get("cat") == "ac2g":
                    e2["id"] = e["id"] + b * 10_000_000
                m = _STEP.match(e.get("name", "") or "")
                if m:
                    e2["name"] = f"ProfilerStep#{int(m.group(1)) - first_step + b * n_steps}"
                tiled.append(e2)
        new = {k: v for k, v in doc.items() if k != "traceEvents"}
        new["distributedInfo"] = {**info, "rank": rank, "world_size": RANKS,
                                  "pg_config": [{"pg_name": "0", "pg_desc": "default_pg",
                                                 "pg_size": RANKS, "ranks": ranks}]}
        new["host_name"] = f"node{rank}"
        new["traceEvents"] = tiled
        (out / f"rank-{rank}.json").write_text(json.dumps(new))
    return out


_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation")


def _shift(e: dict, rank: int, cuts: dict, stall_us: float) -> float:
    """How far an event moves: one stall per step whose cut it is past. The slow rank's cut is
    the step start (its whole step is late); on the others the GPU waits from the end of the
    step's first collective and the CPU at its next sync (the optimizer step)."""
    if rank == SLOW_RANK:
        marks = cuts["start"]
    else:
        marks = cuts["gpu"] if e.get("cat") in _GPU_CATS else cuts["cpu"]
    return sum(1 for m in marks if e["ts"] >= m - 1e-9) * stall_us


# ---- the run --------------------------------------------------------------------------------

def _size(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir() if f.is_file())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="cpu,nccl")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "kineto-vs-hta")
    p.add_argument("--hta-venv", type=Path, default=REPO / "runs" / "hta-venv")
    args = p.parse_args()
    hta_python = args.hta_venv / "bin" / "python"
    if not hta_python.exists():
        print(f"creating {args.hta_venv} and installing HolisticTraceAnalysis==0.5.0", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(args.hta_venv)], check=True)
        pip = subprocess.run([str(hta_python), "-m", "pip", "install", "-q",
                              "HolisticTraceAnalysis==0.5.0"], capture_output=True, text=True)
        if pip.returncode != 0:
            sys.exit("pip could not install HolisticTraceAnalysis==0.5.0 here:\n" + pip.stderr[-2000:])
    ours_env = {"PYTHONPATH": str(REPO / "src")}
    rows = []
    for case in args.cases.split(","):
        make = {"cpu": make_cpu_case, "nccl": make_nccl_case}[case]
        t0 = time.perf_counter()
        d = make(args.work / case)
        print(f"{case}: {RANKS} ranks, {_size(d) / 1e6:.0f} MB of JSON in {d} "
              f"(ready in {time.perf_counter() - t0:.0f} s)", flush=True)
        ours = run_tool(sys.executable, OURS, d, ours_env)
        print(f"  ours: {ours}", flush=True)
        hta = run_tool(str(hta_python), HTA, d)
        print(f"  hta:  {hta}", flush=True)
        rows.append((case, _size(d), ours, hta))
    print()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores; "
          f"command: .venv/bin/python benchmarks/kineto_vs_hta.py --cases {args.cases}")
    print()
    print("| case | JSON | ours: wall / CPU | HTA: wall / CPU | speed-up (wall) | speed-up (CPU) | "
          "ours: peak PSS (tree) | HTA: peak PSS (tree) | memory ratio | load (ours, HTA) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case, size, ours, hta in rows:
        print(f"| {case} | {size / 1e6:.0f} MB | {ours['wall_s']:.1f} s / {ours['cpu_s']:.1f} s | "
              f"{hta['wall_s']:.1f} s / {hta['cpu_s']:.1f} s | "
              f"**{hta['wall_s'] / ours['wall_s']:.1f}x** | {hta['cpu_s'] / ours['cpu_s']:.1f}x | "
              f"{ours['peak_bytes'] / 2**20:.0f} MiB | {hta['peak_bytes'] / 2**20:.0f} MiB | "
              f"**{ours['peak_bytes'] / max(1, hta['peak_bytes']):.2f}** | "
              f"{ours['load']:.1f}, {hta['load']:.1f} |")
    print()
    for case, _, ours, hta in rows:
        speed = hta["wall_s"] / ours["wall_s"]
        memory = ours["peak_bytes"] / max(1, hta["peak_bytes"])
        print(f"goals on {case}: >= 3x faster: {'met' if speed >= 3 else 'MISSED'} ({speed:.1f}x); "
              f"<= 1/3 of HTA's peak memory: {'met' if memory <= 1 / 3 else 'MISSED'} "
              f"({memory:.2f}); our decoder: {ours.get('decoder')}")
    print()
    print(f"| case | injected | ours names (cause, S) | HTA names |")
    print("|---|---|---|---|")
    for case, _, ours, hta in rows:
        o = f"{ours.get('named')} ({ours.get('cause')}, S {ours.get('S', float('nan')):.2f})" \
            if "error" not in ours else f"error: {ours['error']}"
        h = hta.get("named") if not hta.get("error") else f"error: {hta['error']}"
        print(f"| {case} | rank {SLOW_RANK} | {o} | {h} |")
    figures = []
    for case, size, ours, hta in rows:
        speed = hta["wall_s"] / ours["wall_s"]
        memory = ours["peak_bytes"] / max(1, hta["peak_bytes"])
        figures += [
            Figure(name=f"{case} ({size / 1e6:.0f} MB JSON): read_kineto + analyze wall time, "
                        "speed-up over HTA", value=f"{speed:.1f}x ({ours['wall_s']:.1f} s)",
                   goal=">= 3x", met=speed >= 3,
                   anchor=f"HTA 0.5.0 {hta['wall_s']:.1f} s, same run",
                   note=f"CPU time {ours['cpu_s']:.1f} s vs HTA {hta['cpu_s']:.1f} s "
                        f"({hta['cpu_s'] / ours['cpu_s']:.1f}x); load {ours['load']:.1f} / "
                        f"{hta['load']:.1f} during each"),
            Figure(name=f"{case}: peak memory (PSS of the process tree) over HTA's",
                   value=f"{memory:.2f} ({ours['peak_bytes'] / 2**20:.0f} MiB)", goal="<= 1/3",
                   met=memory <= 1 / 3, anchor=f"HTA {hta['peak_bytes'] / 2**20:.0f} MiB"),
            Figure(name=f"{case}: straggler named (injected: rank {SLOW_RANK})",
                   value=str(ours.get("named") if "error" not in ours else ours["error"]),
                   anchor=f"HTA names {hta.get('named') if not hta.get('error') else hta['error']}")]
    write(Run(benchmark="Kineto reader + what-if vs Holistic Trace Analysis", issue="",
              command=" ".join([".venv/bin/python benchmarks/kineto_vs_hta.py", *sys.argv[1:]]),
              figures=figures))


if __name__ == "__main__":
    main()
