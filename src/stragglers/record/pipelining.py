"""Record a torch.distributed.pipelining job per schedule action (F, B or I, W; sends, receives).

`attach(schedule, optimizer, out=...)` lands here (see _attach.py). What is recorded, and how:
- a step: from the schedule's `step()` call to the end of `optimizer.step()`;
- forward-compute / backward-compute / backward-weight-compute per microbatch and stage: the
  stage's `forward_one_chunk`, `backward_one_chunk` (a full backward B, or the input half I of
  a split one) and `backward_weight_one_chunk` (W), wrapped on the stage object;
- every activation / gradient send and receive: the P2POps the stage's `get_{fwd,bwd}_{send,
  recv}_ops` return are re-pointed at the Recorder's `isend`/`irecv`, so each row spans the
  post to the completion of that transfer, whether the schedule posts it alone or batched;
- the optimizer step (step hooks) and GC pauses (the Recorder);
- with FSDP2 and tensor parallelism inside the stages (torchtitan's 3-D shape: a DeviceMesh
  with a pp dimension, each stage's module parallelised over its dp and tp dimensions), the
  tensor-parallel collectives and FSDP2's all-gathers / reduce-scatters as attach records them
  on a module (modelparallel.py, fsdp.py): the compute of an action is cut around each.
Rows carry the microbatch and the local chunk (mc); compute rows carry their global stage index
in gmc, transfer rows the peer's, so the what-if model pairs each transfer with its peer and
its compute exactly and follows the schedule's own order (whatif/dependencies.py).

Torch internals relied on (checked at attach; torch 2.13 is the version this was built on): the
schedule's `_stage` / `_stages`, `_has_backward`, `_comp_type_to_function_map` (custom action
functions would bypass the stage) and the stage's `stage_index`, `num_stages`, `group`, the six
methods above with their 2.13 signatures, and that non-coalescing backends (gloo) post a P2POp
by calling its `op` attribute.
"""

from __future__ import annotations

import logging
import os
import socket
import weakref
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from stragglers.errors import InputError
from stragglers.record import modelparallel
from stragglers.record.layout import JobLayout, agree, fsdp2_units, pipeline_layout
from stragglers.record.lifecycle import ClosesOnExit
from stragglers.record.modelparallel import Collectives
from stragglers.record.recorder import Recorder
from stragglers.record.settings import RecorderConfig
from stragglers.record.spans import ComputeSpan
from stragglers.trace.model import OPTYPE_CODES, JobMeta

log = logging.getLogger(__name__)

# Schedules whose every action reaches the stage through the wrapped methods (torch 2.13).
KNOWN_SCHEDULES = ("ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleLoopedBFS",
                   "ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
_STAGE_METHODS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk",
                  "get_fwd_recv_ops", "get_bwd_recv_ops", "get_fwd_send_ops", "get_bwd_send_ops")
# stage method → (op type, Recorder post, the peer stage's offset from this stage)
_P2P = {"get_fwd_recv_ops": ("forward-recv", "irecv", -1),
        "get_bwd_recv_ops": ("backward-recv", "irecv", +1),
        "get_fwd_send_ops": ("forward-send", "isend", +1),
        "get_bwd_send_ops": ("backward-send", "isend", -1)}
_ATTACHED: "weakref.WeakSet" = weakref.WeakSet()
FWD, BWD, BWD_W = (OPTYPE_CODES[n] for n in ("forward-compute", "backward-compute",
                                              "backward-weight-compute"))


def is_pipeline_schedule(obj) -> bool:
    """Whether obj is a torch.distributed.pipelining schedule (without importing pipelining)."""
    import sys

    mod = sys.modules.get("torch.distributed.pipelining.schedules")
    return mod is not None and isinstance(obj, mod._PipelineSchedule)


