"""The job's layout (dp, pp, tp, this rank's place) read from the model's wrapper and groups."""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass, field

import torch.distributed as dist
import torch.nn as nn

from stragglers.errors import InputError

# DeviceMesh dimension names that mean data parallelism (torchtitan's and the FSDP2 docs' names).
DP_DIM_NAMES = ("dp", "dp_replicate", "dp_shard", "dp_shard_cp", "replicate", "shard", "fsdp",
                "ddp", "hsdp")
TP_DIM_NAMES = ("tp", "tensor")
CP_DIM_NAMES = ("cp", "context", "sp")


@dataclass
class JobLayout:
    """Where this rank sits in the job and what wraps the model."""

    wrapper: str                 # "ddp", "fsdp2" or "none"
    inner: nn.Module             # the module whose forward is one microbatch
    dp_size: int
    dp_rank: int
    world_size: int
    rank: int
    tp_size: int = 1
    dsp_size: int = 1
    notes: list[str] = field(default_factory=list)


def fsdp2_units(model: nn.Module) -> list[nn.Module]:
    """The modules `fully_shard` was applied to (one all-gather and reduce-scatter each)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _refuse_unknown_wrappers(model: nn.Module) -> None:
    """Wrappers whose communication would hide inside compute spans: refused, never mis-recorded."""
    name = type(model).__name__
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
            raise InputError("attach", "model", "is wrapped in FullyShardedDataParallel (FSDP1), "
                             "whose all-gathers block inside forward and would be recorded as "
                             "compute; use fully_shard (FSDP2) or time the loop with Recorder")
    except ImportError:  # pragma: no cover
        pass
    if isinstance(model, nn.DataParallel):
        raise InputError("attach", "model", "is wrapped in nn.DataParallel (one process, several "
                         "devices): attach records one process per rank; use "
                         "DistributedDataParallel")
    if not isinstance(model, nn.Module):
        raise InputError("attach", "model", f"expected a torch.nn.Module, got {name}")


def _refuse_pipeline_stages(model: nn.Module) -> None:
    """A torch.distributed.pipelining stage's module: attach would take stages for replicas."""
    if "torch.distributed.pipelining" not in sys.modules:
        return  # no pipelining in this process: nothing to look for
    from torch.distributed.pipelining.stage import _PipelineStageBase

    def stage_of(obj) -> bool:
        return isinstance(obj, _PipelineStageBase) or (
            isinstance(obj, dict) and any(isinstance(r, _PipelineStageBase)
                                          for r in gc.get_referrers(obj)))

    if isinstance(model, _PipelineStageBase) or any(stage_of(r) for r in gc.get_referrers(model)):
        raise InputError("attach", "model", "belongs to a torch.distributed.pipelining stage; "
                         "pass the schedule instead: attach(schedule, optimizer, out=...) "
                         "records it per action")


def read_layout(model: nn.Module) -> JobLayout:
    """The layout of this rank: from DDP's process group, FSDP2's DeviceMesh, or the world."""
    _refuse_unknown_wrappers(model)
    _refuse_pipeline_stages(model)
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    if isinstance(model, nn.parallel.DistributedDataParallel):
        group = model.process_group
        dp, dp_rank = dist.get_world_size(group), dist.get_rank(group)
        return _fill(JobLayout("ddp", model.module, dp, dp_rank, world, rank))
    units = fsdp2_units(model)
    if units:
        return _fill(_fsdp2_layout(model, world, rank))
    layout = JobLayout("none", model, world, rank, world, rank)
    if world > 1:
        layout.notes.append("no DistributedDataParallel or fully_shard wrapper found: gradient "
                            "communication is not recorded (it shows as launch delay before the "
                            "optimizer); each rank is taken as one data-parallel replica")
    return layout


def _fsdp2_layout(model: nn.Module, world: int, rank: int) -> JobLayout:
    mesh = None
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is not None:
            break
    if mesh is None:
        return JobLayout("fsdp2", model, world, rank, world, rank)
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    dp = tp = cp = 1
    dp_rank = 0
    for i, name in enumerate(names):
        size, local = mesh.size(i), mesh.get_local_rank(i)
        if name in TP_DIM_NAMES:
            tp *= size
        elif name in CP_DIM_NAMES:
            cp *= size
        else:  # unnamed dims of a 1-D or 2-D FSDP mesh are data parallel (replicate × shard)
            dp_rank = dp_rank * size + local
            dp *= size
    layout = JobLayout("fsdp2", model, dp, dp_rank, world, rank, tp_size=tp, dsp_size=cp)
    if tp > 1 or cp > 1:
        raise InputError("attach", "model", f"its DeviceMesh {dict(zip(names, mesh.shape))} has "
                         "tensor/context-parallel dimensions; attach records data-parallel "
                         "FSDP2 jobs (tp = cp = 1) for now")
    return layout


def _fill(layout: JobLayout) -> JobLayout:
    """Ranks outside the data-parallel group would be layers attach cannot see: refuse."""
    if layout.dp_size * layout.tp_size * layout.dsp_size != layout.world_size:
        raise InputError("attach", "model", f"data parallelism spans {layout.dp_size} of the "
                         f"{layout.world_size} ranks; attach records jobs whose other ranks it can "
                         "place (pipelining: record the schedule; otherwise use Recorder)")
    return layout
