"""Worker: DDP with the StragglAR hook (persistent and eager) matches plain DDP while the
straggler moves; every rank takes the same decision at every step."""

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from stragglers.collectives.ddp_hook import StragglarHookState, stragglar_hook
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from launch import exit_without_finalizing  # noqa: E402  (examples/launch.py)

STEPS = 14
DELAY = 0.12


def late_rank(step: int, n: int) -> int:
    """The straggler moves half-way: rank 1 first, then rank n-1."""
    return 1 if step < STEPS // 2 else n - 1


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.Tanh(), torch.nn.Linear(17, 5))


def train(model: DDP, rank: int, n: int, delay: bool) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        x, y = torch.randn(16, 33, generator=g), torch.randn(16, 5, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        if delay and rank == late_rank(step, n):
            time.sleep(DELAY)
        opt.zero_grad()
        loss.backward()
        opt.step()


def main() -> None:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    plain = DDP(make_model())
    train(plain, rank, n, delay=False)
    results = {}
    for mode in ("persistent", "eager"):
        model = DDP(make_model())
        state = StragglarHookState(mode=mode, window=4, threshold=0.6)
        model.register_comm_hook(state, stragglar_hook)
        train(model, rank, n, delay=True)
        state.close()
        for p, q in zip(plain.parameters(), model.parameters()):
            assert torch.allclose(p, q, atol=1e-5, rtol=1e-5), f"{mode}: parameters differ {(p - q).abs().max()}"
        decisions = [d.straggler for d in state.decisions]
        everyone = [None] * n
        dist.all_gather_object(everyone, decisions)
        assert all(d == decisions for d in everyone), f"{mode}: ranks disagree {everyone}"
        results[mode] = decisions
    persistent, eager = results["persistent"], results["eager"]
    assert eager == [late_rank(s, n) for s in range(STEPS)], f"eager picked {eager}"
    assert persistent[: 4] == [None] * 4, persistent  # window not yet full: library AllReduce
    assert 1 in persistent[: STEPS // 2 + 1], persistent
    assert persistent[-1] == n - 1, f"persistent mode did not follow the move: {persistent}"
    if rank == 0:
        print(f"persistent={persistent}\neager={eager}", flush=True)
    print(f"rank {rank}: ddp ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing()  # torch's gloo threads can abort a finished process at exit
