"""What reading the step column of watched files checked from their footer costs the ingest
thread (`JobTracker._settle`): a dp 8 × pp 4 job of 100 steps in parts of P steps, every part
checked from its footer and given to a JobTracker (windows of 10) as the ingest gives it, CPU
time of add_part + close_ready with the reads and, side by side, with them left out (the
previous behaviour: a file's range taken as its steps), best of 5 rounds each. Run:

    .venv/bin/python benchmarks/monitor_window_settle.py [--steps-per-part 7 10]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from results import Figure, Run, write

from stragglers.monitor import windows
from stragglers.monitor.part_footers import read_part_footer
from stragglers.trace.runformat import write_rank
from stragglers.trace.synth import generate


def parts(directory: Path, spp: int):
    """The job's parts written as a recorder writes them, checked from their footers."""
    trace = generate(dp=8, pp=4, microbatches=4, steps=100, seed=0)
    o, out = trace.ops, []
    for i, lo in enumerate(range(0, 100, spp)):
        for r in np.unique(o["rank"]):
            sel = (o["rank"] == r) & (o["step"] >= lo) & (o["step"] < lo + spp)
            out.append(read_part_footer(write_rank(directory, int(r),
                                                   {k: v[sel] for k, v in o.items()}, part=i)))
    return trace.meta, out


def run(meta, files, settle: bool, rounds: int = 5) -> tuple[float, int, int]:
    """Best CPU seconds over the rounds, windows cut, files whose steps were read."""
    keep = windows.JobTracker._settle
    if not settle:
        windows.JobTracker._settle = lambda self, step: False   # type: ignore[method-assign]
    try:
        best, cut, read = float("inf"), 0, 0
        for _ in range(rounds):
            fs = [copy.copy(f) for f in files]
            tr = windows.JobTracker("j", meta, 10, gap_wait_s=10.0)
            t0, cut = time.process_time(), 0
            for f in fs:
                tr.add_part(f.rank, f.part, f.last_step, None, 100.0, f)
                cut += len(tr.close_ready(100.0))
            best = min(best, time.process_time() - t0)
            read = sum(f.steps is not None for f in fs)
        return best, cut, read
    finally:
        windows.JobTracker._settle = keep   # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps-per-part", type=int, nargs="+", default=[7, 10])
    ap.add_argument("--name", default=None, help="write the result as this name (a path: "
                    "there, e.g. /tmp/x) instead of results/monitor_window_settle.json")
    args = ap.parse_args()
    figures = []
    with tempfile.TemporaryDirectory() as tmp:
        for spp in args.steps_per_part:
            meta, files = parts(Path(tmp) / f"spp{spp}", spp)
            best: dict[bool, float] = {}
            for settle in (False, True, False, True):
                cpu, cut, read = run(meta, files, settle)
                best[settle] = min(best.get(settle, float("inf")), cpu / len(files))
                print(f"{spp}-step parts ({files[0].records} rows), reads "
                      f"{'on ' if settle else 'off'}: {1e6 * cpu / len(files):6.1f} µs CPU a part,"
                      f" {cut} windows, {read}/{len(files)} files read")
            figures.append(Figure(
                name=f"{spp}-step parts, windows of 10: add_part + close_ready CPU a part, with "
                     f"the step-column reads ({read} of {len(files)} files read)",
                value=f"{1e6 * best[True]:.0f} µs",
                anchor=f"without the reads, same run: {1e6 * best[False]:.0f} µs"))
    write(Run(benchmark="Monitor: a window's last step inside footer-checked files (issue 34)",
              issue="34", command=" ".join([".venv/bin/python benchmarks/monitor_window_settle.py",
                                            *sys.argv[1:]]), figures=figures), args.name)


if __name__ == "__main__":
    main()
