"""Diagnosis accuracy on synthetic jobs: predicted vs true speedup per cause, and a confusion table.

True speedup = mean step time of the job / of the same job (same seed, so the same noise)
regenerated with the cause removed; for stage imbalance, with the stages rebalanced (every
stage's work at the mean), which is what the prediction claims.

    .venv/bin/python benchmarks/diagnosis_accuracy.py [--quick]
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import numpy as np
from results import Figure, Run, write

from stragglers.trace.synth import generate, ground_truth
from stragglers.whatif import analyze


def step_time(trace) -> float:
    """Mean over steps of (last end − first start)."""
    ops = trace.ops
    end = ops["start_ts"] + ops["duration"]
    steps = np.unique(ops["step"])
    return float(np.mean([end[ops["step"] == s].max() - ops["start_ts"][ops["step"] == s].min()
                          for s in steps]))


def injection(cause: str, dp: int, pp: int) -> dict:
    """Generator keywords of one injected cause on a dp × pp job."""
    last = pp - 1
    return {
        "worker_fault": {"slow_worker": (dp // 2, last // 2, 1.6)},
        "stage_imbalance": {"heavy_last_stage": 1.5},
        "sequence_imbalance": {"seq_imbalance": {"dist": "lognormal"}},
        "gc": {"gc": (0.3, 0.2)},
        "gc_in_compute": {"gc_in_compute": (0.3, 0.2)},
        "communication": {"slow_link": {"kind": "p2p", "dp": dp - 1, "stage_from": 0,
                                        "stage_to": 1, "factor": 80}},
        "host_stall": {"host_stall": {"dp": dp // 2, "stage": last, "seconds": 0.15}},
    }[cause]


def without(cause: str, kwargs: dict, pp: int) -> dict:
    """The same job with the cause removed (stage imbalance: rebalanced)."""
    out = dict(kwargs)
    key = next(iter(injection(cause, 2, max(pp, 2))))
    out.pop(key)
    if cause == "stage_imbalance":
        f = kwargs["heavy_last_stage"]
        out["stage_scale"] = [(pp - 1 + f) / pp] * pp
    return out


def accuracy(shape: dict, seeds: range) -> list[tuple]:
    rows = []
    for cause in ("worker_fault", "stage_imbalance", "sequence_imbalance", "gc", "gc_in_compute",
                  "communication", "host_stall"):
        for seed in seeds:
            kwargs = {**shape, "seed": seed, **injection(cause, shape["dp"], shape["pp"])}
            trace = generate(**kwargs)
            if cause == "gc":   # keep the gc slots in the twin: generate with gc, then zero it
                twin_kwargs = {**kwargs, "gc": (1e-12, 1e-12)}
            else:
                twin_kwargs = without(cause, kwargs, shape["pp"])
            true = step_time(trace) / step_time(generate(**twin_kwargs))
            result = analyze(trace)
            name = "gc" if cause == "gc_in_compute" else cause
            hit = [d for d in result.diagnosis if d.cause == name]
            predicted = hit[0].speedup_if_fixed if hit else None
            rows.append((cause, seed, true, predicted,
                         hit[0].interval if hit else None))
    return rows


def combined(shape: dict, seeds: range) -> list[tuple]:
    """Several causes at once: the all-fixed prediction against the job with all removed."""
    rows = []
    for seed in seeds:
        pp = shape["pp"]
        kwargs = {**shape, "seed": seed, "slow_worker": (1, 1, 1.6), "heavy_last_stage": 1.4,
                  "gc": (0.2, 0.2)}
        trace = generate(**kwargs)
        clean = {**shape, "seed": seed, "gc": (1e-12, 1e-12),
                 "stage_scale": [(pp - 1 + 1.4) / pp] * pp}
        true = step_time(trace) / step_time(generate(**clean))
        result = analyze(trace)
        found = sorted(d.cause for d in result.diagnosis)
        rows.append((seed, true, result.diagnosis_summary.all_fixed, found))
    return rows


def confusion(shapes: list[dict], seeds: range) -> tuple[dict, int, list]:
    table: dict = collections.defaultdict(collections.Counter)
    wrong_place = skipped = 0
    misses = []
    cases = ["none", "worker_fault", "stage_imbalance", "sequence_imbalance", "gc",
             "gc_in_compute", "communication", "host_stall", "worker_fault+stage_imbalance",
             "worker_fault+gc+communication"]
    for shape in shapes:
        for seed in seeds:
            for case in cases:
                parts = [] if case == "none" else case.split("+")
                if any(p in ("stage_imbalance", "communication") for p in parts) and shape["pp"] < 2:
                    continue
                if "worker_fault" in parts and shape["dp"] < 2:
                    continue
                kwargs = {**shape, "seed": seed}
                for p in parts:
                    kwargs.update(injection(p, shape["dp"], shape["pp"]))
                trace = generate(**kwargs)
                truth = ground_truth(trace)
                # an injection with no effect on the step time (slack) is no cause to find
                if any(t.impact is not None and t.impact < 1.03 for t in truth):
                    skipped += 1
                    continue
                got = analyze(trace).diagnosis
                diagnosed = "+".join(sorted({d.cause for d in got}))
                table[case][diagnosed] += 1
                expected = "+".join(sorted({"gc" if p == "gc_in_compute" else p
                                            for p in parts})) or "none"
                if diagnosed != expected:
                    misses.append((case, shape, seed, diagnosed))
                for t in truth:
                    f = next((d for d in got if d.cause == t.cause), None)
                    if f is not None and t.where.dp and t.where.pp and f.where.workers \
                            and t.cause in ("worker_fault", "host_stall"):
                        named = {(w.dp, w.pp) for w in f.where.workers}
                        if named != {(t.where.dp[0], t.where.pp[0])}:
                            wrong_place += 1
    return table, wrong_place, misses, skipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer seeds and sizes")
    parser.add_argument("--name", default=None, help="write the result as this name (a path: "
                        "there, e.g. /tmp/x) instead of results/diagnosis_accuracy.json")
    args = parser.parse_args()
    t0 = time.perf_counter()
    seeds = range(2) if args.quick else range(3)
    shape = dict(dp=4, pp=4, microbatches=8, steps=8)
    print("## Predicted vs true speedup (dp 4 × pp 4, 8 microbatches, 8 steps)\n")
    print("| cause | seed | true | predicted | interval | error |")
    print("|---|---|---|---|---|---|")
    errors = collections.defaultdict(list)
    rows = []
    for cause, seed, true, pred, interval in accuracy(shape, seeds):
        err = None if pred is None else pred / true - 1
        errors[cause].append(err)
        shown = "missed" if pred is None else f"{pred:.3f}"
        iv = "" if interval is None else f"{interval.low:.3f}–{interval.high:.3f}"
        shown_err = '' if err is None else f'{100 * err:+.1f}%'
        print(f"| {cause} | {seed} | {true:.3f} | {shown} | {iv} | {shown_err} |")
        rows.append({"cause": cause, "seed": str(seed), "true": f"{true:.3f}",
                     "predicted": shown, "interval": iv, "error": shown_err})
    print("\n## Several causes at once: all fixed together (dp 4 × pp 4; slow worker ×1.6, "
          "last stage ×1.4, GC 0.2 pauses of 0.2 s per worker-step)\n")
    print("| seed | true (all removed, stages rebalanced) | predicted all_fixed | error | found |")
    print("|---|---|---|---|---|")
    together = combined(shape, seeds)
    for seed, true, pred, found in together:
        print(f"| {seed} | {true:.3f} | {pred:.3f} | {100 * (pred / true - 1):+.1f}% | "
              f"{', '.join(found)} |")
    shapes = [dict(dp=1, pp=4, vpp=1, microbatches=8, steps=6),
              dict(dp=4, pp=1, vpp=1, microbatches=8, steps=6, sync="ddp"),
              dict(dp=8, pp=4, vpp=1, microbatches=8, steps=6),
              dict(dp=4, pp=4, vpp=2, microbatches=8, steps=6),
              dict(dp=64, pp=2, vpp=1, microbatches=4, steps=6),
              dict(dp=64, pp=8, vpp=1, microbatches=8, steps=4)]
    if args.quick:
        shapes = shapes[:3]
    table, wrong, misses, skipped = confusion(shapes, range(2) if not args.quick else range(1))
    print("\n## Confusion: injected cause → diagnosed causes (count over sizes × seeds)\n")
    print("sizes: " + "; ".join(f"dp {s['dp']} × pp {s['pp']} × vpp {s['vpp']}" for s in shapes))
    print()
    for case, counts in table.items():
        print(f"- {case}: " + ", ".join(f"{k} ×{v}" for k, v in counts.most_common()))
    print(f"\nworker-located causes named at a wrong worker set: {wrong}")
    print(f"jobs skipped because an injection had no effect (impact < 1.03, slack): {skipped}")
    total = sum(sum(c.values()) for c in table.values())
    print(f"jobs diagnosed exactly (set of causes = set injected): {total - len(misses)} of "
          f"{total}")
    for case, shape, seed, got in misses:
        print(f"- miss: {case} on dp {shape['dp']} × pp {shape['pp']} × vpp {shape['vpp']}, "
              f"seed {seed}: diagnosed {got}")
    print(f"\n(total {time.perf_counter() - t0:.0f} s)")
    found = [e for errs in errors.values() for e in errs if e is not None]
    missed = sum(e is None for errs in errors.values() for e in errs)
    worst = max((abs(e) for e in found), default=0.0)
    worst_all = max(abs(pred / true - 1) for _, true, pred, _ in together)
    write(Run(benchmark="Diagnosis accuracy on synthetic jobs", issue="10",
              command=" ".join([".venv/bin/python benchmarks/diagnosis_accuracy.py", *sys.argv[1:]]),
              figures=[
                  Figure(name="single causes: predicted vs true speedup, worst error",
                         value=f"{100 * worst:.1f}% ({len(found)} found, {missed} missed)"),
                  Figure(name="several causes: all_fixed vs true, worst error",
                         value=f"{100 * worst_all:.1f}%"),
                  Figure(name="confusion: jobs diagnosed exactly (set of causes = set injected)",
                         value=f"{total - len(misses)} of {total}", goal="all",
                         met=not misses),
                  Figure(name="worker-located causes named at a wrong worker set",
                         value=str(wrong), goal="0", met=wrong == 0),
                  Figure(name="jobs skipped: an injection had no effect (impact < 1.03)",
                         value=str(skipped))],
              table=rows), args.name)


if __name__ == "__main__":
    main()