def schedule_stages(schedule) -> list:
    """The stages this rank runs, in the schedule's order (refuses what cannot be recorded)."""
    from torch.distributed.pipelining import schedules as sch

    kind = type(schedule)
    if kind.__name__ not in KNOWN_SCHEDULES or kind.__module__ != sch.__name__:
        raise InputError("attach", "model", f"{kind.__name__} is not a pipelining schedule the "
                         f"recorder knows (known: {', '.join(KNOWN_SCHEDULES)}); its actions "
                         "could not be recorded correctly")
    if not getattr(schedule, "_has_backward", False):
        raise InputError("attach", "model", f"{kind.__name__} has no loss_fn: a forward-only "
                         "schedule is not a training step")
    if getattr(schedule, "_comp_type_to_function_map", None):
        raise InputError("attach", "model", f"{kind.__name__} has custom action functions "
                         "(register_custom_function): those actions bypass the stage and would "
                         "go unrecorded")
    stages = list(getattr(schedule, "_stages", None) or [getattr(schedule, "_stage", None)])
    if not stages or any(s is None for s in stages):
        raise InputError("attach", "model", f"{kind.__name__} holds no stages (torch "
                         f"{torch.__version__}: expected `_stage` or `_stages`)")
    for s in stages:
        missing = [m for m in _STAGE_METHODS + ("stage_index", "num_stages", "group")
                   if not hasattr(s, m)]
        if missing:
            raise InputError("attach", "model", f"pipeline stage lacks {', '.join(missing)} (torch "
                             f"{torch.__version__}); cannot record its actions")
    return stages


