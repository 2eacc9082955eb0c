"""The job's layout (dp, tp, cp, pp, this rank's place) read from the model's wrapper and DeviceMesh.

A tensor- or context-parallel rank is a worker of its own in the op table (as the Kineto reader
places them): its `dp_rank` column is the worker index ((dp_rank·cp + cp_rank)·tp + tp_rank),
so every rank of a stage has its own column and a collective names the ranks it synchronises
in its `pg` column (record/modelparallel.py).
"""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from stragglers.errors import InputError

# DeviceMesh dimension names that mean data parallelism (torchtitan's and the FSDP2 docs' names).
DP_DIM_NAMES = ("dp", "dp_replicate", "dp_shard", "dp_shard_cp", "replicate", "shard", "fsdp",
                "ddp", "hsdp", "dp_shard_mod_ep", "efsdp")
# Expert-parallel dims: data parallel for the dense layers (each rank its own tokens), the
# experts split over them (torchtitan carves ep out of dp_shard: dp_shard_in_ep × cp)
EP_DIM_NAMES = ("ep", "expert", "dp_shard_in_ep")
TP_DIM_NAMES = ("tp", "tensor")
CP_DIM_NAMES = ("cp", "context", "sp")
PP_DIM_NAMES = ("pp", "pipeline")
KNOWN_DIM_NAMES = DP_DIM_NAMES + EP_DIM_NAMES + TP_DIM_NAMES + CP_DIM_NAMES + PP_DIM_NAMES
# Why a context-parallel dimension is refused (checked on torch 2.13, CPU, gloo; see README)
CP_REFUSAL = (
    "its DeviceMesh {dims} has a context-parallel dimension of size {cp}: not recorded, because "
    "torch {torch} cannot train with context parallelism on CPU, where the recording would be "
    "built and tested: ring attention (context_parallel) has rules for the CUDA flash, "
    "efficient and cuDNN attention kernels only (CPU attention: no sharding strategy for "
    "aten._scaled_dot_product_flash_attention_for_cpu; the math kernel mixes DTensor and "
    "Tensor), and flex_attention's variant fails in backward (FlexAttention does not support "
    "backward on CPU)")


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
    tp_rank: int = 0
    cp_rank: int = 0
    mesh: dict[str, int] | None = None  # the DeviceMesh's dims {name: size}, where there is one
    notes: list[str] = field(default_factory=list)
    pp_size: int = 1             # pipeline stages (the mesh's pp dim; the schedule's group)
    pp_rank: int = 0
    ep_size: int = 1             # the mesh's expert-parallel dims (inside dp_size)
    ep_rank: int = 0

    def places(self) -> dict[str, int]:
        """This rank's place along the mesh's dims, for its layout entry."""
        out = {"replica": self.dp_rank, "tp_rank": self.tp_rank, "cp_rank": self.cp_rank}
        return {**out, "ep_rank": self.ep_rank} if self.ep_size > 1 else out

    @property
    def workers(self) -> int:
        """Workers (op-table columns) per pipeline stage: every data-, tensor- and
        context-parallel rank."""
        return self.dp_size * self.tp_size * self.dsp_size

    @property
    def worker(self) -> int:
        """This rank's column: (dp_rank·cp + cp_rank)·tp + tp_rank."""
        return (self.dp_rank * self.dsp_size + self.cp_rank) * self.tp_size + self.tp_rank


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
    mesh = _parameter_mesh(model)
    if mesh is not None:  # tensor parallel without a data-parallel wrapper
        layout = _fill(_mesh_layout("none", model, mesh, world, rank))
        if layout.dp_size > 1:
            layout.notes.append(f"{layout.dp_size} data-parallel replicas without a "
                                "DistributedDataParallel or fully_shard wrapper: gradient "
                                "communication is not recorded")
        return layout
    layout = JobLayout("none", model, world, rank, world, rank)
    if world > 1:
        layout.notes.append("no DistributedDataParallel or fully_shard wrapper found: gradient "
                            "communication is not recorded (it shows as launch delay before the "
                            "optimizer); each rank is taken as one data-parallel replica")
    return layout


