"""The first hour of a newcomer, measured: the README's commands as a reader runs them.

    .venv/bin/python benchmarks/first_hour.py [--coded-steps 40] [--adaptive-steps 60] [--no-walk]

1. `stragglers advise runs/slow` at 80 columns, on the README's synthetic job: its lines and
   its widest line (a report that fits the terminal cuts no word).
2. The README's coded-training command (examples/train_coded.py, 5 processes), shortened by its
   own --steps: the coded scheme's time against wait-for-all under the same delays (its verdict).
3. The README's adaptive-training command (examples/train_adaptive.py --policy dd, rank 3 at a
   third of the speed): step time before and after DD re-split the batches (its verdict).
4. The README walk (tests/surface/test_readme_walk.py: every sh block, in order, in a fresh
   clone, long runs shortened by their flags): its wall time.
The runs write into a temporary folder. Figures go to benchmarks/results/first_hour.json.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results import Figure, Run, write

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1",
       "PYTHONPATH": str(REPO / "src")}


def run(cmd: list[str], cwd: Path, timeout: float = 900, **env: str) -> str:
    """stdout of `cmd`; a failure ends the benchmark with its stderr's end."""
    proc = subprocess.run(cmd, cwd=cwd, env={**ENV, **env}, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode:
        sys.exit(f"first_hour: {' '.join(cmd)} failed (exit {proc.returncode}):\n"
                 f"{proc.stderr[-3000:]}")
    return proc.stdout


def torchrun(nproc: int, script: str, *args: str, cwd: Path) -> str:
    """The verdict line of an example under torchrun (standalone rendezvous)."""
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(nproc), str(REPO / "examples" / script), *args], cwd)
    lines = [line for line in out.splitlines() if line.startswith("verdict: ")]
    if not lines:
        sys.exit(f"first_hour: {script} printed no verdict:\n{out[-3000:]}")
    return lines[-1]


def advise(tmp: Path) -> Figure:
    """`stragglers advise runs/slow` at 80 columns, after the README's synth command."""
    cli = str(BIN / "stragglers")
    run([cli, "synth", "runs/slow", "--dp", "4", "--pp", "4", "--microbatches", "8", "--steps",
         "10", "--slow-worker", "1,2,1.5"], tmp)
    lines = run([cli, "advise", "runs/slow"], tmp, COLUMNS="80").rstrip("\n").splitlines()
    widest = max(len(line) for line in lines)
    return Figure(name="`stragglers advise runs/slow` at 80 columns",
                  value=f"{len(lines)} lines, widest {widest} columns",
                  goal="≤ 80 columns", met=widest <= 80, anchor="≈85 lines with cut words before")


def coded(tmp: Path, steps: int) -> Figure:
    """The README's train_coded.py command with --steps: coded vs wait-for-all."""
    line = torchrun(5, "train_coded.py", "--steps", str(steps), "--scheme", "cyclic-mds",
                    "--stragglers", "1", "--delay-dist", "pareto", "--delay-scale", "0.02",
                    "--compare", cwd=tmp)
    m = re.search(r"verdict: (\S+) \(s=\d+\) trained \d+ steps in ([\d.]+) s to loss ([\d.]+); "
                  r"wait-for-all took ([\d.]+) s to loss ([\d.]+): ([\d.]+)×", line)
    if not m:
        sys.exit(f"first_hour: train_coded.py's verdict is not as expected: {line}")
    code, t, loss, tb, lossb, speed = m.groups()
    return Figure(name=f"`examples/train_coded.py`, {steps} steps: {code} vs wait-for-all",
                  value=f"{t} s vs {tb} s ({speed}×), loss {loss} vs {lossb}",
                  anchor="wait-for-all under the same delays, same run",
                  note="the coded scheme's exact gradient gives the same loss at every step")


def adaptive(tmp: Path, steps: int) -> Figure:
    """The README's train_adaptive.py --policy dd command with --steps: before / after."""
    line = torchrun(4, "train_adaptive.py", "--steps", str(steps), "--policy", "dd", "--speeds",
                    "1,1,1,0.33", "--workdir", str(tmp / "runs" / "adaptive"), "--overwrite",
                    cwd=tmp)
    m = re.search(r"step time ([\d.]+) s -> ([\d.]+) s \(([\d.]+)x faster", line)
    if not m:
        sys.exit(f"first_hour: train_adaptive.py did not re-split the batches: {line}")
    before, after, speed = m.groups()
    return Figure(name=f"`examples/train_adaptive.py --policy dd`, {steps} steps",
                  value=f"{before} → {after} s per step (×{speed})",
                  anchor="the steps before DD's first re-split, same run")


def walk() -> Figure:
    """The README walk test's wall time (it skips without the real traces: tests/README.md)."""
    t0 = time.monotonic()
    proc = subprocess.run([str(BIN / "pytest"), "-q", "-s", "-p", "no:cacheprovider",
                           "tests/surface/test_readme_walk.py::"
                           "test_every_readme_shell_block_runs_in_order_in_a_fresh_clone"],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    seconds = time.monotonic() - t0
    if proc.returncode:
        sys.exit(f"first_hour: the README walk failed:\n{proc.stdout[-3000:]}")
    if " passed" not in proc.stdout:
        sys.exit(f"first_hour: the README walk did not run:\n{proc.stdout[-1000:]}")
    blocks = next((line.split(":", 1)[1].strip() for line in proc.stdout.splitlines()
                   if line.startswith("README walk:")), "")
    return Figure(name="the README walk (every sh block in a fresh clone, long runs shortened by "
                       "their flags)", value=f"{seconds:.0f} s",
                  note=f"per block: {blocks}" if blocks else "")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--coded-steps", type=int, default=40)
    p.add_argument("--adaptive-steps", type=int, default=60)
    p.add_argument("--no-walk", action="store_true", help="leave the README walk out")
    a = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="first-hour-") as tmp:
        figures = [advise(Path(tmp))]
        print(f"{figures[-1].name}: {figures[-1].value}", flush=True)
        figures.append(coded(Path(tmp), a.coded_steps))
        print(f"{figures[-1].name}: {figures[-1].value}", flush=True)
        figures.append(adaptive(Path(tmp), a.adaptive_steps))
        print(f"{figures[-1].name}: {figures[-1].value}", flush=True)
    if not a.no_walk:
        figures.append(walk())
        print(f"{figures[-1].name}: {figures[-1].value}", flush=True)
    write(Run(benchmark="The first hour", issue="35",
              command=".venv/bin/python benchmarks/first_hour.py"
                      + (f" --coded-steps {a.coded_steps}" if a.coded_steps != 40 else "")
                      + (f" --adaptive-steps {a.adaptive_steps}" if a.adaptive_steps != 60 else "")
                      + (" --no-walk" if a.no_walk else ""),
              figures=figures,
              text=["The README's own commands, run as written but for --steps (and a "
                    "temporary folder for what they write); each example's figure is its "
                    f"verdict line. Its times are wall clock on the shared {os.cpu_count()}-core "
                    "machine: they grow with its load (the run's load is in the header)."]))


if __name__ == "__main__":
    main()
