"""The per-part checks of the monitor, CPU µs per part: a watched file's footer and page
headers (parts.read_part_footer), an upload's checks alone (parts.read_upload) and in a batch
of 64 (parts.check_uploads), and the analysis process's read of a part the ingest checked
(parts.read_part_files with the digest of the checked bytes).

A job's parts (dp 8 × pp 4, 5 steps each) are written once; then each step runs over all of
them, best of several rounds, for this tree and, with --other, for another source tree (e.g. a
worktree of an earlier commit: `git worktree add /tmp/old <commit>`) in its own process on the
same files, the two alternating. The figure is the process's CPU time per part (user + system:
the file reads count), which a loaded machine inflates much less than the wall time. Run:

    .venv/bin/python benchmarks/monitor_footer_check.py [--other /tmp/old] [--rounds 5]
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

HERE = Path(__file__).resolve().parent
CHUNK = 64   # parts the ingest checks, and the analysis process reads, together


def measure(src: str, run: Path, rounds: int) -> dict[str, float]:
    """CPU µs per part of each step, for the tree whose sources are at `src` (this process)."""
    sys.path.insert(0, src)
    from stragglers.monitor import parts

    files = sorted(run.glob("rank-*.parquet"))
    items = [(f.read_bytes(), "upload", *parts.parse_part_name(f.name), f) for f in files]
    footers = [parts.read_part_footer(f) for f in files]
    digests = "digests" in parts.read_part_files.__code__.co_varnames

    def footer():
        for f in files:
            parts.read_part_footer(f)

    def upload():
        for item in items:
            parts.read_upload(*item)

    def upload_batch():
        for i in range(0, len(items), CHUNK):
            parts.check_uploads(items[i:i + CHUNK])

    def analysis_read():
        for i in range(0, len(footers), CHUNK):
            chunk = footers[i:i + CHUNK]
            got = parts.read_part_files([f.path for f in chunk], None,
                                        [f.digest for f in chunk]) if digests else \
                parts.read_part_files([f.path for f in chunk])
            assert not any(isinstance(g, Exception) for g in got), got[:1]

    steps = {"footer": footer, "upload": upload, "analysis_read": analysis_read}
    if hasattr(parts, "check_uploads"):
        steps["upload_batch"] = upload_batch
    out = {}
    for name, fn in steps.items():
        fn()
        best = float("inf")
        for _ in range(rounds):
            c0 = time.process_time()
            fn()
            best = min(best, time.process_time() - c0)
        out[name] = 1e6 * best / len(files)
    return out


def in_process(src: str, run: Path, rounds: int) -> dict[str, float]:
    """measure() in a fresh interpreter whose `stragglers` is the one at `src`."""
    done = subprocess.run([sys.executable, __file__, "--measure", src, "--run", str(run),
                           "--rounds", str(rounds)], capture_output=True, text=True,
                          check=True, env=dict(os.environ, PYTHONPATH=src))
    return json.loads(done.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", help="another source tree (its root) to compare with")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turns", type=int, default=2, help="times each tree is measured")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    parser.add_argument("--run", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.run, args.rounds)))
        return
    sys.path.insert(0, str(HERE))
    from monitor_ingest import job, split  # noqa: E402  (puts this tree's src/ on the path)
    from results import Figure, Run, write  # noqa: E402

    from stragglers.trace.runformat import write_meta, write_rank  # noqa: E402

    trees = {"current": str(HERE.parent / "src")}
    if args.other:
        trees["other"] = str(Path(args.other).resolve() / "src")
    with tempfile.TemporaryDirectory() as tmp:
        trace = job(8, 4, 100, seed=0)
        run = Path(tmp) / "job"
        write_meta(run, trace.meta)
        files = [write_rank(run, r, cols, part=p) for r, p, cols in split(trace, 5)]
        best: dict[str, dict[str, float]] = {name: {} for name in trees}
        for _ in range(args.turns):   # the trees alternate: both see the same load
            for name, src in trees.items():
                for step, us in in_process(src, run, args.rounds).items():
                    best[name][step] = min(best[name].get(step, us), us)
    rows = len(trace) // len(files)
    figures = []
    for step, us in best["current"].items():
        other = best.get("other", {}).get(step)
        print(f"{step}: {len(files)} parts of {rows} rows, CPU µs per part: current {us:.0f}"
              + (f", other {other:.0f}, current / other {us / other:.2f}" if other else ""))
        figures.append(Figure(
            name=f"{step}, {len(files)} parts of {rows} rows, best of {args.rounds} rounds × "
                 f"{args.turns}, CPU time", value=f"{us:.0f} µs per part",
            anchor=f"the other tree: {other:.0f} µs" if other else ""))
    if not args.other:  # a comparison with a tree outside the repository is not a page figure
        write(Run(benchmark="Monitor: a part's footer and upload checks", issue="14",
                  command=f".venv/bin/python benchmarks/monitor_footer_check.py --rounds "
                          f"{args.rounds}", figures=figures))


if __name__ == "__main__":
    main()
