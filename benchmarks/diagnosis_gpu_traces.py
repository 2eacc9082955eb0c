"""Synthetic GPU jobs as Kineto JSON, read and diagnosed: exactly the injected causes, at the
injected ranks, and no healthy rank named.

Each job draws a shape (4-8 ranks, 4-8 profiled steps, 0-2 all-to-alls per forward in one or
two expert-parallel groups (their own process groups) with the rows each rank receives drawn
from balanced routing, tensor parallelism of 2 on half the jobs with an even rank count (a
blocking all-reduce in each TP pair after every forward piece, DDP in the data-parallel
groups), context parallelism of 2 or 4 on 30% of the jobs whose ranks allow it (after every
forward piece, and at the backward's start for a ring, the CP group exchanges K/V: one
all-gather, ring attention's send/recv in cp - 1 rounds, or torch's all-to-all rotation; a
third each), two pipeline stages on 30% of the jobs without a slow link whose ranks leave
two or more per stage and tensor-context block (with a slow group, one that holds no whole
stage: that reads as a heavy stage) (GPipe with 2-4
microbatches, each stage with its own groups, one clock), 2-6 DDP buckets of unequal sizes, kernel noise 1-3%, host clocks up to 500 µs
apart, every host starting each step up to 0-400 µs late at random) and one of: no cause
(noise only), a late host (one rank starts every step 1.5-4 ms late: `host_stall`), a slow
GPU (one rank computes ×1.2-2.5: `worker_fault`), a slow group (2 to half the ranks compute
×1.5-3: `slow_group`), a hot expert (jobs with all-to-alls: one rank is 2-4× as likely a
destination of the routing: `expert_imbalance`) or a slow link (6-8 ranks in three or four
expert-parallel groups, one group's all-to-alls transferring ×5-15 as long: `communication`
at that group's ranks). The job is written as one .json.gz per
rank the way Kineto writes it (stragglers.trace.synth.kineto), read back with the Kineto reader and analysed.

A job is exact when the set of (cause, rank) named equals the injected one; noise-only jobs
must say `none`. An injection's impact is the job's mean step time over the same job written
without it (same seed). As in `diagnosis_accuracy.py`, one below the diagnosis's own
materiality gate (×1.03) is slack: counted apart, not graded; and as in
`diagnosis_combinations.py`, one below ×1.05 is weak: naming it or saying `none` are both
right (a gain that small can sit under the gate's interval), naming anything else is not. Reported: exact share (goal ≥ 97.5%), per kind, healthy ranks named, and the
reader's and analysis's time.

    .venv/bin/python benchmarks/diagnosis_gpu_traces.py [--jobs 500] [--seed 1] [--name /tmp/x]
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from results import Figure, Run, write

from stragglers.trace.load import load_trace
from stragglers.trace.synth.kineto import GpuJob, write_gpu_job
from stragglers.whatif import analyze

TEXT = ("Each job: 4–8 ranks, 4–8 steps, all-to-alls, tensor and context parallel groups (CP "
        "by all-gather, ring attention or all-to-all rotation), two pipeline stages on some, DDP "
        "buckets, kernel noise, host clocks apart, one injected cause (or none); exact = the set "
        "of (cause, rank) named equals the injected one, graded against a twin job written "
        "without the injection (below ×1.03 slack, below ×1.05 weak). The generator and the "
        "detector are written by the same hand: the real traces (`benchmarks/real_traces.py`) "
        "are the check it cannot give.")
KINDS = ("none", "host_stall", "worker_fault", "slow_group", "expert_imbalance", "communication")


def draw(rng: np.random.Generator, seed: int) -> GpuJob:
    """One job of random shape and one random cause (or none)."""
    ranks = int(rng.integers(4, 9))
    shape = dict(ranks=ranks, steps=int(rng.integers(4, 9)), seed=seed,
                 all_to_alls=int(rng.integers(0, 3)), buckets=int(rng.integers(2, 7)),
                 jitter=float(rng.uniform(0.01, 0.03)),
                 clock_offset_us=float(rng.uniform(0, 500)),
                 host_jitter_us=float(rng.uniform(0, 400)))
    if shape["all_to_alls"] and ranks >= 4:
        shape["expert_groups"] = int(rng.integers(1, 3))   # all-to-alls in 1 or 2 EP groups
    if ranks % 2 == 0 and rng.random() < 0.5:
        shape["tp_size"] = 2
    if ranks % (2 * shape.get("tp_size", 1)) == 0 and rng.random() < 0.3:
        shape["cp_size"] = 2
        # how CP exchanges K/V (an all-gather, ring attention's send/recv, torch's all-to-all
        # rotation) and a ring of 4 where the ranks allow: drawn from a generator of their
        # own, so every other draw of the suite stays as it was
        cp = np.random.default_rng([seed, 2])
        shape["cp_comm"] = str(cp.choice(["all_gather", "ring", "all_to_all"]))
        if ranks % (4 * shape.get("tp_size", 1)) == 0 and cp.random() < 0.5:
            shape["cp_size"] = 4
    kind = KINDS[int(rng.integers(len(KINDS)))]
    if kind in ("expert_imbalance", "communication") and not shape["all_to_alls"]:
        shape["all_to_alls"] = int(rng.integers(1, 3))      # routing needs a dispatch
    if kind == "communication":
        # a slow link among three or four expert-parallel groups: the healthy groups are the
        # transfers' median (with two, half the transfers are slow and none stands out)
        shape["ranks"] = ranks = max(ranks, 6)
        shape["expert_groups"] = int(rng.integers(3, min(4, ranks // 2) + 1))
        if ranks % shape.get("tp_size", 1) or ranks % (shape.get("tp_size", 1)
                                                      * shape.get("cp_size", 1)):
            shape.pop("tp_size", None)
            shape.pop("cp_size", None)
            shape.pop("cp_comm", None)
    if kind == "host_stall":
        shape["late_rank"] = (int(rng.integers(ranks)), float(rng.uniform(1500, 4000)))
    elif kind == "worker_fault":
        shape["slow_rank"] = (int(rng.integers(ranks)), float(rng.uniform(1.2, 2.5)))
    elif kind == "slow_group":
        size = int(rng.integers(2, ranks // 2 + 1))
        group = tuple(int(r) for r in rng.choice(ranks, size, replace=False))
        shape["slow_group"] = (group, float(rng.uniform(1.5, 3.0)))
    elif kind == "expert_imbalance":
        shape["hot_expert"] = (int(rng.integers(ranks)), float(rng.uniform(2.0, 4.0)))
    elif kind == "communication":
        shape["slow_link"] = (int(rng.integers(ranks)), float(rng.uniform(5.0, 15.0)))
    tp_cp = shape.get("tp_size", 1) * shape.get("cp_size", 1)
    pipe = np.random.default_rng([seed, 3])
    if kind in ("none", "host_stall", "worker_fault", "slow_group", "expert_imbalance") \
            and ranks % (2 * tp_cp) == 0 and ranks // (2 * tp_cp) >= 2 and pipe.random() < 0.3 \
            and not (kind == "slow_group" and _whole_stage(shape["slow_group"][0], ranks)):
        # two pipeline stages (GPipe, 2-4 microbatches), each with its own TP, CP, EP and DP
        # groups, all on one clock (no collective spans the stages for the reader to align
        # clocks on); one expert group per stage (half a stage's ranks would be one or two);
        # a slow group on one stage or over both, but not a whole stage (that is a heavy
        # stage, a stage imbalance, as far as any trace can tell: left at one stage); not with
        # a slow link (its three or four expert groups in a stage of three or four ranks);
        # ring attention too (the reader tells its exchanges from the pipeline's transfers)
        shape.update(pp_size=2, microbatches=int(pipe.integers(2, 5)), expert_groups=1,
                     ranks_per_host=ranks)
    if shape["all_to_alls"] and kind != "communication":
        # Half of the MoE jobs send the expert results back (the combine) and move rows at a
        # cost per row, on one node (one clock: per-row transfers differ between ranks, which
        # the reader's clock alignment across hosts would take for offsets). Drawn from a
        # generator of their own, so every other draw of the suite stays as it was.
        moe = np.random.default_rng([seed, 1])
        if moe.random() < 0.5:
            shape.update(combine=True, a2a_us_per_row=float(moe.uniform(0.05, 0.3)),
                         ranks_per_host=shape["ranks"])
    return GpuJob(**shape)


def _whole_stage(group: tuple[int, ...], ranks: int) -> bool:
    """Whether the group holds every rank of one of two pipeline stages (ranks 0..ranks/2-1
    are stage 0)."""
    per = ranks // 2
    return any(set(range(s * per, (s + 1) * per)) <= set(group) for s in (0, 1))


def mean_step(trace) -> float:
    """Mean over steps of the last op's end less the first op's start (seconds)."""
    ops = trace.ops
    end = ops["start_ts"] + ops["duration"]
    return float(np.mean([end[ops["step"] == s].max() - ops["start_ts"][ops["step"] == s].min()
                          for s in np.unique(ops["step"])]))


def impact(job: GpuJob, folder: Path, trace) -> float:
    """The injection's slowdown: the job's mean step over the same job written without it."""
    twin = dataclasses.replace(job, late_rank=None, slow_rank=None, slow_group=None,
                               hot_expert=None, slow_link=None)
    write_gpu_job(twin, folder)
    return mean_step(trace) / mean_step(load_trace(folder))


def named(result) -> set[tuple[str, int]]:
    """(cause, rank) of every finding; `none` as ('none', -1)."""
    out = set()
    for f in result.diagnosis:
        workers = f.where.workers or []
        if not workers:
            out.add((f.cause, -1))
        out |= {(f.cause, int(w.rank)) for w in workers}
    return out


def injected(job: GpuJob) -> set[tuple[str, int]]:
    return {(c["cause"], r) for c in job.truth["causes"] for r in (c["ranks"] or [-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=500)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--show", type=int, default=10, help="misses to print")
    ap.add_argument("--name", default=None, help="write the result as this name (a path: "
                    "there, e.g. /tmp/x) instead of results/diagnosis_gpu_traces*.json")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    exact = collections.Counter()
    total = collections.Counter()
    slack = collections.Counter()
    weak = collections.Counter()
    healthy_named = 0
    combine = collections.Counter()     # graded jobs with the combine and per-row transfers
    misses = []
    t_write = t_read = t_analyse = 0.0
    root = Path(tempfile.mkdtemp(prefix="gpu-jobs-"))
    try:
        for i in range(args.jobs):
            job = draw(rng, args.seed * 100_000 + i)
            kind = job.truth["causes"][0]["cause"]
            folder = root / f"job{i}"
            t0 = time.perf_counter()
            write_gpu_job(job, folder)
            t1 = time.perf_counter()
            trace = load_trace(folder)
            t2 = time.perf_counter()
            result = analyze(trace)
            t3 = time.perf_counter()
            t_write, t_read, t_analyse = t_write + t1 - t0, t_read + t2 - t1, t_analyse + t3 - t2
            got, want = named(result), injected(job)
            effect = impact(job, root / f"twin{i}", trace) if kind != "none" else None
            shutil.rmtree(root / f"twin{i}", ignore_errors=True)
            if effect is not None and effect < 1.03:
                slack[kind] += 1
                shutil.rmtree(folder)
                continue
            weak_ok = effect is not None and effect < 1.05 and got == {("none", -1)}
            weak[kind] += bool(weak_ok)
            total[kind] += 1
            combine[kind] += job.combine
            if got == want or weak_ok:
                exact[kind] += 1
                combine["right"] += job.combine
            elif len(misses) < args.show:
                misses.append((i, sorted(want), sorted(got), round(result.slowdown, 3)))
            bad = {r for c, r in want if r >= 0}
            healthy_named += bool({r for _, r in got if r >= 0} - bad)
            shutil.rmtree(folder)
            if (i + 1) % 50 == 0:
                graded = max(1, sum(total.values()))
                print(f"  {i + 1}/{args.jobs} jobs, exact so far "
                      f"{sum(exact.values()) / graded:.1%}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    n = sum(total.values())
    print(f"\n{args.jobs} jobs drawn, {sum(slack.values())} slack; {n} graded, seed "
          f"{args.seed}: exact {sum(exact.values())}/{n} "
          f"({sum(exact.values()) / n:.1%}; goal ≥ 97.5%), jobs naming a healthy rank "
          f"{healthy_named} ({healthy_named / n:.1%})")
    for kind in KINDS:
        if total[kind]:
            print(f"  {kind:13s} {exact[kind]:4d}/{total[kind]:<4d} ({exact[kind] / total[kind]:.1%})"
                  + (f", weak (×1.03-1.05) left unnamed {weak[kind]}" if weak[kind] else "")
                  + (f", slack (impact < ×1.03, not graded) {slack[kind]}" if slack[kind] else ""))
    print(f"time per job: write {1e3 * t_write / n:.0f} ms, read {1e3 * t_read / n:.0f} ms, "
          f"analyse {1e3 * t_analyse / n:.0f} ms")
    moved = sum(combine[k] for k in KINDS)
    print(f"MoE jobs with the combine and a transfer per row moved: {combine['right']} of "
          f"{moved} right ({combine['expert_imbalance']} of them expert_imbalance)")
    for i, want, got, s in misses:
        print(f"  job {i}: injected {want}, named {got} (S {s})")
    right = sum(exact.values())
    command = ".venv/bin/python benchmarks/diagnosis_gpu_traces.py"
    if (args.jobs, args.seed) != (500, 1):
        command += f" --jobs {args.jobs} --seed {args.seed}"
    write(Run(benchmark=f"Synthetic GPU jobs as Kineto JSON, graded against their injections, "
                        f"seed {args.seed}",
              issue="29", command=command,
              figures=[Figure(name=f"exact diagnoses, {args.jobs} jobs (seed {args.seed})",
                              value=f"{right} of {n} graded ({right / n:.1%})", goal="≥ 97.5%",
                              met=right / n >= 0.975,
                              note=f"{sum(slack.values())} slack injections (impact < ×1.03) "
                                   "not graded"),
                       Figure(name="jobs naming a healthy rank", value=str(healthy_named),
                              goal="0", met=healthy_named == 0),
                       Figure(name="of them, MoE jobs with the combine and a transfer cost per row "
                                   "moved",
                              value=f"{combine['right']} of {moved} right "
                                    f"({combine['expert_imbalance']} expert_imbalance)")],
              table=[{"cause": kind, "exact / graded": f"{exact[kind]}/{total[kind]}",
                      "weak left unnamed": str(weak[kind]), "slack": str(slack[kind])}
                     for kind in KINDS if total[kind] or slack[kind]]
              + [{"cause": "time per job", "exact / graded":
                  f"write {1e3 * t_write / n:.0f} ms, read {1e3 * t_read / n:.0f} ms, "
                  f"analyse {1e3 * t_analyse / n:.0f} ms", "weak left unnamed": "", "slack": ""}],
              text=[TEXT]),
          name=args.name or ("diagnosis_gpu_traces" if (args.jobs, args.seed) == (1000, 2)
                             else f"diagnosis_gpu_traces_seed{args.seed}"))


if __name__ == "__main__":
    main()
