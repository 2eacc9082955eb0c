"""FSDP2 + tensor parallelism (+ pipelining) on a DeviceMesh (torchtitan's shape), recorded.

    python -m torch.distributed.run --nproc-per-node 4 examples/train_tp.py --tp 2 \
        --steps 8 --out runs/tp --slow-rank 3 --slow-ms 20
    python -m torch.distributed.run --nproc-per-node 4 examples/train_tp.py --tp 2 --pp 2 \
        --microbatches 4 --steps 8 --out runs/tp3d --slow-rank 3 --slow-ms 20
    stragglers analyze runs/tp

A small transformer, parallelised as torchtitan does it: attention's q/k/v and the MLP's first
layers column-wise, their output layers row-wise (one all-reduce each in forward, and one per
column-wise layer's input in backward), the embedding row-wise, the output layer column-wise
gathered; then `fully_shard` per block over the dp dimension. With `--pp` the model is first
split into pipeline stages (torchtitan's manual split: the first stage keeps the embedding, the
last the norm and output) on a (pp, dp, tp) mesh, each stage parallelised as above and run by a
`torch.distributed.pipelining` 1F1B schedule. `stragglers.record.attach` is the only line the
recording needs (given the model, or with --pp the schedule): it records forward/backward per microbatch cut at every
tensor-parallel collective (all-reduce, all-gather rows with their process group), FSDP2's
all-gathers and reduce-scatters, the optimizer step and GC pauses. The injection is off by
default and, when on, written to meta.json as ground truth.

Read top to bottom: arguments → model → parallelisation → injected slowness → main.
"""

from __future__ import annotations

import argparse
import gc
import os
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
    p.add_argument("--tp", type=int, default=2, help="tensor-parallel degree (divides the world)")
    p.add_argument("--pp", type=int, default=1, help="pipeline stages (divides the world and "
                   "--layers)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=1, help="gradient accumulation steps "
                   "(with --pp: the schedule's microbatches, at least --pp)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=4, help="sequences per microbatch")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/train_tp"), help="the run directory")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out")
    p.add_argument("--no-record", action="store_true", help="run without attach")
    p.add_argument("--params-out", type=Path, default=None,
                   help="save the trained parameters here (rank 0), to compare runs")
    p.add_argument("--slow-rank", type=int, default=-1,
                   help="this rank computes --slow-ms longer in every block's forward and backward")
    p.add_argument("--slow-ms", type=float, default=0.0)
    return p.parse_args(argv)


# ---- model ----------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.head_dim = d // heads
        self.wq, self.wk, self.wv = (nn.Linear(d, d, bias=False) for _ in range(3))
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # under tensor parallelism q/k/v hold this rank's heads only: -1 counts them
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.w1, self.w3 = nn.Linear(d, 4 * d, bias=False), nn.Linear(d, 4 * d, bias=False)
        self.w2 = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.attention, self.feed_forward = Attention(d, heads), FeedForward(d)
        self.slow = SlowDown()  # injected extra compute per forward and backward (0 s unless set)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return self.slow(x + self.feed_forward(self.ffn_norm(x)))


class Transformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        torch.manual_seed(args.seed)
        self.tok_embeddings = nn.Embedding(args.vocab, args.d_model)
        self.layers = nn.ModuleList(Block(args.d_model, args.heads) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.d_model)
        self.output = nn.Linear(args.d_model, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # a pipeline stage without the embedding gets the previous stage's activations
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def pipeline_split(model: Transformer, stage: int, stages: int) -> Transformer:
    """torchtitan's manual split: stage `stage` keeps its share of the blocks, the first the
    embedding, the last the norm and output (the whole model was built first: every layout
    starts from the same parameters)."""
    per = len(model.layers) // stages
    model.layers = nn.ModuleList(model.layers[stage * per:(stage + 1) * per])
    if stage > 0:
        model.tok_embeddings = None
    if stage < stages - 1:
        model.norm = model.output = None
    return model


def batch(args, step: int, dp_rank: int, mb: int) -> torch.Tensor:
    """Deterministic token sequences per (step, data-parallel replica, microbatch): the ranks
    of one tensor-parallel group see the same batch."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + dp_rank * 31 + mb)
    return torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)


# ---- parallelisation (torchtitan's parallelize_llama, in small) ------------------------------

def parallelize(model: Transformer, mesh, pipelined: bool = False) -> Transformer:
    """Tensor parallel over mesh["tp"], then FSDP2 over mesh["dp"] (one unit per block)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    tp = mesh["tp"]
    plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
            "output": ColwiseParallel(output_layouts=Replicate())}
    parallelize_module(model, tp, {k: v for k, v in plan.items() if getattr(model, k) is not None})
    for block in model.layers:
        parallelize_module(block, tp, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
    # with pipelining, as torchtitan: parameters stay gathered between a step's microbatches
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"], reshard_after_forward=not pipelined)
    return fully_shard(model, mesh=mesh["dp"], reshard_after_forward=not pipelined)


# ---- main -----------------------------------------------------------------------------------

def main(argv=None) -> None:
    args = parse_args(argv)
    require_torchrun(4)
    if not args.no_record:
        refuse_earlier_run(args.out, args.overwrite, "--out")
    world = int(os.environ["WORLD_SIZE"])
    if args.tp < 1 or world % args.tp or args.heads % args.tp:
        raise SystemExit(f"--tp {args.tp} must divide the world size ({world}) and --heads "
                         f"({args.heads})")
    if args.pp < 1 or world % (args.tp * args.pp) or args.layers % args.pp:
        raise SystemExit(f"--pp {args.pp} must divide the world size over --tp ({world // args.tp}) "
                         f"and --layers ({args.layers})")
    if args.pp > 1 and args.microbatches < args.pp:
        raise SystemExit(f"--microbatches {args.microbatches} must be at least --pp {args.pp}")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh

    dp = world // (args.tp * args.pp)
    mesh = (init_device_mesh("cpu", (dp, args.tp), mesh_dim_names=("dp", "tp")) if args.pp == 1
            else init_device_mesh("cpu", (args.pp, dp, args.tp), mesh_dim_names=("pp", "dp", "tp")))
    dp_rank = mesh["dp"].get_local_rank()
    stage = mesh["pp"].get_local_rank() if args.pp > 1 else 0
    model = Transformer(args)
    if args.pp > 1:
        model = pipeline_split(model, stage, args.pp)
    if rank == args.slow_rank:
        for layer in model.layers:
            layer.slow.fwd_s = layer.slow.bwd_s = args.slow_ms / 1e3
    model = parallelize(model, mesh, pipelined=args.pp > 1)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    injections = ([{"cause": "worker_fault", "rank": args.slow_rank, "stage": args.slow_rank
                    // (world // args.pp), "extra_ms_per_block": args.slow_ms}]
                  if 0 <= args.slow_rank < world and args.slow_ms > 0 else [])
    extra = {"injections": injections, "microbatches": args.microbatches}
    if args.pp > 1:
        train_pipelined(args, model, opt, mesh, stage, dp_rank, extra)
    else:
        train(args, model, opt, dp_rank, extra)
    save_params(model, args.params_out, mesh, stage)
    # Shutdown order: the recorder is closed (in train), then the model goes (FSDP2 holds the
    # process group; its hooks form cycles, hence the collect), then the group.
    del model, opt
    gc.collect()
    dist.destroy_process_group()


def train(args, model: nn.Module, opt, dp_rank: int, extra: dict) -> None:
    """The plain loop (gradient accumulation over --microbatches), recorded by one line."""
    # The one line that records the job (a collective: every rank calls it).
    with attach(model, opt, args.out, overwrite=args.overwrite, enabled=not args.no_record,
                extra=extra):
        for step in range(args.steps):
            for mb in range(args.microbatches):
                tokens = batch(args, step, dp_rank, mb)
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                (loss / args.microbatches).backward()
            opt.step()
            opt.zero_grad()
            if dist.get_rank() == 0 and (step % 4 == 0 or step == args.steps - 1):
                print(f"step {step:3d} loss {loss.item():.4f}", flush=True)


def train_pipelined(args, model: nn.Module, opt, mesh, stage: int, dp_rank: int,
                    extra: dict) -> None:
    """This rank's stage in a 1F1B schedule over mesh["pp"]; attach is given the schedule."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    def loss_fn(logits, target):
        return F.cross_entropy(logits.flatten(0, 1), target.flatten())

    pipe = PipelineStage(model, stage, args.pp, torch.device("cpu"), group=mesh["pp"].get_group())
    schedule = Schedule1F1B(pipe, args.microbatches, loss_fn=loss_fn)
    with attach(schedule, opt, args.out, overwrite=args.overwrite, enabled=not args.no_record,
                extra=extra):
        for step in range(args.steps):
            tokens = torch.cat([batch(args, step, dp_rank, mb) for mb in range(args.microbatches)])
            inputs = (tokens[:, :-1],) if pipe.is_first else ()
            target = tokens[:, 1:] if pipe.is_last else None
            losses: list = []
            schedule.step(*inputs, target=target, losses=losses)
            opt.step()
            opt.zero_grad()
            if losses and dist.get_rank() == world_last_stage_first_rank(mesh) \
                    and (step % 4 == 0 or step == args.steps - 1):
                print(f"step {step:3d} loss {torch.stack(losses).mean().item():.4f}", flush=True)


def world_last_stage_first_rank(mesh) -> int:
    """The rank that prints the loss: the last stage's first (it computes the loss)."""
    return int(mesh.mesh[-1].flatten()[0])


def save_params(model: nn.Module, path: Path | None, mesh, stage: int) -> None:
    """Full (unsharded) parameters to `path` (with --pp: one file per stage, PATH.stageS), by
    the first rank of each stage (a collective: every rank of the stage gathers)."""
    if path is None:
        return
    full = {name: p.detach().full_tensor() for name, p in model.named_parameters()}
    first = mesh["dp"].get_local_rank() == 0 and mesh["tp"].get_local_rank() == 0
    if first:
        if mesh.ndim == 3:
            path = path.with_name(f"{path.name}.stage{stage}")
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(full, path)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    exit_without_finalizing(main_once(main))  # see examples/launch.py: a rare gloo abort at shutdown
