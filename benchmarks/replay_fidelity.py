"""Replay fidelity of recorded pipeline runs: sim_error per job kind over repeated real runs.

    .venv/bin/python benchmarks/replay_fidelity.py [--rounds 5] [--keep DIR]
    .venv/bin/python benchmarks/replay_fidelity.py --traces DIR [--src OTHER_TREE/src]

Each round records, with real torchrun jobs on gloo (2 ranks): examples/train_gpt.py as
Megatron-style 1F1B (pp 2) and interleaved 1F1B (pp 2 × vpp 2), and examples/train_pipeline.py
with every torch.distributed.pipelining schedule, none of them with an injected straggler.
sim_error = |mean replayed − mean measured step time| / mean measured (docs/whatif.md §5),
replayed with the measured launch delays; and the diagnosis's first cause (`none` is right).
--traces analyses traces kept by an earlier --keep instead of recording: with --src pointing
at another checkout's src/ the same traces are analysed by that code; --baseline OTHER/src
analyses them with both and prints the two side by side (a change's effect on the same runs).
Writes its figures to benchmarks/results/replay_fidelity.json (benchmarks/results.py).

    .venv/bin/python benchmarks/replay_fidelity.py --traces DIR --baseline OLD_TREE/src
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from results import Figure, Run, write

REPO = Path(__file__).resolve().parents[1]
GPT = ["--microbatches", "4", "--steps", "6", "--layers", "4", "--d-model", "32", "--heads", "2",
       "--max-seq-len", "64"]
JOBS = {
    "gpt 1F1B pp2": ("train_gpt.py", [*GPT, "--pp", "2"]),
    "gpt interleaved pp2 vpp2": ("train_gpt.py", [*GPT, "--pp", "2", "--vpp", "2"]),
    **{f"pipelining {s}": ("train_pipeline.py", ["--schedule", s, "--steps", "8", "--d-model",
                                                 "128", "--batch", "16"])
       for s in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble",
                 "ZBVZeroBubble", "DualPipeV")},
}
TRACE_FLAG = {"train_gpt.py": "--trace-dir", "train_pipeline.py": "--out"}
ANALYSE = ("import json, sys\n"
           "from stragglers.trace.runformat import read_run\n"
           "from stragglers.whatif import analyze\n"
           "out = {}\n"
           "for p in sys.argv[1:]:\n"
           "    r = analyze(read_run(p))\n"
           "    out[p] = (r.sim_error, r.diagnosis[0].cause)\n"
           "print(json.dumps(out))\n")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def record(script: str, args: list[str], out: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(REPO / "examples" / script), *args, TRACE_FLAG[script], str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"{script} {' '.join(args)} failed:\n{proc.stderr[-3000:]}")


def analyse(paths: list[Path], src: Path) -> dict[str, list]:
    """(sim_error, first cause of the diagnosis) of each trace, by the code in `src`."""
    proc = subprocess.run([sys.executable, "-c", ANALYSE, *map(str, paths)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(src)}, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"analysis with {src} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--keep", type=Path, help="record into this folder and keep the traces")
    p.add_argument("--traces", type=Path, help="analyse the traces of an earlier --keep")
    p.add_argument("--src", type=Path, default=REPO / "src", help="the code that analyses")
    p.add_argument("--baseline", type=Path, help="also analyse with this src/, side by side")
    a = p.parse_args()
    if a.traces:
        root = a.traces
    else:
        root = a.keep or Path(tempfile.mkdtemp(prefix="replay-fidelity-"))
        for r in range(a.rounds):
            for k, (name, (script, args)) in enumerate(JOBS.items()):
                print(f"round {r + 1}/{a.rounds}: {name}", file=sys.stderr, flush=True)
                record(script, args, root / f"r{r}-j{k}")
    names = list(JOBS)
    paths = sorted(p for p in root.iterdir() if p.is_dir())
    codes = [a.src] + ([a.baseline] if a.baseline else [])
    errors = {src: analyse(paths, src) for src in codes}
    head = " | ".join(f"sim_error median, max, first causes ({label(src)})" for src in codes)
    print(f"| job | runs | {head} |")
    print("|---|---|" + "---|" * len(codes))
    table, medians = [], {src: [] for src in codes}
    for k, name in enumerate(names):
        row = {"job": name}
        cells = []
        for src in codes:
            found = [v for path, v in errors[src].items() if Path(path).name.endswith(f"-j{k}")]
            if not found:
                continue
            vals = [v[0] for v in found]
            causes = Counter(v[1] for v in found)
            med = statistics.median(vals)
            medians[src].append(med)
            cell = (f"{100 * med:.2f}%, {100 * max(vals):.2f}%, "
                    + ", ".join(f"{c} {n}" for c, n in causes.most_common()))
            cells.append(cell)
            row["runs"] = str(len(vals))
            row[label(src)] = cell
        if cells:
            print(f"| {name} | {row['runs']} | " + " | ".join(cells) + " |")
            table.append(row)
    figures = [Figure(name=f"median over job kinds of the sim_error median ({label(src)})",
                      value=f"{100 * statistics.median(medians[src]):.2f}%", goal="<= 2%",
                      met=statistics.median(medians[src]) <= 0.02,
                      anchor="" if src == a.src else "the same traces, analysed by the baseline")
               for src in codes if medians[src]]
    command = ".venv/bin/python benchmarks/replay_fidelity.py " + (
        "--traces DIR" if a.traces else f"--rounds {a.rounds}") + (
        " --baseline OLD/src" if a.baseline else "")
    write(Run(benchmark="Replay fidelity of recorded pipeline runs (sim_error, clean runs)",
              issue="30", command=command, figures=figures, table=table))


def label(src: Path) -> str:
    """How a table names the code that analysed: this tree, or the other tree by its commit
    (a path of this machine means nothing on the page)."""
    if src.resolve() == (REPO / "src").resolve():
        return "this tree"
    try:
        out = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10, check=False).stdout
    except OSError:
        out = ""
    return f"baseline {out.strip()}" if out.strip() else "baseline tree"


if __name__ == "__main__":
    main()
