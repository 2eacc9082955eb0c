"""A small DDP or 2-stage pipeline job on gloo, profiled by torch.profiler (one trace per rank).

Usage (under torchrun):
    kineto_profile_job.py OUT_DIR [--pp 1|2] [--inject none|slow|sleep-backward|stall]
                          [--rank R] [--factor F] [--sleep-ms MS] [--steps N] [--no-shapes]

pp 1: DDP over all ranks. pp 2: rank = dp_rank * 2 + stage (pipeline neighbours adjacent),
two microbatches per step (GPipe order) with blocking send/recv, then a gradient all-reduce in
each stage's DP group and the optimizer. Injections on rank R:
  slow            F times the forward work (a compute straggler);
  sleep-backward  sleeps MS between forward and backward (host-side work inside the step);
  stall           sleeps MS at the start of every step (a slow data loader).
"""

import argparse
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule
import sys
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from launch import exit_without_finalizing  # noqa: E402  (examples/launch.py)

WIDTH = 256
BURN = 24  # matmuls of base forward work per microbatch: ~10 ms, long against preemption


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("out", type=Path)
    p.add_argument("--pp", type=int, default=1, choices=(1, 2))
    p.add_argument("--inject", default="none", choices=("none", "slow", "sleep-backward", "stall"))
    p.add_argument("--rank", type=int, default=-1)
    p.add_argument("--factor", type=int, default=8)
    p.add_argument("--sleep-ms", type=float, default=250.0)
    p.add_argument("--steps", type=int, default=6, help="profiled (active) steps")
    p.add_argument("--no-shapes", action="store_true", help="profile without record_shapes")
    return p.parse_args()


def block(n: int) -> torch.nn.Sequential:
    layers = []
    for _ in range(n):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers)


def burn(x: torch.Tensor, times: int) -> torch.Tensor:
    """Extra forward work whose result feeds the model (so it cannot be skipped)."""
    eye = torch.eye(WIDTH)
    for _ in range(times):
        x = torch.tanh(x @ eye)
    return x


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    me = rank == args.rank
    extra = BURN * (args.factor - 1) if me and args.inject == "slow" else 0
    sleep_s = args.sleep_ms / 1e3 if me else 0.0
    x = torch.randn(128, WIDTH)
    pp = args.pp
    if pp == 1:
        model = torch.nn.parallel.DistributedDataParallel(block(4))
        dp_group = None
    else:
        dp = world // pp
        groups = [dist.new_group([d * pp + s for d in range(dp)]) for s in range(pp)]
        stage = rank % pp
        dp_group = groups[stage]
        model = block(4)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def ddp_step() -> None:
        if args.inject == "stall":
            time.sleep(sleep_s)
        h = burn(x, BURN + extra)
        loss = model(h).square().mean()
        if args.inject == "sleep-backward":
            time.sleep(sleep_s)
        loss.backward()
        opt.step()
        opt.zero_grad()

    def pipeline_step() -> None:
        stage = rank % pp
        if args.inject == "stall":
            time.sleep(sleep_s)
        outs, ins = [], []
        for mb in range(2):  # forwards
            if stage == 0:
                h = burn(x, BURN + extra)
                inp = h
            else:
                inp = torch.empty(128, WIDTH)
                dist.recv(inp, rank - 1)
                inp.requires_grad_()
                h = burn(inp, BURN + extra)
            y = model(h)
            if stage == 0:
                dist.send(y.detach(), rank + 1)
            else:
                y = y.square().mean()  # the loss belongs to the last stage's forward
            ins.append(inp)
            outs.append(y)
        if args.inject == "sleep-backward":
            time.sleep(sleep_s)
        for mb in reversed(range(2)):  # backwards
            if stage == pp - 1:
                outs[mb].backward()
                dist.send(ins[mb].grad, rank - 1)
            else:
                grad = torch.empty(128, WIDTH)
                dist.recv(grad, rank + 1)
                outs[mb].backward(grad)
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        dist.all_reduce(flat, group=dp_group)
        opt.step()
        opt.zero_grad()

    def export(prof) -> None:
        prof.export_chrome_trace(str(args.out / f"trace_rank-{rank}.json"))

    sched = schedule(wait=1, warmup=1, active=args.steps)
    with profile(activities=[ProfilerActivity.CPU], schedule=sched, on_trace_ready=export,
                 record_shapes=not args.no_shapes) as prof:
        for _ in range(args.steps + 2):
            (ddp_step if pp == 1 else pipeline_step)()
            prof.step()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing()  # torch's gloo threads can abort a finished process at exit
