"""A small DDP training loop on gloo profiled by torch.profiler: one Kineto trace per rank.

Usage (under torchrun): kineto_profile_ddp.py OUT_DIR [SLOW_RANK] [SLOW_FACTOR]
The slow rank does SLOW_FACTOR times the forward work (a compute straggler).
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile, schedule
sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from launch import exit_without_finalizing  # noqa: E402  (examples/launch.py)


def main() -> None:
    out = Path(sys.argv[1])
    slow_rank = int(sys.argv[2]) if len(sys.argv) > 2 else -1
    factor = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    repeat = factor if rank == slow_rank else 1
    x = torch.randn(256, 256)

    def export(prof) -> None:
        prof.export_chrome_trace(str(out / f"trace_rank-{rank}.json"))

    sched = schedule(wait=1, warmup=1, active=3)
    with profile(activities=[ProfilerActivity.CPU], schedule=sched, on_trace_ready=export) as prof:
        for _ in range(5):
            h = x
            for _ in range(repeat):  # the straggler's extra forward work
                h = torch.tanh(h @ torch.eye(256))
            loss = ddp(h).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            prof.step()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_finalizing()  # torch's gloo threads can abort a finished process at exit
