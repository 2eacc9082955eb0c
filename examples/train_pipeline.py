"""Pipeline-parallel training with torch.distributed.pipelining, recorded with one call.

    python -m torch.distributed.run --nproc-per-node 2 examples/train_pipeline.py \
        --schedule 1F1B --steps 10 --d-model 256 --batch 64 --out runs/pipe \
        --heavy-stage 1 --heavy-factor 3
    stragglers analyze runs/pipe

(At the default --d-model 128 --batch 32 a step is a few ms of compute: on a busy CPU the
other processes' noise hides the heavy stage in most runs; at 256 / 64 it is named in 7 of 8.)

Each rank builds its stage(s) of an MLP (one stage per rank; two per rank for the interleaved,
looped and V-shaped schedules), the schedule chosen by --schedule runs them, and
`stragglers.record.attach(schedule, opt, out)` records every action: forward, backward (B, or
I and W where the schedule splits it) per microbatch and stage, with its sends and receives.
Injections (off by default, written to meta.json as ground truth): a heavy stage does
--heavy-factor× the compute; a slow rank computes --slow-factor× as long on all its stages.

Read top to bottom: arguments → model → injected slowness → stages → main.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, schedules

from stragglers.record import attach

from injection import SlowDown  # examples/injection.py (the script's folder is on sys.path)
from launch import main_once, refuse_earlier_run, require_torchrun  # examples/launch.py

SCHEDULES = {"GPipe": schedules.ScheduleGPipe, "1F1B": schedules.Schedule1F1B,
             "Interleaved1F1B": schedules.ScheduleInterleaved1F1B,
             "LoopedBFS": schedules.ScheduleLoopedBFS,
             "InterleavedZeroBubble": schedules.ScheduleInterleavedZeroBubble,
             "ZBVZeroBubble": schedules.ScheduleZBVZeroBubble,
             "DualPipeV": schedules.ScheduleDualPipeV}
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")   # rank r holds stages r and 2·pp−1−r
SINGLE = ("GPipe", "1F1B")                  # one stage per rank


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", choices=list(SCHEDULES), default="1F1B")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--batch", type=int, default=32, help="rows per microbatch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/train_pipeline"), help="the run directory")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out")
    p.add_argument("--no-record", action="store_true", help="run without attach")
    p.add_argument("--heavy-stage", type=int, default=-1, help="this global stage index does "
                   "--heavy-factor× the compute")
    p.add_argument("--heavy-factor", type=float, default=1.0)
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank computes --slow-factor× "
                   "as long on all its stages")
    p.add_argument("--slow-factor", type=float, default=1.0)
    return p.parse_args(argv)


# ---- model ----------------------------------------------------------------------------------

class StageModule(nn.Module):
    """One pipeline stage: two residual MLP blocks, then the extra compute of an injection."""

    def __init__(self, d: int, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.fc3, self.fc4 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.slow = SlowDown()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(F.gelu(self.fc1(x)))
        x = x + self.fc4(F.gelu(self.fc3(x)))
        return self.slow(x)


def batch(args, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic regression batch per step (all microbatches of it)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    x = torch.randn(args.batch * args.microbatches, args.d_model, generator=g)
    return x, torch.tanh(x.flip(-1))


# ---- injected slowness ----------------------------------------------------------------------

def calibrate(module: StageModule, args, factor: float) -> None:
    """Time the stage's own forward and backward on one microbatch; make both `factor`× as long."""
    x = torch.randn(args.batch, args.d_model, requires_grad=True)
    fwd, bwd = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        y = module(x)
        t1 = time.perf_counter()
        y.sum().backward()
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    module.slow.fwd_s = (factor - 1) * min(fwd)
    module.slow.bwd_s = (factor - 1) * min(bwd)


# ---- stages ---------------------------------------------------------------------------------

def stage_indices(schedule: str, rank: int, pp: int) -> list[int]:
    """The global stage indices this rank holds under the schedule's placement."""
    if schedule in SINGLE:
        return [rank]
    if schedule in V_SHAPED:
        return [rank, 2 * pp - 1 - rank]
    return [rank, rank + pp]  # interleaved / looped: round robin


def build_stages(args, rank: int, pp: int) -> tuple[list[PipelineStage], list[StageModule]]:
    """This rank's stages, with the injected slowness calibrated on each module."""
    indices = stage_indices(args.schedule, rank, pp)
    n_stages = pp * len(indices)
    modules, stages = [], []
    for i in indices:
        m = StageModule(args.d_model, args.seed * 97 + i)
        factor = 1.0
        if i == args.heavy_stage:
            factor *= args.heavy_factor
        if rank == args.slow_rank:
            factor *= args.slow_factor
        if factor > 1:
            calibrate(m, args, factor)
        modules.append(m)
        stages.append(PipelineStage(m, i, n_stages, torch.device("cpu")))
    return stages, modules


def injections(args, pp: int) -> list[dict]:
    """The ground truth written to meta.json."""
    out = []
    if args.heavy_factor > 1 and args.heavy_stage >= 0:
        out.append({"cause": "stage_imbalance", "global_stage": args.heavy_stage,
                    "factor": args.heavy_factor})
    if args.slow_factor > 1 and 0 <= args.slow_rank < pp:
        out.append({"cause": "worker_fault", "rank": args.slow_rank, "dp_rank": 0,
                    "stage": args.slow_rank, "factor": args.slow_factor})
    return out


# ---- main -----------------------------------------------------------------------------------

def main(argv=None) -> None:
    args = parse_args(argv)
    require_torchrun()
    if not args.no_record:
        refuse_earlier_run(args.out, args.overwrite, "--out")
    dist.init_process_group("gloo")
    train(args)
    dist.destroy_process_group()


def train(args: argparse.Namespace) -> None:
    """Build this rank's stages and schedule, train args.steps steps, record them."""
    rank, pp = dist.get_rank(), dist.get_world_size()
    stages, modules = build_stages(args, rank, pp)

    def loss_fn(output, target):
        return F.mse_loss(output, target)

    cls = SCHEDULES[args.schedule]
    schedule = (cls(stages[0], args.microbatches, loss_fn=loss_fn) if args.schedule in SINGLE
                else cls(stages, args.microbatches, loss_fn=loss_fn))
    opt = torch.optim.AdamW([p for m in modules for p in m.parameters()], lr=args.lr)

    # The one line that records the job (a collective: every rank calls it).
    with attach(schedule, opt, args.out, overwrite=args.overwrite, enabled=not args.no_record,
                extra={"injections": injections(args, pp)}):
        for step in range(args.steps):
            x, y = batch(args, step)
            inputs = (x,) if any(s.is_first for s in stages) else ()
            target = y if any(s.is_last for s in stages) else None
            losses: list = []
            schedule.step(*inputs, target=target, losses=losses)
            opt.step()
            opt.zero_grad()
            if losses and (step % 5 == 0 or step == args.steps - 1):
                print(f"step {step:3d} loss {torch.stack(losses).mean().item():.4f}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main_once(main))
