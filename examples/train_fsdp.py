"""Data-parallel training recorded with one call: FSDP2 (`fully_shard`) or DDP, a slow rank by flag.

    python -m torch.distributed.run --nproc-per-node 2 examples/train_fsdp.py \
        --steps 12 --out runs/fsdp --slow-rank 1 --slow-factor 4
    stragglers analyze runs/fsdp

The loop is a plain PyTorch loop; `stragglers.record.attach(model, opt, out)` is the only line
the recording needs (it records forward/backward per microbatch, FSDP2's per-block all-gathers
and reduce-scatters or DDP's bucket all-reduces, the optimizer step and GC pauses). Every
injection is off by default and, when on, written to meta.json as ground truth.

Read top to bottom: arguments → model → injected slowness → main.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from stragglers.record import attach

from injection import SlowDown  # examples/injection.py (the script's folder is on sys.path)
from launch import exit_without_finalizing, main_once, refuse_earlier_run, require_torchrun


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wrap", choices=["fsdp2", "ddp"], default="fsdp2")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--microbatches", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--batch", type=int, default=64, help="rows per microbatch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/train_fsdp"), help="the run directory")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out")
    p.add_argument("--no-record", action="store_true", help="run without attach")
    p.add_argument("--params-out", type=Path, default=None,
                   help="save the trained parameters here (rank 0), to compare runs")
    p.add_argument("--slow-rank", type=int, default=-1, help="this rank computes --slow-factor× "
                   "as long (forward and backward)")
    p.add_argument("--slow-factor", type=float, default=1.0)
    return p.parse_args(argv)


# ---- model ----------------------------------------------------------------------------------

class Block(nn.Module):
    """A residual MLP block: one FSDP2 unit (one all-gather, one reduce-scatter)."""

    def __init__(self, d: int):
        super().__init__()
        self.norm, self.fc, self.proj = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(F.gelu(self.fc(self.norm(x))))


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        torch.manual_seed(args.seed)
        self.slow = SlowDown()
        self.blocks = nn.ModuleList(Block(args.d_model) for _ in range(args.layers))
        self.head = nn.Linear(args.d_model, args.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.slow(self.head(x))  # last in forward, first in backward: both slowed


def batch(args, step: int, rank: int, mb: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic regression batch per (step, rank, microbatch)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank * 31 + mb)
    x = torch.randn(args.batch, args.d_model, generator=g)
    return x, torch.tanh(x.flip(-1))


# ---- injected slowness ----------------------------------------------------------------------

def calibrate_slowdown(model: Model, args, factor: float) -> None:
    """Time this rank's own forward and backward, then make both `factor`× as long."""
    x, y = batch(args, -1, 0, 0)
    ref = Model(args)  # an unwrapped replica: timing it runs no collectives
    fwd, bwd = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        loss = F.mse_loss(ref(x), y)
        t1 = time.perf_counter()
        loss.backward()
        fwd.append(t1 - t0)
        bwd.append(time.perf_counter() - t1)
    model.slow.fwd_s = (factor - 1) * min(fwd)
    model.slow.bwd_s = (factor - 1) * min(bwd)


# ---- main -----------------------------------------------------------------------------------

def main(argv=None) -> None:
    args = parse_args(argv)
    require_torchrun()
    if not args.no_record:
        refuse_earlier_run(args.out, args.overwrite, "--out")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Model(args)
    if rank == args.slow_rank and args.slow_factor > 1:
        calibrate_slowdown(model, args, args.slow_factor)
    if args.wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    else:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    injections = ([{"cause": "worker_fault", "rank": args.slow_rank, "dp_rank": args.slow_rank,
                    "stage": 0, "factor": args.slow_factor}]
                  if 0 <= args.slow_rank < world and args.slow_factor > 1 else [])

    # The one line that records the job (a collective: every rank calls it).
    with attach(model, opt, args.out, overwrite=args.overwrite, enabled=not args.no_record,
                extra={"injections": injections, "microbatches": args.microbatches}):
        for step in range(args.steps):
            for mb in range(args.microbatches):
                x, y = batch(args, step, rank, mb)
                loss = F.mse_loss(model(x), y) / args.microbatches
                loss.backward()
            opt.step()
            opt.zero_grad()
            if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
                print(f"step {step:3d} loss {loss.item() * args.microbatches:.4f}", flush=True)
    save_params(model, args.params_out, rank)
    # Shutdown order: the recorder is closed (the `with` above), then the model goes (DDP and
    # FSDP2 hold the process group; their hooks form cycles, hence the collect), then the group.
    del model, opt, loss  # the last loss holds the autograd graph, hooks and all
    gc.collect()
    dist.destroy_process_group()


def save_params(model: nn.Module, path: Path | None, rank: int) -> None:
    """Full (unsharded) parameters to `path` on rank 0 (a collective under FSDP2)."""
    if path is None:
        return
    full = {}
    for name, p in model.named_parameters():
        t = p.detach()
        full[name.removeprefix("module.")] = t.full_tensor() if hasattr(t, "full_tensor") else t
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(full, path)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    exit_without_finalizing(main_once(main))  # see examples/launch.py: a rare gloo abort at shutdown
