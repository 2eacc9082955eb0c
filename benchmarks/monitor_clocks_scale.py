"""What aligning rank clocks step by step (monitor/clocks.align_step_clocks) costs the analysis
process when every rank is on its own clock (hosts without NTP, steps under a second: one set
of ranks each): one step of K ranks, and a 10-step window of K ranks through the window's own
sequence (step_op_spans, ops_past_next_step, align_step_clocks), CPU seconds and consensus
offsets taken, side by side with clocks.py as it was at `--before` (one set placed at a time,
every set tried against every set placed: sets² x rows) read from git. Run:

    .venv/bin/python benchmarks/monitor_clocks_scale.py [--before 44511f8]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import types
from pathlib import Path

import numpy as np
from results import Figure, Run, write

from stragglers.monitor import clocks
from stragglers.monitor.windows import ops_past_next_step, step_op_spans
from stragglers.trace.kineto import align
from stragglers.trace.model import OPTYPE_CODES

REPO = Path(__file__).resolve().parents[1]
AR, FC = OPTYPE_CODES["grads-all-reduce"], OPTYPE_CODES["forward-compute"]


def own_clocks(ranks: int, steps: int) -> dict[str, np.ndarray]:
    """A DP job, rank r's clock 1e4 * r s ahead: a step of four forward computes and
    all-reduces a rank (the review's clocks_bomb.py and clocks_window.py)."""
    rows = []
    for r in range(ranks):
        t = 1.7e9 + 1e4 * r
        for s in range(steps):
            for i in range(4):
                rows.append((r, s, FC, t, 0.01, 0, r, s * 4 + i))
                rows.append((r, s, AR, t + 0.01, 0.005, 0, r, s * 4 + i))
                t += 0.015
    a = np.array(rows, dtype=np.float64)
    return {"rank": a[:, 0].astype(np.int64), "step": a[:, 1].astype(np.int64),
            "optype": a[:, 2].astype(np.int16), "start_ts": a[:, 3], "duration": a[:, 4],
            "stage": a[:, 5].astype(np.int64), "dp_rank": a[:, 6].astype(np.int64),
            "seq_id": a[:, 7].astype(np.int64)}


def before(commit: str) -> types.ModuleType:
    """clocks.py as it was at `commit`, as a module of its own."""
    src = subprocess.run(["git", "show", f"{commit}:src/stragglers/monitor/clocks.py"],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    module = types.ModuleType(f"clocks_{commit}")
    exec(compile(src, f"clocks.py@{commit}", "exec"), module.__dict__)   # noqa: S102
    return module


def measure(module, ranks: int, steps: int) -> tuple[float, int, int]:
    """(CPU seconds of the alignment, consensus offsets taken, rank-steps moved)."""
    ops = own_clocks(ranks, steps)
    spans = None
    if steps > 1:   # (the window's sequence: the op bounds first, their spans shared)
        trace = types.SimpleNamespace(ops=ops)   # (the bounds read its columns only)
        spans = step_op_spans(trace, {}, {}, steps - 1)
        assert not ops_past_next_step(trace, {}, {}, steps - 1, spans)
    taken = 0
    offset = align.consensus_offset

    def counted(diffs, *args, **kwargs):
        nonlocal taken
        taken += 1
        return offset(diffs, *args, **kwargs)

    align.consensus_offset = counted
    try:
        t0 = time.process_time()
        got = module.align_step_clocks(ops, spans)
        cpu = time.process_time() - t0
    finally:
        align.consensus_offset = offset
    assert len(got.moved) == (ranks - 1) * steps and not got.left_out
    return cpu, taken, len(got.moved)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default="44511f8", help="the commit whose clocks.py is the "
                    "baseline (default: the one that added it, unchanged until this one)")
    ap.add_argument("--rounds", type=int, default=3, help="best of this many runs, after")
    ap.add_argument("--name", default=None, help="write the result as this name (a path: "
                    "there, e.g. /tmp/x) instead of results/monitor_clocks_scale.json")
    args = ap.parse_args()
    old = before(args.before)
    align.consensus_offset(np.zeros(1))   # (the kineto import out of the first timing)
    # (ranks, steps, with the baseline: past these it took minutes, sets² x rows)
    cases = [(256, 1, True), (512, 1, True), (1024, 1, False), (4096, 1, False),
             (128, 10, True), (256, 10, True), (1024, 10, False)]
    figures, table = [], []
    for ranks, steps, with_before in cases:
        what = (f"one step, {ranks:,} ranks each on its own clock" if steps == 1 else
                f"{steps}-step window, {ranks:,} ranks each on its own clock")
        rows = 8 * ranks * steps
        after = min((measure(clocks, ranks, steps) for _ in range(args.rounds)),
                    key=lambda m: m[0])
        was = measure(old, ranks, steps) if with_before else None
        print(f"{what}: {rows:,} rows, after {after[0]:.3f} s CPU ({after[1]:,} offsets)"
              + (f", before {was[0]:.2f} s ({was[1]:,} offsets)" if was else ""), flush=True)
        figures.append(Figure(
            name=f"{what} ({rows:,} rows): align_step_clocks CPU",
            value=f"{after[0]:.3f} s",
            anchor=(f"before ({args.before}), same run: {was[0]:.2f} s, "
                    f"{was[0] / after[0]:.0f}x" if was else
                    f"before ({args.before}) not run here: sets² x rows, minutes")))
        table.append({"case": what, "rows": f"{rows:,}",
                      "CPU after": f"{after[0]:.3f} s",
                      "CPU before": f"{was[0]:.2f} s" if was else "not run",
                      "consensus offsets after": f"{after[1]:,}",
                      "consensus offsets before": f"{was[1]:,}" if was else "not run"})
    write(Run(benchmark="Monitor: rank clocks aligned at scale, every rank on its own clock "
                        "(issue 34)",
              issue="34", command=" ".join([".venv/bin/python benchmarks/monitor_clocks_scale.py",
                                            *sys.argv[1:]]),
              figures=figures, table=table,
              text=["Each rank's clock 1e4 s from the next (every rank a set of its own); "
                    "a step is four forward computes and four all-reduces a rank. CPU "
                    "seconds of align_step_clocks alone, best of --rounds after, one run "
                    "before (clocks.py at --before read from git, run in the same process). "
                    "The consensus offsets taken count the work: one a rank a step after, "
                    "every set against every set placed before."]), args.name)


if __name__ == "__main__":
    main()
