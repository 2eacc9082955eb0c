"""A mixture-of-experts transformer with expert parallelism over every rank, recorded with one call.

    python -m torch.distributed.run --nproc-per-node 4 examples/train_moe.py \
        --steps 8 --out runs/moe --hot-expert 2 --routing-skew 0.5
    stragglers analyze runs/moe

Each rank holds one expert (`--experts-per-rank` more) and a replica of everything else
(attention, embedding, router: FSDP2 over all ranks, experts left out of it). A MoE layer
routes each token to one expert (top-1), sends it to the expert's rank with
`dist.all_to_all_single` (dispatch), runs the expert there and sends the result back (combine);
backward sends the gradients the same two ways. The rank whose expert receives more tokens
computes longer, and every rank waits for it at the next all-to-all: expert load imbalance.

`stragglers.record.attach` is the only line the recording needs: each all-to-all is a row with
the rows this rank received (`tokens`: its experts' load, from the split sizes) and its group;
the model is unchanged. Routing, by flag:
- learned (default): the router's top-1 choice;
- `--hot-expert E --routing-skew P`: a share P of the tokens is sent to expert E whatever the
  router says (injected imbalance, written to meta.json as ground truth);
- `--balanced`: token i goes to expert i mod E (every expert rank receives the same number);
- `--alternate`: odd steps balanced, even steps as the flags above say (a skewed and a balanced
  step side by side in one run, so a loaded machine slows both alike).

Read top to bottom: arguments → expert parallel all-to-all → model → main.
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

from launch import exit_without_finalizing, main_once, refuse_earlier_run, require_torchrun


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    # 2048: the experts hold most of the compute, as in real MoE models, and a hot expert's
    # extra rows cost more than a loaded machine's jitter. `--hot-expert 2 --routing-skew 0.5`,
    # 4 ranks on 2 cores at load 10-16: expert_imbalance first in 0 of 2 runs at 512 (×1.02-1.06,
    # under min_gain), 4 of 6 at 1024, 5 of 5 at 2048 (×1.21-1.33)
    p.add_argument("--d-expert", type=int, default=2048, help="hidden size of an expert's MLP")
    p.add_argument("--experts-per-rank", type=int, default=1)
    p.add_argument("--device-us-per-row", type=float, default=0.0,
                   help="emulate a device per rank: an expert also waits this many µs per row "
                        "in forward (twice in backward) without holding a CPU")
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="sequences per microbatch and rank")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hot-expert", type=int, default=-1, help="the expert --routing-skew favours")
    p.add_argument("--routing-skew", type=float, default=0.0,
                   help="share of the tokens sent to --hot-expert (0..1)")
    p.add_argument("--balanced", action="store_true", help="token i → expert i mod E")
    p.add_argument("--alternate", action="store_true", help="balanced routing in odd steps only")
    p.add_argument("--out", type=Path, default=Path("runs/train_moe"), help="the run directory")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier run in --out")
    p.add_argument("--no-record", action="store_true", help="run without attach")
    p.add_argument("--params-out", type=Path, default=None,
                   help="save each rank's parameters in this folder (rank-N.pt), to compare runs")
    return p.parse_args(argv)


# ---- expert parallel all-to-all --------------------------------------------------------------

class AllToAll(torch.autograd.Function):
    """dist.all_to_all_single with its backward (the gradients go back the way rows came)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        ctx.send, ctx.receive = send, receive
        out = x.new_empty(sum(receive), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), receive, send)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.receive)
        return out, None, None


def exchange_counts(per_expert: torch.Tensor) -> torch.Tensor:
    """[source rank × my experts] the rows each rank sends to each of my experts, from my
    counts per expert (an all-to-all of counts: each rank gets its experts' part)."""
    received = torch.empty_like(per_expert)
    dist.all_to_all_single(received, per_expert)
    return received


# ---- model ----------------------------------------------------------------------------------

