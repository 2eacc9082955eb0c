"""What `stragglers.record.attach` costs: per recorded op, and on a ≥100 ms training step.

    .venv/bin/python benchmarks/record_attach_overhead.py [--steps 40] [--rounds 5]

Both measurements run in one process, on a DDP model (a one-rank gloo group, so the comm hook
path runs), recorded and unrecorded side by side under the same machine load:
1. Per recorded op: a tiny model (the hooks dominate), blocks of steps without attach and with
   attach alternating (`rounds` of each); (median recorded − median bare) / ops per step.
2. On a big step: a model whose step takes ≥ 100 ms; attach with sample_every=2 records the
   even steps only, so each recorded step has an unrecorded neighbour; the overhead is the
   median t(even)/t(odd) over neighbour pairs, divided by the same ratio of a control run
   without attach (what the schedule alone gives).
Goals (issue 15): ≤ 2 µs per recorded op, ≤ 1% of a ≥ 100 ms step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn as nn  # noqa: E402

from stragglers.record import attach  # noqa: E402


def ddp(d_in: int, d_hidden: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(d_in, d_hidden), nn.GELU(), nn.Linear(d_hidden, d_in))
    wrapped = nn.parallel.DistributedDataParallel(model)
    return wrapped, torch.optim.SGD(wrapped.parameters(), lr=1e-4)


def run_steps(model, opt, x, steps: int, microbatches: int) -> list[float]:
    """Plain training steps; returns each step's wall time."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(microbatches):
            model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return times


def per_op_cost(rounds: int, steps: int = 200, microbatches: int = 4) -> tuple[float, float, int]:
    """(bare s/step, recorded s/step, ops per step) on a tiny model, blocks alternating."""
    model, opt = ddp(8, 8)
    x = torch.randn(4, 8)
    ops = 2 * microbatches + 1 + 1  # fwd+bwd per microbatch, optimizer, one bucket all-reduce
    bare, recorded = [], []
    run_steps(model, opt, x, 20, microbatches)
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(rounds):
            bare.append(statistics.median(run_steps(model, opt, x, steps, microbatches)))
            # a fresh replica and recorder per block (DDP takes one comm hook per wrapper)
            rmodel, ropt = ddp(8, 8)
            with attach(rmodel, ropt, Path(tmp) / f"r{k}", flush_interval_s=1.0):
                run_steps(rmodel, ropt, x, 2, microbatches)  # DDP skips step 0 anyway
                recorded.append(statistics.median(run_steps(rmodel, ropt, x, steps,
                                                            microbatches)))
    return statistics.median(bare), statistics.median(recorded), ops


def big_step_overhead(steps: int) -> tuple[float, float, float]:
    """(recorded even/odd ratio, control even/odd ratio, median step s) on a ≥100 ms step."""
    model, opt = ddp(1024, 4096)
    x = torch.randn(256, 1024)
    microbatches = 2
    run_steps(model, opt, x, 2, microbatches)
    ratios = {}
    with tempfile.TemporaryDirectory() as tmp:
        for recorded in (True, False):
            if recorded:
                with attach(model, opt, Path(tmp) / "big", sample_every=2):
                    run_steps(model, opt, x, 1, microbatches)  # step 0 (DDP: not recorded)
                    t = run_steps(model, opt, x, steps, microbatches)  # steps 1.. : even recorded
                t = t[1:]  # start at step 2 (even)
            else:
                t = run_steps(model, opt, x, steps, microbatches)
            pairs = [t[i] / t[i + 1] for i in range(0, len(t) - 1, 2)]
            ratios[recorded] = statistics.median(pairs)
            step = statistics.median(t)
    return ratios[True], ratios[False], step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29000 + os.getpid() % 1000))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        bare, rec, ops = per_op_cost(args.rounds)
        per_op = (rec - bare) / ops
        print(f"per recorded op: bare {bare * 1e6:.1f} µs/step, recorded {rec * 1e6:.1f} µs/step, "
              f"{ops} ops/step -> {per_op * 1e6:.2f} µs per op (goal <= 2 µs: "
              f"{'met' if per_op <= 2e-6 else 'MISSED'})", flush=True)
        even, control, step = big_step_overhead(args.steps)
        overhead = even / control - 1
        print(f"big step ({step * 1e3:.0f} ms): median t(even)/t(odd) recorded {even:.4f}, "
              f"control {control:.4f} -> overhead {100 * overhead:+.2f}% (goal <= 1%: "
              f"{'met' if overhead <= 0.01 else 'MISSED'}; control noise "
              f"{100 * abs(control - 1):.2f}%)", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
