"""A small GPT trained with data parallelism × pipeline parallelism (1F1B, optional interleaving).

    python -m torch.distributed.run --nproc-per-node 4 examples/train_gpt.py \
        --pp 2 --steps 20 --trace-dir runs/gpt --slow-rank 1 --slow-factor 3

Rank layout: rank = dp_rank * pp + stage (pipeline neighbours are adjacent ranks); it is written
to meta.json (extra.layout). With --vpp V > 1 the blocks are split into pp·V model chunks and
stage s holds global chunks c·pp + s (c = 0..V−1), run in Megatron's interleaved 1F1B order.
gloo on CPU, NCCL on GPU. Every straggler injection is off by default
and, when on, written to meta.json as ground truth (extra.injections).

Read top to bottom: arguments → model → data → pipeline schedule → step → main.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from stragglers.mitigate import PlannedGC, balance_sequences, suggest_stage_split
from stragglers.record import Recorder
from stragglers.serving import read_token_file
from stragglers.trace.synth.schedule import compute_order
from stragglers.trace.model import JobMeta

from launch import main_once, refuse_earlier_run, require_torchrun  # examples/launch.py (on sys.path)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (dp = world size / pp)")
    p.add_argument("--vpp", type=int, default=1,
                   help="model chunks per stage (interleaved 1F1B); microbatches must be a "
                        "multiple of --pp when > 1")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks before injections")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=256)
    p.add_argument("--max-seq-len", type=int, default=256, help="also the tokens per microbatch")
    p.add_argument("--seq-len-dist", choices=["fixed", "uniform", "lognormal"], default="fixed")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--clip-grad", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    # recorder
    p.add_argument("--trace-dir", type=Path, default=None, help="where the run's traces go")
    p.add_argument("--sample-every", type=int, default=1, help="record one step in k")
    p.add_argument("--flush-every", type=int, default=64,
                   help="convert recorded steps once this many are pending (bounds their memory)")
    p.add_argument("--flush-interval", type=float, default=1.0, help="write a part every S s")
    p.add_argument("--no-record", action="store_true", help="run without the recorder")
    p.add_argument("--profile", type=Path, default=None, metavar="DIR",
                   help="also write torch.profiler traces of every step (one JSON per rank)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier run in --trace-dir (refused otherwise)")
    p.add_argument("--summary", type=Path, default=None, help="write step times as JSON (rank 0)")
    # not "--monitor": torchrun reads any prefix of its own --monitor-interval as ambiguous
    p.add_argument("--monitor-url", type=str, default=None, metavar="URL",
                   help="also upload each flushed part to a live monitor (stragglers monitor serve)")
    p.add_argument("--monitor-token-file", type=Path, default=None,
                   help="file holding the monitor's bearer token")
    p.add_argument("--monitor-close-timeout", type=float, default=10.0, metavar="S",
                   help="at the end, wait at most S seconds to deliver parts still queued for "
                        "the monitor (they stay in --trace-dir either way)")
    # injections (all off by default)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-factor", type=float, default=1.0)
    p.add_argument("--slow-until-step", type=int, default=-1,
                   help="the slow rank recovers from this step on (-1: slow to the end)")
    p.add_argument("--extra-last-stage-layers", type=int, default=0)
    p.add_argument("--gc-garbage", type=float, default=0.0, metavar="MB",
                   help="a long-lived heap of MB plus cyclic garbage each step, so real automatic "
                        "full collections (pauses that scan the heap) happen on each rank")
    p.add_argument("--comm-delay-rank", type=int, default=-1,
                   help="the link from this rank to its next stage is slow, both ways")
    p.add_argument("--comm-delay-ms", type=float, default=0.0)
    p.add_argument("--crash-rank", type=int, default=-1, help="this rank dies (SIGKILL) ...")
    p.add_argument("--crash-at-step", type=int, default=-1, help="... at the start of this step")
    # fixes
    p.add_argument("--planned-gc", type=int, default=0, metavar="N", help="PlannedGC(every=N)")
    p.add_argument("--balance-sequences", action="store_true")
    p.add_argument("--stage-split", type=str, default="", help="layers per stage, e.g. 3,3")
    p.add_argument("--balance-stages", action="store_true",
                   help="profile per-layer costs on rank 0 and use suggest_stage_split")
    return p.parse_args(argv)


# ---- model ----------------------------------------------------------------------------------

class Block(nn.Module):
    """Pre-norm transformer block; attention is causal within each packed sequence."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        # Attention per sequence, written out so forward and backward are matmuls of s × s:
        # its cost grows with Σ sᵢ², which is what sequence imbalance is.
        outs = []
        for qs, ks, vs in zip(q.split(seq_lens), k.split(seq_lens), v.split(seq_lens)):
            s = qs.shape[0]
            qh, kh, vh = (z.view(s, self.heads, hd).transpose(0, 1) for z in (qs, ks, vs))
            scores = (qh @ kh.transpose(1, 2)) * hd ** -0.5
            causal = torch.ones(s, s, dtype=torch.bool, device=x.device).triu_(1)
            attn = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
            outs.append((attn @ vh).transpose(0, 1).reshape(s, d))
        x = x + self.proj(torch.cat(outs))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    """Final norm and the vocabulary projection (the last stage's extra cost)."""

    def __init__(self, d: int, vocab: int):
        super().__init__()
        self.ln, self.lm = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