def _parameter_mesh(model: nn.Module):
    """The DeviceMesh the layout is read from: of the parameters' meshes and their roots, one
    whose dims are all modelled, spanning the most ranks (then with the most tensor, context
    and pipeline dims; the root first). Else the first parameter's root, refused by its dims.

    A mesh sliced from an N-D mesh has that mesh as its root (the whole job's); one
    unflattened from a 1-D world mesh (torch's `_unflatten`, as torchtitan builds its dense
    and expert meshes) has the 1-D mesh as its root, whose one dim names nothing we model,
    while the parameters' own meshes name the dims ("fsdp", "tp")."""
    meshes: dict[int, object] = {}
    first = None
    for p in model.parameters():
        mesh = getattr(p, "device_mesh", None)
        if mesh is None or id(mesh) in meshes:
            continue
        root = mesh._get_root_mesh() if hasattr(mesh, "_get_root_mesh") else None
        for m in (root, mesh):
            if m is not None:
                meshes.setdefault(id(m), m)
        if first is None:
            first = root if root is not None else mesh
    modelled = [m for m in meshes.values() if _modelled(m)]
    if not modelled:
        return first
    return max(modelled, key=lambda m: (m.size(), _model_dims(m), m.ndim))  # type: ignore


def _modelled(mesh) -> bool:
    """Whether every dim of the mesh has a name we model (unnamed: a 1-D or 2-D FSDP mesh)."""
    if mesh.mesh_dim_names is None:
        return mesh.ndim <= 2
    return all(n in KNOWN_DIM_NAMES for n in mesh.mesh_dim_names)


def _model_dims(mesh) -> int:
    """The mesh's tensor-, context- and pipeline-parallel dims."""
    return sum(n in TP_DIM_NAMES + CP_DIM_NAMES + PP_DIM_NAMES
               for n in mesh.mesh_dim_names or ())


def _fsdp2_layout(model: nn.Module, world: int, rank: int) -> JobLayout:
    mesh = _parameter_mesh(model)
    if mesh is None:
        return JobLayout("fsdp2", model, world, rank, world, rank)
    return _mesh_layout("fsdp2", model, mesh, world, rank)


def _mesh_layout(wrapper: str, model: nn.Module, mesh, world: int, rank: int,
                 pipelined: bool = False) -> JobLayout:
    """dp (replicate × shard dims), tp, cp and (`pipelined`: the schedule's stages) pp from the
    mesh's named dims; others refused."""
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    dims = dict(zip(names, (int(n) for n in mesh.shape)))
    dp = tp = cp = pp = ep = 1
    dp_rank = tp_rank = cp_rank = pp_rank = ep_rank = 0
    for i, name in enumerate(names):
        size, local = mesh.size(i), mesh.get_local_rank(i)
        if name in TP_DIM_NAMES:
            tp, tp_rank = tp * size, tp_rank * size + local
        elif name in CP_DIM_NAMES:
            cp, cp_rank = cp * size, cp_rank * size + local
        elif name in PP_DIM_NAMES:
            if size > 1 and not pipelined:
                raise InputError("attach", "model", f"its DeviceMesh {dims} has a pipeline "
                                 f"dimension {name!r} of size {size}: a module is one stage; "
                                 "pass the pipelining schedule instead (attach(schedule, "
                                 "optimizer, out) records FSDP2 + TP + PP)")
            pp, pp_rank = pp * size, pp_rank * size + local
        elif (name in DP_DIM_NAMES or name in EP_DIM_NAMES
              or (mesh.mesh_dim_names is None and mesh.ndim <= 2)):
            # unnamed dims of a 1-D or 2-D FSDP mesh are data parallel (replicate × shard)
            dp_rank = dp_rank * size + local
            dp *= size
            if name in EP_DIM_NAMES:
                ep, ep_rank = ep * size, ep_rank * size + local
        else:
            known = ", ".join(KNOWN_DIM_NAMES)
            raise InputError("attach", "model", f"its DeviceMesh {dims} has a dimension "
                             f"{name!r} the recorder does not model; expected names among "
                             f"{known}")
    if cp > 1:
        raise InputError("attach", "model", CP_REFUSAL.format(dims=dims, cp=cp,
                                                              torch=torch.__version__))
    if world % (tp * cp * pp):
        what = "tensor" if cp == 1 else "tensor × context"
        what += " × pipeline" if pp > 1 else ""
        raise InputError("attach", "tp_size", f"the {what}-parallel degree {tp * cp * pp} "
                         f"(DeviceMesh {dims}) does not divide the world size {world}")
    return JobLayout(wrapper, model, dp, dp_rank, world, rank, tp_size=tp, dsp_size=cp,
                     tp_rank=tp_rank, cp_rank=cp_rank, mesh=dims, pp_size=pp, pp_rank=pp_rank,
                     ep_size=ep, ep_rank=ep_rank)