class DeviceTime(torch.autograd.Function):
    """An emulated accelerator: the rows' compute takes `seconds` (twice in backward) of
    waiting, as a host waits for its device, leaving the CPU to the other ranks. On a machine
    with fewer cores than ranks the expert compute of every rank then runs side by side, as
    on one device each, instead of the ranks sharing the cores."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(2 * ctx.seconds)
        return grad, None


class Expert(nn.Module):
    def __init__(self, d: int, hidden: int, us_per_row: float = 0.0):
        super().__init__()
        self.w1, self.w2 = nn.Linear(d, hidden), nn.Linear(hidden, d)
        self.us_per_row = us_per_row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.us_per_row > 0:
            x = DeviceTime.apply(x, len(x) * self.us_per_row * 1e-6)
        return self.w2(F.gelu(self.w1(x)))


class MoE(nn.Module):
    """Top-1 routed experts, `per_rank` of them on each rank (expert e lives on rank e // per_rank)."""

    def __init__(self, args, world: int, rank: int):
        super().__init__()
        self.args, self.world, self.per_rank = args, world, args.experts_per_rank
        self.n_experts = world * self.per_rank
        self.router = nn.Linear(args.d_model, self.n_experts, bias=False)
        self.experts = nn.ModuleList(Expert(args.d_model, args.d_expert, args.device_us_per_row)
                                     for _ in range(self.per_rank))
        first = rank * self.per_rank  # every rank draws every expert: the same init as one process
        for e in range(self.n_experts):
            weights = Expert(args.d_model, args.d_expert)
            if first <= e < first + self.per_rank:
                self.experts[e - first].load_state_dict(weights.state_dict())

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert of each token, its gate weight)."""
        probs = self.router(x).softmax(-1)
        n, args = len(x), self.args
        if args.balanced:
            expert = torch.arange(n) % self.n_experts
        else:
            expert = probs.argmax(-1)
            if args.routing_skew > 0 and 0 <= args.hot_expert < self.n_experts:
                # a fixed share of the token positions, whatever the router says
                forced = (torch.arange(n) * 7919) % 1000 < args.routing_skew * 1000
                expert = torch.where(forced, torch.full_like(expert, args.hot_expert), expert)
        return expert, probs.gather(1, expert[:, None]).squeeze(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        expert, gate = self.route(x)
        order = torch.argsort(expert, stable=True)  # rows grouped by expert, so by rank
        per_expert = torch.bincount(expert, minlength=self.n_experts)
        send = per_expert.view(self.world, self.per_rank).sum(1).tolist()
        mine = exchange_counts(per_expert)
        receive = mine.view(self.world, self.per_rank).sum(1).tolist()
        # dispatch: my tokens to their experts' ranks; I get the tokens routed to my experts
        rows = AllToAll.apply(x[order], send, receive)
        # the rows from each source come grouped by expert: which of mine each one is for
        local = torch.repeat_interleave(torch.arange(self.per_rank).repeat(self.world), mine)
        out = torch.empty_like(rows)
        for i, e in enumerate(self.experts):
            out[local == i] = e(rows[local == i])
        # combine: the results back to the tokens' ranks, in the order they were sent
        back = AllToAll.apply(out, receive, send)
        y = torch.empty_like(back)
        y[order] = back
        return (y * gate[:, None]).reshape(shape)


class Block(nn.Module):
    def __init__(self, args, world: int, rank: int):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(args.d_model), nn.RMSNorm(args.d_model)
        self.attention = nn.MultiheadAttention(args.d_model, args.heads, batch_first=True)
        self.moe = MoE(args, world, rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        x = x + self.attention(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.moe(self.norm2(x))


class Transformer(nn.Module):
    def __init__(self, args, world: int, rank: int):
        super().__init__()
        torch.manual_seed(args.seed)
        self.embed = nn.Embedding(args.vocab, args.d_model)
        self.layers = nn.ModuleList(Block(args, world, rank) for _ in range(args.layers))
        self.norm = nn.RMSNorm(args.d_model)
        self.output = nn.Linear(args.d_model, args.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def expert_parameters(self) -> list[nn.Parameter]:
        return [p for layer in self.layers for p in layer.moe.experts.parameters()]


def batch(args, step: int, rank: int, mb: int) -> torch.Tensor:
    """Deterministic token sequences per (step, rank, microbatch)."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank * 31 + mb)
    return torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)


# ---- main -----------------------------------------------------------------------------------

def main(argv=None) -> None:
    args = parse_args(argv)
    require_torchrun(4)
    if not args.no_record:
        refuse_earlier_run(args.out, args.overwrite, "--out")
    if not 0 <= args.routing_skew <= 1:
        raise SystemExit(f"--routing-skew {args.routing_skew}: expected a share in 0..1")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = Transformer(args, world, rank)
    experts = model.expert_parameters()
    for p in experts:  # an expert's gradient sums every rank's loss; the others are averaged
        p.register_hook(lambda g: g / world)
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(model, ignored_params=set(experts))  # data parallel over the rest
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    hot = args.routing_skew > 0 and 0 <= args.hot_expert < world * args.experts_per_rank \
        and not args.balanced
    injections = ([{"cause": "expert_imbalance", "expert": args.hot_expert,
                    "rank": args.hot_expert // args.experts_per_rank, "stage": 0,
                    "routing_skew": args.routing_skew,
                    **({"steps": "even"} if args.alternate else {})}] if hot else [])

    # The one line that records the job (a collective: every rank calls it).
    with attach(model, opt, args.out, overwrite=args.overwrite, enabled=not args.no_record,
                extra={"injections": injections, "microbatches": args.microbatches,
                       "routing": "alternate" if args.alternate else
                       "balanced" if args.balanced else "learned"}):
        for step in range(args.steps):
            if args.alternate:  # every MoE layer reads it from the shared arguments
                args.balanced = step % 2 == 1
            for mb in range(args.microbatches):
                tokens = batch(args, step, rank, mb)
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
                (loss / args.microbatches).backward()
            opt.step()
            opt.zero_grad()
            if rank == 0 and (step % 4 == 0 or step == args.steps - 1):
                print(f"step {step:3d} loss {loss.item():.4f}", flush=True)
    save_params(model, args.params_out, rank)
    # Shutdown order: the recorder is closed (the `with` above), then the model goes (FSDP2
    # holds the process group; its hooks form cycles, hence the collect), then the group.
    del model, opt, loss, logits, experts
    gc.collect()
    dist.destroy_process_group()


def save_params(model: nn.Module, folder: Path | None, rank: int) -> None:
    """This rank's parameters (replicated ones gathered in full, its own experts) to folder."""
    if folder is None:
        return
    params = {name: (p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach())
              for name, p in model.named_parameters()}
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(params, folder / f"rank-{rank}.pt")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    exit_without_finalizing(main_once(main))  # see examples/launch.py: a rare gloo abort at shutdown
