"""The per-part checks of the monitor: a watched file's footer (parts.read_part_footer) and an
upload's footer and three columns (parts.read_upload), µs per part.

A job's parts (dp 8 × pp 4, 455 rows each) are written once; then each check runs over all
of them, alternating the current module with another version of parts.py given by path
(e.g. a worktree of the commit before), best of several rounds, in one process. The figure is
the process's CPU time per part (user + system: the file reads count), which a loaded machine
does not inflate as it does the wall time (shown beside it). Run:

    .venv/bin/python benchmarks/monitor_footer_check.py [--other PATH/TO/parts.py] [--rounds 9]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from monitor_ingest import job, split  # noqa: E402
from results import Figure, Run, write  # noqa: E402

from stragglers.monitor import parts  # noqa: E402
from stragglers.trace.runformat import write_meta, write_rank  # noqa: E402


def load(path: str):
    """parts.py at `path` as a module of its own."""
    spec = importlib.util.spec_from_file_location("parts_other", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["parts_other"] = module   # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def footers(module, files: list[Path], bodies: list[bytes]) -> tuple[float, float]:
    """(CPU, wall) seconds per part of reading every part's footer."""
    c0, t0 = time.process_time(), time.perf_counter()
    for f in files:
        module.read_part_footer(f)
    return ((time.process_time() - c0) / len(files), (time.perf_counter() - t0) / len(files))


def uploads(module, files: list[Path], bodies: list[bytes]) -> tuple[float, float]:
    """(CPU, wall) seconds per part of checking every part as an upload."""
    c0, t0 = time.process_time(), time.perf_counter()
    for f, body in zip(files, bodies):
        rank, part = module.parse_part_name(f.name)
        module.read_upload(body, "upload", rank, part, f)
    return ((time.process_time() - c0) / len(files), (time.perf_counter() - t0) / len(files))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--other", help="another parts.py to compare with")
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        trace = job(8, 4, 100, seed=0)
        run = Path(tmp) / "job"
        write_meta(run, trace.meta)
        files = [write_rank(run, r, cols, part=p) for r, p, cols in split(trace, 5)]
        bodies = [f.read_bytes() for f in files]
        versions = {"current": parts}
        if args.other:
            versions["other"] = load(args.other)
        figures = []
        for check in (footers, uploads):
            best = {name: float("inf") for name in versions}
            wall = {name: float("inf") for name in versions}
            for _ in range(args.rounds):
                for name, module in versions.items():
                    cpu, elapsed = check(module, files, bodies)
                    best[name], wall[name] = min(best[name], cpu), min(wall[name], elapsed)
            print(f"{check.__name__}: {len(files)} parts; best of {args.rounds} rounds, "
                  f"µs per part (CPU / wall): " + ", ".join(
                      f"{name} {1e6 * best[name]:.1f} / {1e6 * wall[name]:.1f}" for name in best)
                  + (f"; current / other (CPU) {best['current'] / best['other']:.2f}"
                     if args.other else ""))
            figures.append(Figure(
                name=("footer check (a watched part)" if check is footers else
                      "upload check (footer + 3 columns)") + f", {len(files)} parts of "
                     f"{len(trace) // len(files)} rows, best of {args.rounds} rounds, CPU time",
                value=f"{1e6 * best['current']:.0f} µs per part",
                anchor=f"the other parts.py: {1e6 * best['other']:.0f} µs" if args.other else "",
                note=f"wall {1e6 * wall['current']:.0f} µs per part (grows with the machine's "
                     "load; the CPU time much less)"))
    if not args.other:  # a comparison with a tree outside the repository is not a page figure
        write(Run(benchmark="Monitor: a part's footer and upload checks", issue="14",
                  command=f".venv/bin/python benchmarks/monitor_footer_check.py --rounds "
                          f"{args.rounds}", figures=figures))


if __name__ == "__main__":
    main()
