"""Per-worker step-time tables with a slow set of random size: named exactly, missed, or wrong.

Random tables (8-128 workers, 50 or 200 steps; a slow set of one worker, 10%, 25%, half or 60%
of them, each ×1.1-2.0; every worker-step its own lognormal noise of 1-5% and every step a
shared 2% variation), written as CSV and read as `stragglers analyze` reads them. A table
counts when its slow set costs ≥ ×1.03 (ground truth: the same draws without the slowdown);
the others are slack. Exact: the first finding is worker_fault or slow_group naming the slow
set and nothing else; wrong: a finding names a worker that is not slow. Noise-only tables (no
slow worker, the same shapes) count every worker named. Then Alibaba PAI's four published jobs
(tests/data/real/pai-minibatch), with what their dataset's README says of each.

    .venv/bin/python benchmarks/diagnosis_step_times.py [--tables 60] [--seed 11]
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path

import numpy as np
from results import Figure, Run, write

from stragglers.trace.load import load_trace
from stragglers.whatif import analyze

REPO = Path(__file__).resolve().parents[1]
PAI = REPO / "tests" / "data" / "real" / "pai-minibatch"
NAMING = ("worker_fault", "slow_group")
# What the dataset's README says of each job (github.com/alibaba/clusterdata).
PAI_SAYS = {"job_1": "straggler (worker 6) emerges in the middle of the training",
            "job_2": "different workers have different mini-batch times",
            "job_3": "there could be multiple stragglers",
            "job_4": "multiple stragglers; the mini-batch time may fluctuate"}


def table(rng, workers: int, slow: set[int], factor: float, noise: float, steps: int
          ) -> tuple[np.ndarray, float]:
    """[workers, steps] seconds, and the slow set's cost (mean step with it / without it)."""
    shared = np.exp(rng.normal(0, 0.02, steps))
    base = shared[None, :] * np.exp(rng.normal(0, noise, (workers, steps)))
    times = base.copy()
    times[sorted(slow)] *= factor
    return times, float(times.max(axis=0).mean() / base.max(axis=0).mean())


def verdict(path: Path, slow: set[int]) -> str:
    """exact | missed | wrong."""
    found = [(f.cause, set(f.where.ranks)) for f in analyze(load_trace(path)).diagnosis]
    named = set().union(*[r for c, r in found if c in NAMING]) if found else set()
    if named - slow:
        return "wrong"
    return "exact" if found and found[0][0] in NAMING and found[0][1] == slow \
        and named == slow else "missed"


def write_csv(path: Path, times: np.ndarray) -> Path:
    lines = ["worker,step,step_time"]
    for s in range(times.shape[1]):
        lines += [f"{w},{s},{times[w, s]:.6f}" for w in range(times.shape[0])]
    path.write_text("\n".join(lines))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=int, default=60)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--name", default=None, help="write the result as this name (a path: "
                        "there, e.g. /tmp/x) instead of results/diagnosis_step_times.json")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    counts: collections.Counter = collections.Counter()
    by_size: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    misses, slack, false_named = [], 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.tables):
            workers = int(rng.choice([8, 16, 32, 64, 128]))
            share = str(rng.choice(["one", "10%", "25%", "half", "60%"]))
            k = {"one": 1, "10%": max(2, round(0.1 * workers)), "25%": round(0.25 * workers),
                 "half": workers // 2, "60%": round(0.6 * workers)}[share]
            slow = {int(x) for x in rng.choice(workers, k, replace=False)}
            factor = float(rng.choice([1.1, 1.2, 1.5, 2.0]))
            noise = float(rng.choice([0.01, 0.03, 0.05]))
            steps = int(rng.choice([50, 200]))
            times, impact = table(rng, workers, slow, factor, noise, steps)
            if impact < 1.03:
                slack += 1
                continue
            v = verdict(write_csv(Path(tmp) / f"t{i}.csv", times), slow)
            counts[v] += 1
            by_size[share][v] += 1
            if v != "exact":
                misses.append((workers, share, k, factor, noise, steps, round(impact, 3), v))
            # the same shape without a slow worker
            quiet, _ = table(rng, workers, set(), 1.0, noise, steps)
            path = write_csv(Path(tmp) / f"q{i}.csv", quiet)
            found = analyze(load_trace(path)).diagnosis
            false_named += sum(len(f.where.ranks) for f in found if f.cause in NAMING)
    scored = args.tables - slack
    print(f"{args.tables} tables, {slack} slack (impact < 1.03), {scored} scored")
    print("| slow set | exact | missed | wrong |")
    print("|---|---|---|---|")
    for share in ("one", "10%", "25%", "half", "60%"):
        c = by_size[share]
        print(f"| {share} | {c['exact']} | {c['missed']} | {c['wrong']} |")
    for row in misses:
        print("not exact:", row)
    print(f"workers named in {scored} noise-only tables: {false_named}")
    pai = []
    for job in sorted(PAI_SAYS):
        result = analyze(load_trace(PAI / f"{job}_norm.csv"))
        first = result.diagnosis[0]
        culprits = sorted({s.worker.rank for s in result.slowest_steps[:5]
                           if s.worker is not None and s.worker.rank is not None})
        pai.append(f"{job} ({PAI_SAYS[job]}): {first.cause} {sorted(first.where.ranks)}, "
                   f"slowest 5 steps' worker {culprits}")
        print(pai[-1])
    write(Run(benchmark="Step-time tables with slow sets of random size",
              issue="10",
              command=" ".join([".venv/bin/python benchmarks/diagnosis_step_times.py",
                                *sys.argv[1:]]),
              figures=[Figure(name=f"slow set named exactly ({scored} scored tables, {slack} "
                                   "slack)", value=f"{counts['exact']} of {scored}"),
                       Figure(name="of them, slow halves and 60%: named exactly",
                              value=f"{by_size['half']['exact'] + by_size['60%']['exact']} of "
                                    f"{sum(by_size['half'].values()) + sum(by_size['60%'].values())}"),
                       Figure(name="tables naming a worker that is not slow",
                              value=str(counts["wrong"]), goal="0", met=counts["wrong"] == 0),
                       Figure(name="workers named in the noise-only tables",
                              value=str(false_named), goal="0", met=false_named == 0),
                       *[Figure(name=f"PAI {line.split(' (')[0]}",
                                value=line.split("): ", 1)[1]) for line in pai]]),
          args.name)


if __name__ == "__main__":
    main()
