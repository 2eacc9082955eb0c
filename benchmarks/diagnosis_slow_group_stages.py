"""Slow groups that span pipeline stages, in synthetic GPU jobs of DP × PP, TP × PP and ring
CP × PP grids: one `slow_group` at exactly the group's ranks, and no healthy rank named.

Each job draws a grid (2 or 3 pipeline stages of 3-8 ranks; tensor parallel 2, ring attention
of CP 2 or 4, or plain data parallel; GPipe with 2-4 microbatches; one clock), 4-8 profiled
steps, kernel noise 1-3%, every host starting each step up to 0-400 µs late, and one of: a slow
group of 2 to half the ranks computing ×1.5-3 alike (a slow node, a slow rack) drawn over at
least two stages and never a whole stage, a single slow rank (`worker_fault`: a one-rank
"group" must stay a worker fault), such a group beside a slow rank slowed unlike it (its own
`worker_fault`), or noise only (`none`). The job is written as Kineto JSON
(stragglers.trace.synth.kineto), read back and analysed. Graded as
`diagnosis_gpu_traces.py` grades: exact when the set of (cause, rank) named equals the injected
one; an injection below ×1.03 is slack (not graded), below ×1.05 weak (`none` also right).
A job with a slow rank beside the group is right when the group is named `slow_group` exactly,
nothing healthy is named, and the rank is named `worker_fault` or, where its stage holds
members of the group, not at all (re-splitting that stage's work in proportion to speed would
fix it too, though the group's fix is priced without it); the rank named a member of the group
is wrong. How often the rank is named is printed apart ("the rank named worker_fault").
Counted apart: slow-group jobs whose ranks were named under two causes (`split`), and, as
before this grading, the jobs with a slow rank beside the group whose group is named whole
with nothing healthy (the rank under either cause).

    .venv/bin/python benchmarks/diagnosis_slow_group_stages.py [--jobs 120] [--seed 1]
        [--factors 1.5,3.0] [--name /tmp/x]
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
from pathlib import Path

import numpy as np
from diagnosis_gpu_traces import impact, injected, named
from results import Figure, Run, write

from stragglers.trace.load import load_trace
from stragglers.trace.synth.kineto import GpuJob, write_gpu_job
from stragglers.whatif import analyze

KINDS = ("slow_group", "worker_fault", "slow_group+worker_fault", "none")
# (name, tp, cp, ranks per stage to choose from)
GRIDS = (("dp", 1, 1, (3, 4, 5, 6, 8)), ("tp", 2, 1, (4, 6, 8)), ("ring cp2", 1, 2, (4, 6, 8)),
         ("ring cp4", 1, 4, (4, 8)), ("ring cp2 tp2", 2, 2, (8,)))


def spanning_group(rng: np.random.Generator, ranks: int, pp: int) -> tuple[int, ...]:
    """2 to half the ranks, on two stages or more, never a whole stage."""
    per = ranks // pp
    while True:
        size = int(rng.integers(2, max(2, ranks // 2) + 1))
        group = sorted(int(r) for r in rng.choice(ranks, size, replace=False))
        counts = collections.Counter(r // per for r in group)
        if len(counts) >= 2 and max(counts.values()) < per:
            return tuple(group)


def draw(rng: np.random.Generator, seed: int,
         factors: tuple[float, float] = (1.5, 3.0)) -> tuple[str, GpuJob]:
    """One job: a grid with two or three stages and one injection (or none)."""
    grid, tp, cp, pers = GRIDS[int(rng.integers(len(GRIDS)))]
    per = int(rng.choice(pers))
    pp = 3 if per <= 4 and rng.random() < 0.3 else 2
    ranks = per * pp
    shape = dict(ranks=ranks, pp_size=pp, microbatches=int(rng.integers(2, 5)), tp_size=tp,
                 cp_size=cp, cp_comm="ring" if cp > 1 else "all_gather", ranks_per_host=ranks,
                 steps=int(rng.integers(4, 9)), seed=seed, all_to_alls=0,
                 buckets=int(rng.integers(2, 7)), jitter=float(rng.uniform(0.01, 0.03)),
                 host_jitter_us=float(rng.uniform(0, 400)))
    kind = KINDS[int(rng.choice(4, p=(0.45, 0.15, 0.2, 0.2)))]
    if kind.startswith("slow_group"):
        shape["slow_group"] = (spanning_group(rng, ranks, pp), float(rng.uniform(*factors)))
    if kind == "worker_fault":
        shape["slow_rank"] = (int(rng.integers(ranks)), float(rng.uniform(1.2, 2.5)))
    elif kind == "slow_group+worker_fault":
        # a slow rank beside the group, slowed unlike it (×1.2-1.35 or ×1.3-1.5 its factor):
        # a fault of its own, not a member
        group, factor = shape["slow_group"]
        rest = [r for r in range(ranks) if r not in group]
        fault = factor * float(rng.uniform(1.3, 1.5)) if factor < 2 else float(
            rng.uniform(1.2, 1.35))
        shape["slow_rank"] = (int(rng.choice(rest)), fault)
    return f"{grid} × pp{pp}", GpuJob(**shape)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=120)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--show", type=int, default=15, help="misses to print")
    ap.add_argument("--factors", default="1.5,3.0", help="the slow group's factor is drawn "
                    "between these two")
    ap.add_argument("--name", default=None, help="write the result as this name (a path: "
                    "there, e.g. /tmp/x) instead of results/diagnosis_slow_group_stages*.json")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    lo, hi = (float(f) for f in args.factors.split(","))
    factors = (lo, hi)
    exact, total, slack = collections.Counter(), collections.Counter(), collections.Counter()
    by_grid, grid_total = collections.Counter(), collections.Counter()
    healthy = split = 0
    beside = collections.Counter()
    misses = []
    root = Path(tempfile.mkdtemp(prefix="sg-stages-"))
    try:
        for i in range(args.jobs):
            grid, job = draw(rng, args.seed * 100_000 + i, factors)
            kind = "+".join(sorted(c["cause"] for c in job.truth["causes"]))
            folder = root / f"job{i}"
            write_gpu_job(job, folder)
            trace = load_trace(folder)
            result = analyze(trace)
            got, want = named(result), injected(job) or {("none", -1)}
            effect = impact(job, root / f"twin{i}", trace) if kind != "none" else None
            shutil.rmtree(root / f"twin{i}", ignore_errors=True)
            shutil.rmtree(folder)
            if effect is not None and effect < 1.03:
                slack[kind] += 1
                continue
            wrong = {r for _, r in got if r >= 0} - {r for _, r in want if r >= 0}
            healthy += bool(wrong)
            group = {r for c, r in want if c == "slow_group"}
            split += bool(group) and len({c for c, r in got if r in group}) > 1
            if kind == "slow_group+worker_fault":
                # re-splitting a stage's work in proportion to speed fixes a slow rank of the
                # group's stage too, leaving its own fix nothing to gain: there it may go
                # unnamed; named a member of the group (slowed unlike it) it is wrong
                fault = next(r for c, r in want if c == "worker_fault")
                per = job.ranks // job.pp_size
                covered = any(r // per == fault // per for r in group)
                whole = {r for c, r in got if c == "slow_group"} >= group and not wrong and not {
                    r for c, r in got if r in group and c != "slow_group"}
                beside["whole"] += whole
                beside["fault"] += ("worker_fault", fault) in got
                beside["jobs"] += 1
                ok = whole and {r for c, r in got if c == "slow_group"} == group and (
                    ("worker_fault", fault) in got
                    or (covered and fault not in {r for _, r in got}))
            else:
                ok = got == want or (effect is not None and effect < 1.05
                                     and got == {("none", -1)})
            total[kind] += 1
            exact[kind] += ok
            grid_total[grid] += 1
            by_grid[grid] += ok
            if not ok and len(misses) < args.show:
                misses.append((i, grid, job.microbatches, sorted(want), sorted(got),
                               None if effect is None else round(effect, 3)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    n = sum(total.values())
    right = sum(exact.values())
    print(f"{args.jobs} jobs, seed {args.seed}, {sum(slack.values())} slack; exact {right}/{n}; "
          f"jobs naming a healthy rank {healthy}; slow groups split over two causes {split}")
    for kind in KINDS:
        if total[kind]:
            print(f"  {kind:13s} {exact[kind]:4d}/{total[kind]:<4d} slack {slack[kind]}")
    print(f"  a group beside a slow rank unlike it (as graded before): group named whole "
          f"{beside['whole']}/"
          f"{beside['jobs']}, the rank named worker_fault {beside['fault']}/{beside['jobs']} "
          f"(slack {slack['slow_group+worker_fault']})")
    for grid in sorted(grid_total):
        print(f"  {grid:18s} {by_grid[grid]:4d}/{grid_total[grid]}")
    for i, grid, mb, want, got, eff in misses:
        print(f"  job {i} ({grid}, {mb} mb): injected {want}, named {got} (impact {eff})")
    command = ".venv/bin/python benchmarks/diagnosis_slow_group_stages.py"
    if (args.jobs, args.seed) != (120, 1):
        command += f" --jobs {args.jobs} --seed {args.seed}"
    if factors != (1.5, 3.0):
        command += f" --factors {args.factors}"
    write(Run(benchmark=f"Slow groups spanning pipeline stages (synthetic GPU jobs), seed "
                        f"{args.seed}, groups ×{lo:g}-{hi:g}", issue="30", command=command,
              figures=[Figure(name=f"exact diagnoses, {args.jobs} jobs (seed {args.seed})",
                              value=f"{right} of {n} graded", note=f"{sum(slack.values())} "
                              "slack injections (impact < ×1.03) not graded"),
                       Figure(name="jobs naming a healthy rank", value=str(healthy), goal="0",
                              met=healthy == 0),
                       Figure(name="slow groups named under two causes", value=str(split),
                              goal="0", met=split == 0),
                       Figure(name="a group beside a slow rank unlike it: the group named whole, "
                                   "nothing healthy",
                              value=f"{beside['whole']} of {beside['jobs']}",
                              note=f"the rank named worker_fault in {beside['fault']}")],
              table=[{"case": kind, "exact / graded": f"{exact[kind]}/{total[kind]}",
                      "slack": str(slack[kind])} for kind in KINDS if total[kind]]
              + [{"case": grid, "exact / graded": f"{by_grid[grid]}/{grid_total[grid]}",
                  "slack": ""} for grid in sorted(grid_total)]),
          name=args.name or f"diagnosis_slow_group_stages_seed{args.seed}")


if __name__ == "__main__":
    main()
