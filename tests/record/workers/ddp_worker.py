"""A tiny DDP job whose gradient buckets are recorded through Recorder.ddp_comm_hook."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))
from launch import exit_without_finalizing  # noqa: E402  (examples/launch.py)
from stragglers.record import Recorder  # noqa: E402
from stragglers.trace.model import JobMeta


def main(trace_dir: str, steps: int) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                          nn.Linear(512, 256))  # three ~0.5-1 MB weights
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.25)  # several buckets
    meta = JobMeta(name="ddp", dp_size=world, pp_size=1)
    with Recorder(trace_dir, meta, dp_rank=rank, stage=0, flush_interval_s=0.05) as rec:
        ddp.register_comm_hook(None, rec.ddp_comm_hook())
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for step in range(steps):
            with rec.step(step):
                x = torch.randn(8, 256, generator=torch.Generator().manual_seed(rank * 100 + step))
                with rec.op("forward-compute", 0):
                    loss = ddp(x).pow(2).mean()
                with rec.op("backward-compute", 0):
                    loss.backward()
                with rec.op("optimizer"):
                    opt.step()
                    opt.zero_grad()
    # the replicas must still agree: the hook returned the averaged gradients
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], g) for g in gathered), "replicas diverged"
    Path(trace_dir, f"ok-{rank}").write_text("ok")
    # Teardown order: the recorder (its threads joined) is closed above; DDP's reducer holds the
    # process group and the comm hook, so it goes before the group does.
    del ddp, opt
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
    exit_without_finalizing()  # examples/launch.py: no rare gloo abort at shutdown
