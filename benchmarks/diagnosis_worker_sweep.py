"""Slow workers of random place, size and noise: named exactly, missed, or named wrong.

Random jobs (dp 8-64 × pp 2-8, one slow worker ×1.15-1.8, op noise 2-10%, 10 steps), each
analysed twice in the same run: with the diagnosis's rule and with the strict rule it replaced
(every finding's interval lower end >= min_gain, even for a worker the outlier test
established). A job counts when its injection costs >= ×1.03 (ground truth); the others are
slack, as in diagnosis_accuracy.py.

    .venv/bin/python benchmarks/diagnosis_worker_sweep.py [--jobs 40] [--seed 7]
"""

from __future__ import annotations

import argparse
import collections
import sys

import numpy as np
from results import Figure, Run, write

from stragglers.trace.synth import generate, ground_truth
from stragglers.whatif import diagnosis
from stragglers.whatif import analyze

SHAPES = [(32, 4), (64, 2), (16, 8), (8, 4)]


def strict(cand, gain, lo, cfg) -> bool:
    """The rule before: the interval's lower end reaches min_gain, for every candidate."""
    return lo >= cfg.min_gain


def verdict(result, place) -> str:
    """exact | missed | wrong (a worker_fault naming other workers than the injected one)."""
    found = [(f.cause, sorted((w.dp, w.pp) for w in f.where.workers))
             for f in result.diagnosis]
    faults = [workers for cause, workers in found if cause == "worker_fault"]
    if faults and faults != [[place]]:
        return "wrong"
    return "exact" if faults == [[place]] and len(found) == 1 else "missed"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=40)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--name", default=None, help="write the result as this name (a path: "
                        "there, e.g. /tmp/x) instead of results/diagnosis_worker_sweep.json")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    rule = diagnosis._clears
    counts = {"current": collections.Counter(), "strict": collections.Counter()}
    missed = []
    slack = 0
    for i in range(args.jobs):
        dp, pp = SHAPES[i % len(SHAPES)]
        place = (int(rng.integers(dp)), int(rng.integers(pp)))
        factor = float(rng.choice([1.15, 1.25, 1.4, 1.8]))
        noise = float(rng.choice([0.02, 0.05, 0.1]))
        trace = generate(dp=dp, pp=pp, microbatches=8, steps=10, seed=100 + i, noise=noise,
                         slow_worker=(*place, factor))
        impact = ground_truth(trace)[0].impact
        assert impact is not None, "jobs this small have their impact measured"
        if impact < 1.03:
            slack += 1
            continue
        for name, clears in (("current", rule), ("strict", strict)):
            diagnosis._clears = clears
            try:
                v = verdict(analyze(trace), place)
            finally:
                diagnosis._clears = rule
            counts[name][v] += 1
            if name == "current" and v != "exact":
                missed.append((dp, pp, place, factor, noise, round(impact, 3), v))
    scored = args.jobs - slack
    print(f"{args.jobs} jobs, {slack} slack (impact < 1.03), {scored} scored")
    print("| rule | exact | missed | wrong workers |")
    print("|---|---|---|---|")
    for name, c in counts.items():
        print(f"| {name} | {c['exact']} | {c['missed']} | {c['wrong']} |")
    for row in missed:
        print("not exact (current rule):", row)
    now = counts["current"]
    write(Run(benchmark="Slow workers of random place, size and noise", issue="10",
              command=" ".join([".venv/bin/python benchmarks/diagnosis_worker_sweep.py",
                                *sys.argv[1:]]),
              figures=[Figure(name=f"slow worker named exactly ({scored} scored jobs, {slack} "
                                   "slack), the diagnosis's rule",
                              value=f"{now['exact']} of {scored}"),
                       Figure(name="missed / named at wrong workers, the diagnosis's rule",
                              value=f"{now['missed']} / {now['wrong']}", goal="0 / 0",
                              met=now["missed"] == 0 and now["wrong"] == 0),
                       Figure(name="named exactly by the strict rule it replaced",
                              value=f"{counts['strict']['exact']} of {scored}",
                              anchor="same jobs, same run")]), args.name)


if __name__ == "__main__":
    main()
