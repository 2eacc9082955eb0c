"""Random jobs with zero to three causes at once: every strong cause named where it sits, none invented.

Each job draws a shape (dp 2-32 × pp 1-8, ZeRO or DDP, op noise 2 or 5%) and up to three
causes of random place and size (slow worker ×1.3-2.5, heavy last stage ×1.3-2, sequence
imbalance, GC pauses, a slow p2p link or one stage's slow collective, a host stall). Graded
against the generator's ground truth:
- missed: an injected cause whose impact (step time with it / without it) is ≥ ×1.05 and that
  the diagnosis does not name (a weaker one may be named or not: slack);
- invented: a named cause that was not injected;
- misplaced: a strong worker fault or host stall named at other workers, a strong stage
  imbalance at another stage.
A collective slowed on every rank is not drawn: its median is the slow value (docs/whatif.md §6), so by
the contract it is no straggler.

    .venv/bin/python benchmarks/diagnosis_combinations.py [--jobs 200] [--seed 11] [--no-seq-lens]
                                                          [--wide]

--wide draws from a wider set: dp 1-64, interleaved pipelines (vpp 2) in 40% of pipelined
jobs, and GC pauses inside compute (no gc rows, as NDTimeline shows them) as a seventh cause
(never with the gc-row kind in one job: a trace's gc rows carry its pauses or carry none).
With one DP rank a worker has no peers: by the contract a slow one is its stage's imbalance
(named there, counted right), and with pp 1 no cause on one worker is a straggler; a slow
p2p link needs other links to compare with (pp >= 3). Those are not counted as missed, nor is
a cause whose steps all lie in the leading steps the analysis leaves out as warm-up (a GC pause
in step 0 alone: a slow first step is warm-up by the contract, and the trace cannot tell).

--no-seq-lens drops Σs² and token counts from the traces, as NDTimeline and profiler traces
come: sequence imbalance is then told from the microbatch pattern alone.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import msgspec
import numpy as np
from results import Figure, Run, write

from stragglers.trace.synth import CauseWhere, InjectedCause, generate, ground_truth
from stragglers.whatif import analyze

CAUSES = ("worker_fault", "stage_imbalance", "sequence_imbalance", "gc", "communication",
          "host_stall")
WIDE_CAUSES = CAUSES + ("gc_in_compute",)
STRONG = 1.05


def injection(rng, dp: int, pp: int, sync: str, cause: str) -> dict:
    """Generator keywords of one cause of random place and size."""
    if cause == "worker_fault":
        return {"slow_worker": (int(rng.integers(dp)), int(rng.integers(pp)),
                                float(rng.uniform(1.3, 2.5)))}
    if cause == "stage_imbalance":
        return {"heavy_last_stage": float(rng.uniform(1.3, 2.0))}
    if cause == "sequence_imbalance":
        return {"seq_imbalance": {"dist": str(rng.choice(["lognormal", "uniform"]))}}
    if cause == "gc":
        return {"gc": (float(rng.uniform(0.2, 1.0)), float(rng.uniform(0.05, 0.3)))}
    if cause == "communication":
        if pp >= 3 and rng.random() < 0.5:
            optype = "grads-reduce-scatter" if sync == "zero" else "grads-all-reduce"
            return {"slow_link": {"kind": "collective", "optype": optype,
                                  "stage": int(rng.integers(pp)),
                                  "factor": float(rng.uniform(3, 10))}}
        a = int(rng.integers(pp - 1))
        return {"slow_link": {"kind": "p2p", "dp": int(rng.integers(dp)), "stage_from": a,
                              "stage_to": a + 1, "factor": float(rng.uniform(30, 120))}}
    if cause == "gc_in_compute":
        return {"gc_in_compute": (float(rng.uniform(0.2, 1.0)), float(rng.uniform(0.05, 0.3)))}
    return {"host_stall": {"dp": int(rng.integers(dp)), "stage": int(rng.integers(pp)),
                           "seconds": float(rng.uniform(0.08, 0.3))}}


def grade(truth: list[InjectedCause], found: list, dp: int = 2,
          pp: int = 2, warmup: list[int] | None = None) -> tuple[list, list, list]:
    """(missed, invented, misplaced) cause names."""
    named = {f.cause for f in found} - {"none", "unexplained"}
    # a cause only in the steps the analysis left out as warm-up is not in what it analysed
    # (a GC pause in step 0 alone makes step 0 slow, as allocation and compilation do)
    truth = [t for t in truth
             if not (warmup and t.where.steps and set(t.where.steps) <= set(warmup))]
    strong = {t.cause for t in truth if t.impact is None or t.impact >= STRONG}
    injected = {t.cause for t in truth}
    if dp == 1:   # no peers: see the module docstring
        if "worker_fault" in injected and pp > 1:
            injected.add("stage_imbalance")
            truth = [msgspec.structs.replace(t, cause="stage_imbalance",
                                             where=CauseWhere(pp=t.where.pp))
                     if t.cause == "worker_fault" else t for t in truth]
        strong -= {"worker_fault", "host_stall"} | ({"communication"} if pp < 3 else set())
    misplaced = []
    for t in truth:
        mine = [f.where for f in found if f.cause == t.cause]
        if not mine or (t.impact is not None and t.impact < STRONG):
            continue
        if t.cause in ("worker_fault", "host_stall"):
            ok = any(w.dp == t.where.dp and w.pp == t.where.pp for w in mine)
        elif t.cause == "stage_imbalance":
            # the heavy stage among those named: a finding may name every heavy stage at once
            # (with one DP rank a slow worker's stage beside the heavy last one)
            ok = any(set(t.where.pp or []) <= set(w.pp) for w in mine)
        else:
            continue
        if not ok:
            misplaced.append(t.cause)
    return sorted(strong - named), sorted(named - injected), misplaced


def _places(dp: list[int] | None, pp: list[int] | None, steps: list[int] | None) -> str:
    """'dp 3 pp 1', 'dp 0-15 (14) pp 0', '' for the whole job; steps when narrowed."""
    def span(name: str, values: list[int] | None) -> str:
        if not values:
            return ""
        if len(values) <= 3:
            return f"{name} {','.join(map(str, values))}"
        return f"{name} {values[0]}-{values[-1]} ({len(values)})"
    text = " ".join(x for x in (span("dp", dp), span("pp", pp)) if x)
    return text + (f" steps {','.join(map(str, steps))}" if steps and len(steps) < 8 else "")


def failing_row(i: int, shape: str, truth: list[InjectedCause], found: list,
                missed: list, invented: list, misplaced: list) -> dict[str, str]:
    """One job not right, for the results table: what was injected, what was found, where."""
    def one(cause: str, size: float | None, where) -> str:
        place = _places(where.dp, where.pp, where.steps)
        return cause + (f" ×{size:.3f}" if size is not None else "") + \
            (f" @ {place}" if place else "")

    injected = "; ".join(one(t.cause, t.impact, t.where) for t in truth)
    named = "; ".join(one(f.cause, f.speedup_if_fixed, f.where) for f in found)
    return {"job": str(i), "shape": shape, "injected (impact, where)": injected,
            "found (speedup, where)": named, "missed": ", ".join(missed) or "-",
            "invented": ", ".join(invented) or "-", "misplaced": ", ".join(misplaced) or "-"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--wide", action="store_true",
                        help="dp 1-64, interleaved pipelines, GC inside compute (see above)")
    parser.add_argument("--no-seq-lens", action="store_true",
                        help="drop Σs² and tokens from the traces (as NDTimeline has none)")
    parser.add_argument("--name", default=None, help="write the result as this name (a path: "
                        "there, e.g. /tmp/x) instead of results/diagnosis_combinations*.json")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    counts = collections.Counter()
    bad = []
    t0 = time.perf_counter()
    for i in range(args.jobs):
        sizes = [1, 2, 4, 8, 16, 64] if args.wide else [2, 4, 8, 16, 32]
        dp, pp = int(rng.choice(sizes)), int(rng.choice([1, 2, 4, 8]))
        vpp = 2 if args.wide and pp > 1 and rng.random() < 0.4 else 1
        sync = str(rng.choice(["zero", "ddp"]))
        options = [c for c in (WIDE_CAUSES if args.wide else CAUSES)
                   if pp > 1 or c not in ("stage_imbalance", "communication")]
        chosen = list(rng.choice(options, size=int(rng.choice([0, 1, 1, 2, 2, 3])),
                                 replace=False))
        if "gc" in chosen and "gc_in_compute" in chosen:
            chosen.remove("gc_in_compute")   # a trace has gc rows that carry the pauses or not
        kwargs = {}
        for cause in chosen:
            kwargs.update(injection(rng, dp, pp, sync, str(cause)))
        noise = float(rng.choice([0.02, 0.05]))
        trace = generate(dp=dp, pp=pp, vpp=vpp, microbatches=8, steps=8, seed=1000 + i, noise=noise,
                         sync=sync, **kwargs)
        if args.no_seq_lens:
            for column in ("attn_cost", "tokens"):
                trace.ops.pop(column, None)
        truth = ground_truth(trace)
        result = analyze(trace)
        found = result.diagnosis
        missed, invented, misplaced = grade(truth, found, dp, pp, result.warmup_steps)
        counts["jobs"] += 1
        counts["causes injected"] += len(truth)
        counts["strong causes"] += sum(t.impact is None or t.impact >= STRONG for t in truth)
        counts["missed"] += len(missed)
        counts["invented"] += len(invented)
        counts["misplaced"] += len(misplaced)
        if missed or invented or misplaced:
            shape = (f"dp {dp} × pp {pp}" + (f" vpp {vpp}" if vpp > 1 else "")
                     + f", {sync}, noise {noise:.0%}")
            bad.append(failing_row(i, shape, truth, found, missed, invented, misplaced))
    print(f"{counts['jobs']} jobs, {counts['causes injected']} causes injected, "
          f"{counts['strong causes']} strong (impact >= x{STRONG}); "
          f"{time.perf_counter() - t0:.0f} s")
    print("| jobs right | strong causes missed | causes invented | misplaced |")
    print("|---|---|---|---|")
    print(f"| {counts['jobs'] - len(bad)} of {counts['jobs']} | {counts['missed']} | "
          f"{counts['invented']} | {counts['misplaced']} |")
    for row in bad:
        print("not right:", " | ".join(f"{k}: {v}" for k, v in row.items()))
    right = counts["jobs"] - len(bad)
    write(Run(benchmark="Random jobs with zero to three causes" + (" (wide)" if args.wide else ""),
              issue="10",
              command=" ".join([".venv/bin/python benchmarks/diagnosis_combinations.py",
                                *sys.argv[1:]]),
              figures=[Figure(name="jobs right (every strong cause named where it sits, none "
                                   "invented)", value=f"{right} of {counts['jobs']}",
                              goal="all", met=right == counts["jobs"]),
                       Figure(name="strong causes missed", value=str(counts["missed"])),
                       Figure(name="causes invented", value=str(counts["invented"]), goal="0",
                              met=counts["invented"] == 0),
                       Figure(name="misplaced", value=str(counts["misplaced"]))],
              table=bad,
              text=["The table lists every job not right: the causes injected with their "
                    "impact (step time with the cause / without it, all other draws the same) "
                    "and where, the causes the diagnosis named with its speedup_if_fixed and "
                    "where; job i is drawn from `--seed`'s generator and generated with seed "
                    "1000 + i."] if bad else []),
          args.name or ("diagnosis_combinations_wide" if args.wide else None))


if __name__ == "__main__":
    main()