class Stage(nn.Module):
    """One pipeline stage: [embedding] + its blocks + [head]."""

    def __init__(self, args, first: int, count: int, is_first: bool, is_last: bool):
        super().__init__()
        torch.manual_seed(args.seed)
        self.embed = nn.Embedding(args.vocab, args.d_model) if is_first else None
        blocks = []
        for i in range(first, first + count):
            torch.manual_seed(args.seed + 1 + i)  # a layer's weights do not depend on the split
            blocks.append(Block(args.d_model, args.heads))
        self.blocks = nn.ModuleList(blocks)
        torch.manual_seed(args.seed + 10_000)
        self.head = Head(args.d_model, args.vocab) if is_last else None

    def forward(self, x: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x, seq_lens)
        return self.head(x) if self.head is not None else x


def chunk_layout(args) -> list[int]:
    """Blocks per global model chunk (vpp > 1): even, the injected extra layers in the last one."""
    n = args.pp * args.vpp
    if args.stage_split or args.balance_stages:
        raise SystemExit("--stage-split / --balance-stages split blocks per stage; they are not "
                         "supported with --vpp > 1 (the split is per model chunk)")
    if args.layers < n:
        raise SystemExit(f"--layers {args.layers}: --pp {args.pp} × --vpp {args.vpp} = {n} model "
                         f"chunks need at least {n} blocks")
    base = [args.layers // n + (1 if g < args.layers % n else 0) for g in range(n)]
    base[-1] += args.extra_last_stage_layers
    return base


def stage_layout(args) -> list[int]:
    """Blocks per stage: the explicit split, a profiled one, or even (+ injected extra layers)."""
    total = args.layers + args.extra_last_stage_layers
    if args.stage_split:
        split = [int(v) for v in args.stage_split.split(",")]
        if len(split) != args.pp or sum(split) != total or min(split) < 1:
            raise SystemExit(f"--stage-split {args.stage_split}: expected {args.pp} counts >= 1 "
                             f"summing to {total} blocks")
        return split
    base = [args.layers // args.pp + (1 if s < args.layers % args.pp else 0) for s in range(args.pp)]
    base[-1] += args.extra_last_stage_layers
    return base


def profile_layer_costs(args, repeats: int = 5) -> tuple[list[float], float, float]:
    """Measured forward+backward seconds of each block, of the head (with loss), of the embedding."""
    lens = [args.max_seq_len]
    tokens = torch.randint(0, args.vocab, (args.max_seq_len,))
    total = args.layers + args.extra_last_stage_layers

    def timed(fn) -> float:
        fn()  # warm-up
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    x = torch.randn(args.max_seq_len, args.d_model, requires_grad=True)
    block_costs = [timed(lambda b=Block(args.d_model, args.heads): b(x, lens).sum().backward())
                   for _ in range(total)]
    head = Head(args.d_model, args.vocab)
    head_cost = timed(lambda: F.cross_entropy(head(x), tokens).backward())
    emb = nn.Embedding(args.vocab, args.d_model)
    emb_cost = timed(lambda: emb(tokens).sum().backward())
    return block_costs, head_cost, emb_cost


# ---- data -----------------------------------------------------------------------------------

def draw_lengths(rng: np.random.Generator, args, total_tokens: int) -> list[int]:
    """Sequence lengths for one global batch, drawn until they cover total_tokens."""
    lens, covered, L = [], 0, args.max_seq_len
    while covered < total_tokens:
        if args.seq_len_dist == "fixed":
            s = L
        elif args.seq_len_dist == "uniform":
            s = int(rng.integers(1, L + 1))
        else:  # lognormal: mostly short sequences, now and then one near the limit
            s = int(np.clip(round(rng.lognormal(math.log(L / 8), 1.0)), 1, L))
        lens.append(s)
        covered += s
    return lens


def plan_batch(step: int, args, dp: int) -> list[list[list[int]]]:
    """Sequence lengths of every (dp rank, microbatch) for one step; identical on all ranks.

    Default: pack in arrival order, each microbatch filled to exactly max_seq_len tokens (a
    sequence that does not fit is cut and continues in the next microbatch). With
    --balance-sequences the same sequences are redistributed by balance_sequences.
    """
    rng = np.random.default_rng([args.seed, step])
    budget, m = args.max_seq_len, args.microbatches
    pieces, bins, room = [], [[]], budget
    for s in draw_lengths(rng, args, dp * m * budget):
        while s > 0 and len(bins) <= dp * m:
            take = min(s, room)
            bins[-1].append(take)
            pieces.append(take)
            s -= take
            room -= take
            if room == 0:
                bins.append([])
                room = budget
    bins = bins[:dp * m]
    if args.balance_sequences:
        # cost per sequence ≈ attention (s²) + the per-token matmuls (≈ 6·d per token, in s² units)
        plan = balance_sequences(pieces, dp, m, cost=lambda s: s * s + 6 * args.d_model * s,
                                 max_tokens=2 * budget)
        return [[[pieces[i] for i in mb] or [1] for mb in row] for row in plan.bins]
    return [bins[d * m:(d + 1) * m] for d in range(dp)]


def microbatch_tokens(step: int, dp_rank: int, mb: int, lens: list[int], args):
    """Inputs and next-token targets of one packed microbatch (a learnable modular pattern)."""
    g = torch.Generator().manual_seed(hash((args.seed, step, dp_rank, mb)) & 0x7FFFFFFF)
    parts_x, parts_y = [], []
    for s in lens:
        start = torch.randint(0, args.vocab, (1,), generator=g)
        stride = torch.randint(1, 8, (1,), generator=g)
        seq = (start + stride * torch.arange(s + 1)) % args.vocab
        parts_x.append(seq[:-1])
        parts_y.append(seq[1:])
    return torch.cat(parts_x), torch.cat(parts_y)


# ---- injections -----------------------------------------------------------------------------

BURN_SIDES = (256, 128, 64)  # matrix sides of the burn's matmuls, largest first
_burn_op_s: dict[int, float] = {}  # side -> seconds the last matmul+tanh of that side took


def burn(seconds: float) -> None:
    """Real extra compute for `seconds` (the slow-rank injection), in few ops.

    Under --profile every op is a trace event: a burn of 64x64 matmuls alone made the slow rank's
    trace 415 MB against 15 MB for the others. The time goes in 256x256 matmuls while the time
    left holds one more (priced at what the last one took), the rest in 128x128 then 64x64 ones,
    so the burn ends within one 64x64 matmul of `seconds`, as it did (a process's first burn,
    which has no price yet, within one 256x256 matmul).
    """
    end = time.perf_counter() + seconds
    a = torch.randn(BURN_SIDES[0], BURN_SIDES[0])
    for side in BURN_SIDES:
        x = a[:side, :side].contiguous()
        last = side == BURN_SIDES[-1]  # runs to the end; a larger side only while one more fits
        while (now := time.perf_counter()) + (0.0 if last else _burn_op_s.get(side, 0.0)) < end:
            x = torch.tanh(x @ x)
            _burn_op_s[side] = time.perf_counter() - now


def make_live_heap(megabytes: float) -> list:
    """Long-lived GC-tracked objects (an in-memory index, say): every full collection scans them."""
    return [[i, None] for i in range(int(megabytes * 1e6 / 120))]


def make_cyclic_garbage(megabytes: float, rng: np.random.Generator, rate: float = 1.0) -> list:
    """Reference cycles (kept alive until the caller drops them) totalling about `megabytes`.

    Kept alive through the step, they survive young collections into the oldest generation;
    once enough are pending there, the interpreter runs a full collection at whatever point of
    the step this rank happens to be, and the pause scans the whole heap.
    """
    keep = []
    for _ in range(int(megabytes * 1e6 / 200 * rate * rng.uniform(0.8, 1.2))):
        a: list = []
        a.append([a])
        keep.append(a)
    return keep


# ---- pipeline schedule (1F1B, Megatron's op order) ------------------------------------------

class Pipeline:
    """Runs one step's microbatches through this rank's model chunks with the (interleaved) 1F1B
    schedule of stragglers.trace.synth.schedule.compute_order."""

    def __init__(self, args, rec: Recorder, chunks: nn.ModuleList, stage: int, dp_rank: int,
                 device, bwd_group=None):
        self.args, self.rec, self.chunks, self.device = args, rec, chunks, device
        self.stage, self.dp_rank, self.pp, self.vpp = stage, dp_rank, args.pp, args.vpp
        self.rank = dist.get_rank()
        # Chunk c's neighbours: the previous/next stage, wrapping between the last and first stage
        # (to the previous/next chunk) when interleaved.
        self.prev_rank = self.rank - 1 if stage > 0 else self.rank + self.pp - 1
        self.next_rank = self.rank + 1 if stage < self.pp - 1 else self.rank - self.pp + 1
        # With pp = 2 and vpp > 1 both directions run between the same two ranks: backward
        # traffic gets its own group so each direction is matched in its own order.
        self.bwd_group = bwd_group
        self.slow = args.slow_factor if self.rank == args.slow_rank else 1.0
        self.step = 0
        self.sends: list = []  # posted, not yet waited (gloo queues sends to a peer in order)
        self.gc_rng = np.random.default_rng([args.seed, self.rank])
        self.live_heap = make_live_heap(args.gc_garbage) if args.gc_garbage else None
        # Ranks see different data, so they allocate at different rates and their automatic
        # collections drift apart: the uncoordinated pauses of the paper.
        self.gc_rate = float(self.gc_rng.uniform(0.5, 1.5))

    def compute(self, optype: str, mb: int, lens: list[int], fn, mc: int = 0):
        with self.rec.op(optype, mb, seq_lens=lens, mc=mc):
            t0 = time.perf_counter()
            out = fn()
            if self.slow > 1.0 and (self.args.slow_until_step < 0
                                    or self.step < self.args.slow_until_step):
                burn((self.slow - 1.0) * (time.perf_counter() - t0))
        return out

    def send(self, optype: str, tensor: torch.Tensor, dst: int, group=None) -> None:
        tensor = tensor.contiguous()
        self.sends.append((self.rec.isend(tensor, dst, optype, group=group), tensor))  # keep alive

    def recv(self, optype: str, shape, src: int, group=None) -> torch.Tensor:
        buf = torch.empty(shape, device=self.device)
        slow = self.args.comm_delay_rank
        delay = self.args.comm_delay_ms / 1e3 if {src, self.rank} == {slow, slow + 1} else 0.0

        def transfer():
            dist.irecv(buf, src, group=group).wait()
            if delay:
                time.sleep(delay)  # the slow link: data over it arrives late, either way

        self.rec.collective(optype, transfer, nbytes=buf.numel() * buf.element_size())
        return buf

    def run(self, step: int, plan: list[list[int]]) -> float:
        """Forward and backward of every (chunk, microbatch); returns the summed loss (last stage).
        """
        m, d, V, s = self.args.microbatches, self.args.d_model, self.vpp, self.stage
        self.step = step
        inputs, outputs, losses = {}, {}, []
        garbage = []
        first_chunk = lambda c: s == 0 and c == 0  # noqa: E731  (holds the embedding)
        last_chunk = lambda c: s == self.pp - 1 and c == V - 1  # noqa: E731  (holds the loss)

        def forward(c: int, i: int) -> None:
            lens = plan[i]
            if self.args.gc_garbage:
                garbage.append(make_cyclic_garbage(self.args.gc_garbage / 10 / (m * V),
                                                   self.gc_rng, self.gc_rate))
            if first_chunk(c):
                x, _ = microbatch_tokens(step, self.dp_rank, i, lens, self.args)
            else:
                x = self.recv("forward-recv", (sum(lens), d), self.prev_rank).requires_grad_()
            inputs[c, i] = x

            def fwd():
                y = self.chunks[c](x.to(self.device), lens)
                if last_chunk(c):
                    _, target = microbatch_tokens(step, self.dp_rank, i, lens, self.args)
                    y = F.cross_entropy(y, target.to(self.device)) / m
                    losses.append(y.item())
                return y

            outputs[c, i] = self.compute("forward-compute", i, lens, fwd, mc=c)
            if not last_chunk(c):
                self.send("forward-send", outputs[c, i].detach(), self.next_rank)

        def backward(c: int, i: int) -> None:
            lens = plan[i]
            grad = None
            if not last_chunk(c):
                grad = self.recv("backward-recv", (sum(lens), d), self.next_rank, self.bwd_group)
            self.compute("backward-compute", i, lens,
                         lambda: torch.autograd.backward(outputs[c, i], grad_tensors=grad), mc=c)
            if not first_chunk(c):
                self.send("backward-send", inputs[c, i].grad, self.prev_rank, self.bwd_group)
            del inputs[c, i], outputs[c, i]

        # Megatron's order; with async sends and recvs in this order no rank waits on a cycle.
        for kind, c, i in compute_order(s, self.pp, V, m):
            (forward if kind == "F" else backward)(c, i)
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()
        del garbage  # the cycles become unreachable here; automatic GC finds them later
        return sum(losses)


# ---- one training step ----------------------------------------------------------------------

def sync_and_update(args, rec: Recorder, model: nn.Module, opt, dp_group, dp: int) -> None:
    """DP gradient all-reduce, global grad-norm all-reduce (clipping), optimizer step."""
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if dp > 1:
        flat = torch._utils._flatten_dense_tensors(grads)
        rec.all_reduce(flat, "grads-all-reduce", group=dp_group)
        flat /= dp
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
            g.copy_(synced)
    # DP replicas hold equal grads now, so each contributes 1/dp of its stage's squared norm.
    sq = torch.stack([g.pow(2).sum() for g in grads]).sum().reshape(1) / dp
    rec.all_reduce(sq, "optimizer-clip-main-grad")
    with rec.op("optimizer"):
        norm = math.sqrt(float(sq.item()))
        if args.clip_grad > 0 and norm > args.clip_grad:
            for g in grads:
                g.mul_(args.clip_grad / (norm + 1e-6))
        opt.step()
        opt.zero_grad(set_to_none=True)


def injections(args, dp: int, layers: list[int]) -> list[dict]:
    """Ground truth of what this run injected, for meta.json."""
    out = []
    where = lambda r: {"rank": r, "dp_rank": r // args.pp, "stage": r % args.pp}  # noqa: E731
    if args.slow_rank >= 0 and args.slow_factor > 1.0:
        out.append({"cause": "worker_fault", "factor": args.slow_factor, **where(args.slow_rank),
                    **({"until_step": args.slow_until_step} if args.slow_until_step >= 0 else {})})
    if args.extra_last_stage_layers:
        out.append({"cause": "stage_imbalance", "stage": args.pp - 1,
                    "extra_layers": args.extra_last_stage_layers, "layers_per_stage": layers})
    if args.seq_len_dist != "fixed":
        out.append({"cause": "sequence_imbalance", "dist": args.seq_len_dist,
                    "max_seq_len": args.max_seq_len})
    if args.gc_garbage:
        out.append({"cause": "gc", "garbage_mb": args.gc_garbage})
    if args.comm_delay_rank >= 0 and args.comm_delay_ms > 0:
        a, b = where(args.comm_delay_rank), where(args.comm_delay_rank + 1)
        out.append({"cause": "communication", "delay_ms": args.comm_delay_ms,
                    "link": {"ranks": [a["rank"], b["rank"]], "dp_rank": a["dp_rank"],
                             "stages": [a["stage"], b["stage"]]}})
    if args.crash_rank >= 0 and args.crash_at_step >= 0:
        out.append({"cause": "crash", "step": args.crash_at_step, **where(args.crash_rank)})
    return out


@contextlib.contextmanager
def profiler(args, rank: int, use_cuda: bool):
    """torch.profiler over steps 1.. when --profile DIR is given: DIR/trace_rank-R.json."""
    if args.profile is None:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    def export(prof) -> None:
        args.profile.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(args.profile / f"trace_rank-{rank}.json"))

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    # A schedule makes the profiler mark steps (ProfilerStep#k = step k); step 0 warms it up.
    # record_shapes: gloo's send/recv then carry their peer rank (c10d 'Concrete Inputs').
    with profile(activities=activities, record_shapes=True, on_trace_ready=export,
                 schedule=schedule(wait=0, warmup=1, active=max(1, args.steps - 1))) as prof:
        yield prof


def main(argv=None) -> None:
    args = parse_args(argv)
    # checked before any process group exists, so a bad flag is one line, not a hang
    if args.vpp < 1:
        raise SystemExit(f"--vpp {args.vpp}: expected at least 1 model chunk per stage")
    if args.vpp > 1 and args.microbatches % args.pp:
        raise SystemExit(f"--microbatches {args.microbatches}: interleaved 1F1B (--vpp "
                         f"{args.vpp}) needs a multiple of --pp {args.pp}")
    chunk_blocks = chunk_layout(args) if args.vpp > 1 else None
    use_cuda = torch.cuda.is_available()
    require_torchrun()
    if args.trace_dir is not None and not args.no_record:
        refuse_earlier_run(args.trace_dir, args.overwrite)
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % args.pp:
        raise SystemExit(f"world size {world} is not a multiple of --pp {args.pp}")
    dp = world // args.pp
    dp_rank, stage = rank // args.pp, rank % args.pp
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if args.comm_delay_rank >= 0 and (args.comm_delay_rank >= world
                                      or args.comm_delay_rank % args.pp == args.pp - 1):
        raise SystemExit(f"--comm-delay-rank {args.comm_delay_rank}: the slow link goes from a rank "
                         "to its next pipeline stage, so it must be a rank below the last stage")
    # one DP group per stage; every rank must create every group, in the same order
    dp_groups = [dist.new_group([d * args.pp + s for d in range(dp)]) for s in range(args.pp)]

    layers = stage_layout(args) if args.vpp == 1 else \
        [sum(chunk_blocks[c * args.pp + s] for c in range(args.vpp)) for s in range(args.pp)]
    if args.balance_stages and args.vpp == 1:
        split = [None]
        if rank == 0:
            blocks, head, emb = profile_layer_costs(args)
            split = [suggest_stage_split(blocks, args.pp, head_cost=head, embedding_cost=emb)
                     .layers_per_stage]
            print(f"balance-stages: measured block {np.mean(blocks) * 1e3:.2f} ms, head "
                  f"{head * 1e3:.2f} ms -> layers per stage {split[0]}", flush=True)
        dist.broadcast_object_list(split, src=0)
        layers = split[0]
    if args.vpp == 1:
        first = sum(layers[:stage])
        chunks = nn.ModuleList([Stage(args, first, layers[stage], stage == 0,
                                      stage == args.pp - 1)])
    else:  # stage s holds global chunks c·pp + s
        n = args.pp * args.vpp
        gcs = [c * args.pp + stage for c in range(args.vpp)]
        chunks = nn.ModuleList([Stage(args, sum(chunk_blocks[:g]), chunk_blocks[g], g == 0,
                                      g == n - 1) for g in gcs])
    model = chunks.to(device)
    # pp = 2 interleaved: both directions between the same two ranks (see Pipeline)
    bwd_group = dist.new_group(list(range(world))) if args.vpp > 1 else None
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    meta = JobMeta(name="train_gpt", dp_size=dp, pp_size=args.pp, vpp_size=args.vpp,
                   run_id=os.environ.get("TORCHELASTIC_RUN_ID", "0"))
    meta.extra.update({"injections": injections(args, dp, layers),
                       "schedule": "1f1b" if args.vpp == 1 else "interleaved-1f1b",
                       "microbatches": args.microbatches, "layers_per_stage": layers,
                       **({"layers_per_chunk": chunk_blocks} if chunk_blocks else {}),
                       "args": {k: str(v) for k, v in vars(args).items()}})
    rec = Recorder(args.trace_dir or Path("runs") / "train_gpt", meta, dp_rank=dp_rank,
                   stage=stage, sample_every=args.sample_every, flush_every=args.flush_every,
                   flush_interval_s=args.flush_interval,
                   device=device, enabled=not args.no_record and args.trace_dir is not None,
                   overwrite=args.overwrite, monitor=args.monitor_url,
                   monitor_token=read_token_file(args.monitor_token_file, "--monitor-token-file"),
                   monitor_close_timeout_s=args.monitor_close_timeout)
    planned_gc = PlannedGC(args.planned_gc) if args.planned_gc else None
    pipeline = Pipeline(args, rec, model, stage, dp_rank, device, bwd_group)
    step_starts = []
    with rec, profiler(args, rank, use_cuda) as prof:
        if planned_gc:
            planned_gc.start()
        for step in range(args.steps):
            if rank == args.crash_rank and step == args.crash_at_step:
                print(f"rank {rank}: injected crash at step {step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            step_starts.append(time.perf_counter())
            with rec.step(step):
                loss = pipeline.run(step, plan_batch(step, args, dp)[dp_rank])
                if planned_gc:
                    planned_gc.step(step)  # the collection is recorded as a gc op by its pause
                sync_and_update(args, rec, model, opt, dp_groups[stage], dp)
            if prof is not None:
                prof.step()
            if stage == args.pp - 1 and dp_rank == 0 and (step % 5 == 0 or step == args.steps - 1):
                print(f"step {step:4d} loss {loss:.3f}", flush=True)
        step_starts.append(time.perf_counter())
        if planned_gc:
            planned_gc.stop()
    report_summary(args, rank, world, step_starts, rec)
    dist.destroy_process_group()


def report_summary(args, rank: int, world: int, step_starts: list[float], rec: Recorder) -> None:
    """Rank 0 gathers every rank's step times and writes --summary (JSON)."""
    times = np.diff(step_starts).tolist()
    everyone = [None] * world
    dist.all_gather_object(everyone, times)
    if rank != 0:
        return
    skip = min(2, len(times) - 1)  # the first steps pay for warm-up allocations
    steady = np.array(everyone[0][skip:])
    print(f"mean step time {steady.mean() * 1e3:.1f} ms over steps {skip}..{len(times) - 1}",
          flush=True)
    # the last line says what to do next: the analysis is the verdict on this run
    injected = ", ".join(i["cause"] for i in injections(args, world // args.pp, [])) or "nothing"
    print(f"done: {len(times)} steps, injected: {injected}; " + (
        f"explain it: stragglers analyze {rec.trace_dir}" if rec.enabled else
        "not recorded (pass --trace-dir DIR to record it)"), flush=True)
    if args.summary:
        args.summary.parent.mkdir(parents=True, exist_ok=True)
        args.summary.write_text(json.dumps({
            "step_times": {str(r): t for r, t in enumerate(everyone)},
            "mean_step_s": float(steady.mean()), "median_step_s": float(np.median(steady)),
            "skipped_steps": skip, "recorded": rec.enabled,
            "trace_dir": str(rec.trace_dir) if rec.enabled else None}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main_once(main))