class AttachedPipeline(ClosesOnExit):
    """The wrappers `attach` installed on one rank's pipeline stages, and the Recorder they feed."""

    def __init__(self, schedule, optimizer: torch.optim.Optimizer, out: Path, *, name: str,
                 sample_every: int, overwrite: bool, enabled: bool, extra: dict,
                 flush_interval_s: float):
        if not (dist.is_available() and dist.is_initialized()):
            raise InputError("attach", "model", "a pipelining schedule needs an initialised "
                             "process group (launch with torchrun)")
        try:
            stages, group, rank, layout = _checked(schedule, optimizer)
            failure: Exception | None = None
        except Exception as exc:  # told to every rank: none is left waiting for this one
            failure = exc
        agree(failure)
        self.schedule, self.optimizer, self.stages = schedule, optimizer, stages
        self.layout = layout
        index = sorted(s.stage_index for s in stages)
        self._mc = {si: index.index(si) for si in index}       # local chunk of each stage
        meta = _job_meta(schedule, stages, layout, name, extra)
        config = RecorderConfig(sample_every=sample_every, flush_interval_s=flush_interval_s,
                                enabled=enabled, overwrite=overwrite)
        self.recorder = rec = Recorder(out, meta, dp_rank=layout.worker, stage=rank,
                                       config=config, device=stages[0].device)
        self.compute = ComputeSpan(rec)
        # the stages' TP / FSDP2 collectives (a DeviceMesh inside them)
        self.collectives: Collectives | None = None
        if layout.mesh is not None:
            rec.layout_extra.update(layout.places())
            self.collectives = Collectives(rec, self.compute, {"tp": layout.tp_size,
                                                               "cp": layout.dsp_size})
            # tensor-parallel collectives are rows inside a stage's actions only: the schedule's
            # first step also runs each stage once to infer shapes, outside any action
            self.collectives.paused = True
        self._restore: list = []
        self._step = 0
        self._span: Any = None  # the open step (Recorder.step context), sampled or not
        self._opt: Any = None   # the open optimizer op
        self._handles: list = []
        self._closed = False
        self.recorder.start()
        if not enabled:
            self._closed = True
            return
        _ATTACHED.add(schedule)
        for s in stages:
            _ATTACHED.add(s)
        self._install()
        if self.collectives is not None:
            self._install_model_parallel()

    # ---- lifecycle -------------------------------------------------------------------------

    def _release(self, collective: bool) -> None:
        """Remove the method wrappers, flush, and close the Recorder (a collective)."""
        if self.collectives is not None:
            self.collectives.paused = True
        for undo in self._restore:
            undo()
        self._restore.clear()
        for obj, attr in [(s, m) for s in self.stages for m in _STAGE_METHODS] + [(self.schedule, "step")]:
            obj.__dict__.pop(attr, None)  # the class's method shows through again
        _ATTACHED.discard(self.schedule)
        for s in self.stages:
            _ATTACHED.discard(s)
        if self._span is not None:
            self.recorder.drop_step()  # a step cut by close() has no optimizer end: dropped
            self._span = None
        self.recorder.close(collective=collective)

    @property
    def steps_seen(self) -> int:
        """Optimizer steps seen since attach (sampled or not)."""
        return self._step

    # ---- wrappers --------------------------------------------------------------------------

    def _install(self) -> None:
        step = self.schedule.step

        def scheduled_step(*args, **kwargs):
            # The first step opens at its first action: before it the schedule infers shapes,
            # running each stage once outside any action (with FSDP2, gathers no later step
            # has: rows that would leave every later step without step 0's keys).
            if self._span is None and self._step > 0:
                self._begin_step()
            return step(*args, **kwargs)

        self.schedule.step = scheduled_step
        for s in self.stages:
            self._wrap_stage(s)
        self._handles += [self.optimizer.register_step_pre_hook(self._opt_pre),
                          self.optimizer.register_step_post_hook(self._opt_post)]

    def _begin_step(self) -> None:
        """Open the step's span (sampled or not) unless it is open."""
        if self._span is None:
            self._span = self.recorder.step(self._step)
            self._span.__enter__()

    def _install_model_parallel(self) -> None:
        """Record the stages' tensor-parallel collectives and FSDP2 comms (a DeviceMesh)."""
        from stragglers.record.fsdp import install_fsdp2

        coll = self.collectives
        if coll is None:  # only called where the stages hold a DeviceMesh
            return
        self._restore.append(modelparallel.install(coll))
        units = [u for s in self.stages for u in fsdp2_units(s.submod)]
        if units:
            self._restore += install_fsdp2(coll, units)
        if self.layout.tp_size * self.layout.dsp_size > 1:
            coll.record_pg()

    def _wrap_stage(self, stage) -> None:
        gmc = int(stage.stage_index)
        mc = self._mc[gmc]
        for method, code in (("forward_one_chunk", FWD), ("backward_one_chunk", BWD),
                             ("backward_weight_one_chunk", BWD_W)):
            setattr(stage, method, self._compute_wrapper(getattr(stage, method), code, mc, gmc))
        for method, (optype, post, offset) in _P2P.items():
            setattr(stage, method, self._p2p_wrapper(getattr(stage, method), optype, post, mc,
                                                     gmc + offset))

    def _compute_wrapper(self, fn, code: int, mc: int, gmc: int):
        """A stage action recorded as one compute op (a piece per cut where a tensor-parallel
        collective or an FSDP2 wait blocks it)."""
        rec, compute, coll = self.recorder, self.compute, self.collectives

        def wrapped(chunk_id, *args, **kwargs):
            self._begin_step()
            if rec.buffer is None:
                return fn(chunk_id, *args, **kwargs)
            compute.open(code, chunk_id, mc, gmc)
            if coll is not None:
                coll.paused = False
            try:
                return fn(chunk_id, *args, **kwargs)
            finally:
                if coll is not None:
                    coll.paused = True
                compute.close()

        return wrapped

    def _p2p_wrapper(self, get_ops, optype: str, post: str, mc: int, peer_gmc: int):
        rec = self.recorder
        post_fn = getattr(rec, post)

        def wrapped(chunk_id, *args, **kwargs):
            self._begin_step()
            ops = get_ops(chunk_id, *args, **kwargs)
            for p in ops:
                # The schedule posts each op by calling p.op (gloo posts batched ops one by one
                # too); pointing it at the Recorder records the transfer and posts the same one.
                def op(*_a, _p=p, **_k):
                    work = post_fn(_p.tensor, _p.peer, optype, group=_p.group, tag=_p.tag)
                    code, _mb, _mc, _gmc, nbytes = work.row
                    # gmc of a transfer row: the peer's stage (docs/trace-formats.md §1)
                    work.row = (code, int(chunk_id), mc, peer_gmc, nbytes)
                    return work
                p.op = op
            return ops

        return wrapped

    def _opt_pre(self, optimizer, args, kwargs):
        if self._span is not None:
            self._opt = self.recorder.op("optimizer")
            self._opt.__enter__()

    def _opt_post(self, optimizer, args, kwargs):
        if self._opt is not None:
            self._opt.__exit__(None, None, None)
            self._opt = None
        if self._span is not None:
            self._span.__exit__(None, None, None)
            self._span = None
            self._step += 1