def _fill(layout: JobLayout) -> JobLayout:
    """Ranks outside the data-parallel group would be layers attach cannot see: refuse."""
    if layout.workers * layout.pp_size != layout.world_size:
        what = "data parallelism" if layout.mesh is None else f"the DeviceMesh {layout.mesh}"
        raise InputError("attach", "model", f"{what} spans {layout.workers * layout.pp_size} "
                         f"of the {layout.world_size} ranks; attach records jobs whose other "
                         "ranks it can place (pipelining: record the schedule; otherwise use "
                         "Recorder)")
    return layout


def pipeline_layout(stages: list, pp: int, world: int, rank: int) -> JobLayout:
    """The layout of a pipelining job: pp from the schedule's group, dp / tp inside each stage
    from its parameters' DeviceMesh (FSDP2 and tensor parallelism, torchtitan's 3-D shape)."""
    module = stages[0].submod
    _refuse_unknown_wrappers(module)
    mesh = _parameter_mesh(module)
    if mesh is None:
        if pp != world:
            raise InputError("attach", "model", f"the pipeline group has {pp} of {world} ranks "
                             "and its stages hold no DeviceMesh parameters: data parallelism "
                             "around a stage without a DeviceMesh (DDP, a second process group) "
                             "is not recorded; FSDP2 / tensor parallelism on a DeviceMesh with "
                             "a 'pp' dimension is")
        return JobLayout("none", module, 1, 0, world, rank, pp_size=pp, pp_rank=rank)
    layout = _mesh_layout("fsdp2" if fsdp2_units(module) else "none", module, mesh, world, rank,
                          pipelined=True)
    if layout.pp_size != pp:
        raise InputError("attach", "model", f"the pipeline group has {pp} ranks but the stages' "
                         f"DeviceMesh {layout.mesh} has {layout.pp_size} along a pipeline "
                         f"dimension (expected one named among {', '.join(PP_DIM_NAMES)})")
    return _fill(layout)


def agree(failure: BaseException | None) -> None:
    """Raise on every rank if attach failed on any (a collective over the world).

    Called after a rank's checks and before attach's first collective: a rank whose layout is
    fine would otherwise wait there for a refusing peer until gloo gives up on it, and print a
    traceback ("Connection closed by peer") for what is one bad input (a mesh over part of the
    world leaves the ranks outside it nothing to refuse)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if failure is not None:
            raise failure
        return
    from stragglers.errors import StragglersError
    from stragglers.record.clock import control_channel, gather_objects

    said = None if failure is None else (
        str(failure) if isinstance(failure, StragglersError)
        else f"{type(failure).__name__}: {failure}")
    every = gather_objects(said, control_channel(None))
    if failure is not None:
        raise failure
    for rank, message in enumerate(every):
        if message is not None:
            first = str(message).splitlines()[0] if str(message) else "refused"
            raise InputError("attach", None, f"rank {rank} refused the job: {first}")
