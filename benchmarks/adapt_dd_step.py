"""AntDT-DD step: DDP with no_sync() accumulation vs one flattened fp64 all-reduce, side by side.

    .venv/bin/python benchmarks/adapt_dd_step.py [--nproc 2] [--hidden 1024] [--steps 20]

Both run in the same torchrun job on the same model, batches and micro-batch split (k = 4
micro-batches per rank): the baseline is the previous implementation (every gradient copied
into one fp64 buffer with the count and loss appended, one blocking all_reduce after the
backward); `DataParallelStep` reduces fp32 buckets that overlap the last backward. Reported:
seconds per step (median), bytes reduced per step, and whether both give the same update.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from results import Figure, Run, write


def flattened_fp64_step(model, sum_loss, x, y, micro, optimizer):
    """The baseline: local accumulation, then all gradients in one fp64 buffer, one all_reduce."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    loss_sum, offset = 0.0, 0
    for m in micro:
        loss = sum_loss(model(x[offset:offset + m]), y[offset:offset + m])
        loss.backward()
        loss_sum += float(loss.detach())
        offset += m
    tail = torch.tensor([float(offset), loss_sum], dtype=torch.float64)
    flat = torch.cat([p.grad.reshape(-1).to(torch.float64) for p in params] + [tail])
    dist.all_reduce(flat)
    total = flat[-2].item()
    pos = 0
    for p in params:
        n = p.numel()
        p.grad.copy_((flat[pos:pos + n] / total).view_as(p).to(p.dtype))
        pos += n
    optimizer.step()
    return flat.numel() * 8


def worker(args) -> None:
    from stragglers.adapt.step import DataParallelStep

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.hidden)
    y = torch.randint(0, 10, (args.batch,))

    def make():
        torch.manual_seed(1)
        return torch.nn.Sequential(torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                   torch.nn.Linear(args.hidden, 10))

    sum_loss = torch.nn.CrossEntropyLoss(reduction="sum")
    micro = [args.batch // 4] * 4
    base, lean = make(), make()
    opt_base = torch.optim.SGD(base.parameters(), lr=0.01)
    opt_lean = torch.optim.SGD(lean.parameters(), lr=0.01)
    dd = DataParallelStep(lean)
    times = {"flattened_fp64": [], "ddp_no_sync": []}
    base_bytes = 0
    for step in range(args.steps):
        # Alternate, so load on the machine hits both alike.
        dist.barrier()
        t0 = time.perf_counter()
        base_bytes = flattened_fp64_step(base, sum_loss, x, y, micro, opt_base)
        times["flattened_fp64"].append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        res = dd.step(sum_loss, x, y, micro, opt_lean)
        times["ddp_no_sync"].append(time.perf_counter() - t0)
        assert res.collectives >= 1
    diff = max((a - b).abs().max().item() for a, b in zip(base.parameters(), lean.parameters()))
    lean_bytes = (sum(p.numel() for p in lean.parameters()) + 2) * 4
    if rank == 0:
        skip = min(3, args.steps - 1)
        med = {k: statistics.median(v[skip:]) for k, v in times.items()}
        record(args, dist.get_world_size(), med, base_bytes, lean_bytes, diff)
        print(json.dumps({
            "world_size": dist.get_world_size(), "parameters": sum(p.numel() for p in lean.parameters()),
            "seconds_per_step": {k: round(v, 4) for k, v in med.items()},
            "ddp_speedup": round(med["flattened_fp64"] / med["ddp_no_sync"], 3),
            "bytes_reduced_per_step": {"flattened_fp64": base_bytes, "ddp_no_sync": lean_bytes},
            "max_param_diff_after_all_steps": diff,
        }, indent=1))
    dist.destroy_process_group()


def record(args, world: int, med: dict[str, float], base_bytes: int, lean_bytes: int,
           diff: float) -> None:
    """The figures, for BENCHMARKS.md (benchmarks/results/adapt_dd_step.json)."""
    speedup = med["flattened_fp64"] / med["ddp_no_sync"]
    command = (f".venv/bin/python benchmarks/adapt_dd_step.py --nproc {world} --hidden"
               f" {args.hidden} --batch {args.batch} --steps {args.steps}")
    write(Run(benchmark=f"AntDT-DD step: DDP no_sync() vs one flattened fp64 all-reduce"
                        f" ({world} gloo ranks, CPU)", issue="6, 12", command=command,
              figures=[
                  Figure(name="s/step, DDP no_sync() + one weighted bucketed reduction",
                         value=f"{med['ddp_no_sync']:.3f} s",
                         anchor=f"flattened fp64 all-reduce: {med['flattened_fp64']:.3f} s"),
                  Figure(name="speedup over the flattened fp64 step", value=f"{speedup:.2f}x",
                         goal="> 1", met=speedup > 1.0, anchor="same run, same batches"),
                  Figure(name="bytes reduced per step", value=f"{lean_bytes / 1e6:.1f} MB",
                         anchor=f"flattened fp64: {base_bytes / 1e6:.1f} MB"),
                  Figure(name="max parameter difference after all steps", value=f"{diff:.3g}",
                         goal="<= 1e-6 (the same update)", met=diff <= 1e-6),
              ]), name="adapt_dd_step")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", str(Path(__file__).resolve()), "--worker",
           "--hidden", str(args.hidden), "--batch", str(args.batch), "--steps", str(args.steps)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
