"""Worker: the StragglAR DDP hook on a model that runs its own all_reduce during backward
(as SyncBatchNorm or tensor-parallel layers do), with a persistent straggler; then the
arrival clock of later buckets. Matches plain DDP step by step."""

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from stragglers.collectives.ddp_hook import StragglarHookState, stragglar_hook
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from launch import exit_without_finalizing  # noqa: E402  (examples/launch.py)

STEPS = 10
DELAY = 0.3  # rank 1's backward starts this much later every step (>> noise on a loaded box)


class AllReduceInBackward(torch.autograd.Function):
    """Identity forward; backward averages the incoming gradient over the default group."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)  # the model's own collective, on the default group
        return grad / dist.get_world_size()


class Model(torch.nn.Module):
    def __init__(self, own_collective: bool):
        super().__init__()
        torch.manual_seed(0)
        self.own_collective = own_collective
        self.layers = torch.nn.ModuleList(torch.nn.Linear(24, 24) for _ in range(3))
        self.head = torch.nn.Linear(24, 3)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
            if self.own_collective:
                x = AllReduceInBackward.apply(x)
        return self.head(x)


def train(model, rank, delay):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = torch.randn(8, 24, generator=g), torch.randn(8, 3, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if delay and rank == 1:
            time.sleep(DELAY)
        opt.zero_grad()
        loss.backward()
        opt.step()


def run(own_collective, rank, n):
    """Plain DDP and the hook side by side; one bucket per parameter (tiny bucket cap)."""
    plain = DDP(Model(own_collective), bucket_cap_mb=1e-6)
    train(plain, rank, delay=False)
    model = DDP(Model(own_collective), bucket_cap_mb=1e-6)
    state = StragglarHookState(window=4, threshold=0.6, min_lead_s=0.05)
    model.register_comm_hook(state, stragglar_hook)
    train(model, rank, delay=True)
    state.close()
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.allclose(p, q, atol=1e-5, rtol=1e-5), f"parameters differ {(p - q).abs().max()}"
    decisions = [(d.bucket, d.straggler) for d in state.decisions]
    everyone = [None] * n
    dist.all_gather_object(everyone, decisions)
    assert all(d == decisions for d in everyone), "ranks disagree"
    leads = {b: [a.lead for a in det.history] for b, det in state.detectors.items()}
    last_step = {b: s for b, s in decisions}  # each bucket's decision at the last step
    return last_step, leads


def main():
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    # 1. the model all-reduces in backward on the default group while the hook reduces buckets
    #    on its own group: no mix-up, same parameters as plain DDP; the buckets of the head
    #    (ready before the model's first collective, where rank 1 is still 0.3 s late) use
    #    StragglAR with rank 1 concurrently with those collectives
    last_step, leads = run(True, rank, n)
    assert 1 in last_step.values(), (last_step, leads)
    # 2. arrival clock: without a model collective, every bucket of rank 1 is late by the
    #    same 0.3 s, but only the first bucket waits for it; the others queue behind it on
    #    the other ranks, and that wait is not lateness
    last_step, leads = run(False, rank, n)
    first = 0
    assert last_step[first] == 1, (last_step, leads)
    assert min(leads[first]) > 0.5 * DELAY, leads
    later = {b: s for b, s in last_step.items() if b != first}
    assert len(later) >= 5 and all(s is None for s in later.values()), (last_step, leads)
    worst = max(x for b, ls in leads.items() if b != first for x in ls)
    assert worst < 0.3 * DELAY, leads
    if rank == 0:
        print(f"later buckets: max lead {worst * 1e3:.2f} ms (delay {DELAY * 1e3:.0f} ms)", flush=True)
    print(f"rank {rank}: backward-collective ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing()  # torch's gloo threads can abort a finished process at exit
