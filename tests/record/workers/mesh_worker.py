"""attach on DeviceMeshes torch builds but the examples do not: a tensor-parallel mesh over part
of the world (refused on every rank), expert-parallel dims and dims unflattened from a world
mesh (recorded).

    torchrun --nproc-per-node 4 mesh_worker.py CASE[,CASE...] OUT

Each case is recorded into OUT/CASE, one after another in the same processes (a job starts
several meshes and attaches more than once, as a test can that runs them all in one job).
"""

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

from stragglers.record import attach


class MLP(nn.Module):
    def __init__(self, ep_group=None):
        super().__init__()
        torch.manual_seed(0)
        self.w1, self.w2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.ep_group = ep_group

    def forward(self, x):
        y = self.w2(torch.relu(self.w1(x)))
        if self.ep_group is None:
            return y
        # a MoE layer's dispatch, in small: each rank sends a quarter of its rows to each peer
        flat = (y.to_local() if hasattr(y, "to_local") else y).reshape(-1, 16)
        out = torch.empty_like(flat)
        dist.all_to_all_single(out, flat.contiguous(), group=self.ep_group)
        return y + 0 * out.sum()


def tp(model, mesh):
    return parallelize_module(model, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})


def build(case: str, rank: int, world: int) -> nn.Module:
    if case == "part_mesh":  # a tensor-parallel degree 3 over ranks 0-2 of 4: rank 3 is outside
        mesh = DeviceMesh("cpu", [[0, 1, 2]], mesh_dim_names=("dp", "tp"))
        return tp(MLP(), mesh["tp"]) if rank < 3 else MLP()
    if case == "ep":  # experts over an "ep" dim, dense layers sharded over dp × ep
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "ep"))
        return fully_shard(MLP(mesh["ep"].get_group()), mesh=mesh["dp", "ep"]._flatten("dp_ep"))
    if case == "titan_ep":  # torchtitan's names: ep carved out of dp_shard, with tp
        mesh = init_device_mesh("cpu", (1, 2, world // 2),
                                mesh_dim_names=("dp_shard_mod_ep", "dp_shard_in_ep", "tp"))
        model = tp(MLP(mesh["dp_shard_in_ep"].get_group()), mesh["tp"])
        return fully_shard(model, mesh=mesh["dp_shard_mod_ep", "dp_shard_in_ep"]._flatten("dp"))
    if case == "unflatten":  # torchtitan's current shape: dims unflattened from a world mesh
        world_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("world",))
        dense = world_mesh._unflatten(0, (2, world // 2), ("fsdp", "tp"))
        return fully_shard(tp(MLP(), dense["tp"]), mesh=dense["fsdp"])
    raise SystemExit(f"unknown case {case}")


def record(case: str, out: Path) -> None:
    model = build(case, dist.get_rank(), dist.get_world_size())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with attach(model, opt, out):
        for step in range(2):
            x = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(step))
            y = model(x)
            (y.full_tensor() if hasattr(y, "full_tensor") else y).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    # the model goes before the next case (FSDP2's hooks form cycles, hence the collect)
    del model, opt, y
    gc.collect()


def main() -> None:
    cases, out = sys.argv[1].split(","), Path(sys.argv[2])
    dist.init_process_group("gloo")
    for case in cases:
        record(case, out / case)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