def _check_optimizer(optimizer, stages) -> None:
    """The optimizer must hold every trainable parameter of this rank's stages."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputError("attach", "optimizer", f"expected one torch.optim.Optimizer over this "
                         f"rank's stages, got {type(optimizer).__name__}")
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for s in stages:
        own = [p for p in s.submod.parameters() if p.requires_grad]
        if own and not any(id(p) in held for p in own):
            raise InputError("attach", "optimizer", f"holds none of pipeline stage "
                             f"{s.stage_index}'s parameters; pass the optimizer that steps "
                             "every stage of this rank")


def _checked(schedule, optimizer) -> tuple[list, Any, int, JobLayout]:
    """(stages, pipeline group, this rank's place in it, layout), or InputError."""
    stages = schedule_stages(schedule)
    _check_optimizer(optimizer, stages)
    if schedule in _ATTACHED or any(s in _ATTACHED for s in stages):
        raise InputError("attach", "model", "this schedule already has a recorder attached; "
                         "attach once per job (close() the first one to attach again)")
    group = stages[0].group
    pp = dist.get_world_size(group)
    rank = dist.get_rank(group)
    layout = pipeline_layout(stages, pp, dist.get_world_size(), dist.get_rank())
    backend = group._get_backend(stages[0].device) if hasattr(group, "_get_backend") else None
    if backend is not None and getattr(backend, "supports_coalescing", False):
        raise InputError("attach", "model", f"the pipeline group's backend "
                         f"({dist.get_backend(group)}) coalesces batched sends/recvs; "
                         "per-transfer recording is implemented for gloo only")
    return stages, group, rank, layout


def _job_meta(schedule, stages, layout: JobLayout, name: str, extra: dict) -> JobMeta:
    """The job's metadata: each data- / tensor-parallel rank of a stage is a worker (column) of
    its own; the schedule, its stages and (3-D) the mesh and parallel degrees in extra."""
    meta = JobMeta(name=name, dp_size=layout.workers, pp_size=layout.pp_size,
                   vpp_size=len(stages), world_size=layout.world_size, ep_size=layout.ep_size,
                   run_id=os.environ.get("TORCHELASTIC_RUN_ID", "0"))
    meta.extra.update({"recorded_by": "attach", "wrapper": "pipelining",
                       "pipeline_schedule": type(schedule).__name__,
                       "pipeline_stages": int(stages[0].num_stages),
                       "n_microbatches": int(getattr(schedule, "_n_microbatches", 0)),
                       "stage_of_rank": _gather_stage_map(stages, stages[0].group)})
    if layout.mesh is not None:
        meta.extra.update({"mesh": layout.mesh, "stage_wrapper": layout.wrapper,
                           "parallel": {"dp": layout.dp_size, "tp": layout.tp_size,
                                        "cp": layout.dsp_size, "ep": layout.ep_size,
                                        "pp": layout.pp_size}})
    meta.extra.update(extra)
    return meta


def _gather_stage_map(stages, group) -> dict:
    """{global stage index: {"rank", "host"}} over the pipeline group (for the report; with
    data or tensor parallelism, rank 0's pipeline group: meta.extra["layout"] places every
    rank)."""
    mine = [(int(s.stage_index), dist.get_rank(), socket.gethostname()) for s in stages]
    every: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, mine, group=group)
    return {str(si): {"rank": r, "host": h} for part in every for si, r, h in part}


def attach_pipeline(schedule, optimizer: torch.optim.Optimizer, out: str | Path | None = None, *,
                    name: str | None = None, sample_every: int | None = None,
                    overwrite: bool = False, enabled: bool | None = None,
                    extra: dict | None = None, flush_interval_s: float = 1.0) -> AttachedPipeline:
    """Record this rank's pipeline schedule into `out` (a collective; `attach` calls this)."""
    from stragglers.record._attach import _job_name, launcher_settings

    enabled, out, every, overwrite = launcher_settings(enabled, out, name, sample_every, overwrite)
    return AttachedPipeline(schedule, optimizer, out, name=_job_name(name), sample_every=every,
                            overwrite=overwrite, enabled=enabled, extra=extra or {},
                            flush_interval_s=flush_interval_s)
