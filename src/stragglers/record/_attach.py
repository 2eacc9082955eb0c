"""One call per job: `attach(model, optimizer)` records a training loop without changing it.

What is recorded, and from where (see README.md):
- a step: from the first training forward after an optimizer step to the end of the next one
  (optimizer step hooks), so gradient accumulation gives several microbatches per step;
- forward-compute per microbatch: forward pre/post hooks of the model (training mode, grad on;
  evaluation and activation-checkpoint recomputation are not microbatches);
- backward-compute: from the first gradient reaching the model's output (a multi-grad hook) to
  the end of the backward pass (an autograd engine callback);
- DDP bucket all-reduces (a comm hook), FSDP2 per-unit all-gathers and reduce-scatters (custom
  comms wrapping FSDP2's own), the optimizer step, GC pauses (the Recorder's gc callback).
Where the training thread blocks on a recorded collective, the compute span is split around
the wait: compute rows hold compute only, waiting shows in the collective's row.
On the host clock (CPU) with a plain module or DDP, the backward and DDP stamps come from native
hooks (native.py: C++, no Python on their path) and forward is timed by a wrapper of the
module's forward instead of module hooks; the rows are the same, at a fraction of the cost.
"""

from __future__ import annotations

import copyreg
import math
import os
import sys
import time
import types
import warnings
import weakref
from pathlib import Path
from time import perf_counter_ns
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from stragglers.errors import InputError, StragglersError, one_line_if_uncaught
from stragglers.record import native as native_hooks
from stragglers.record.native import FAST, SKIP, SLOW
from stragglers.record.layout import JobLayout, agree, fsdp2_units, read_layout
from stragglers.record import modelparallel
from stragglers.record.lifecycle import ClosesOnExit
from stragglers.record.modelparallel import Collectives

if TYPE_CHECKING:
    from stragglers.record.pipelining import AttachedPipeline
from stragglers.record.recorder import Recorder
from stragglers.record.settings import RecorderConfig
from stragglers.record.spans import NO_SEQ, ComputeSpan
from stragglers.trace.model import OPTYPE_CODES, JobMeta

FWD, BWD, OPT = (OPTYPE_CODES[n] for n in ("forward-compute", "backward-compute", "optimizer"))
ENV_SWITCH = "STRAGGLERS_RECORD"          # "0"/"off" turns every attach() of the job off
ENV_DIR = "STRAGGLERS_RECORD_DIR"         # where the run goes (overrides `out`)
ENV_SAMPLE = "STRAGGLERS_RECORD_SAMPLE_EVERY"
ENV_OVERWRITE = "STRAGGLERS_RECORD_OVERWRITE"  # "1": replace an earlier run in the directory
_ATTACHED: "weakref.WeakKeyDictionary[nn.Module, Attached]" = weakref.WeakKeyDictionary()

SeqLens = Callable[..., Sequence[int] | None]


def attach(model: nn.Module, optimizer: torch.optim.Optimizer, out: str | Path | None = None, *,
           seq_lens: SeqLens | None = None, name: str | None = None, sample_every: int | None = None,
           overwrite: bool = False, enabled: bool | None = None, extra: dict | None = None,
           flush_interval_s: float = 1.0, device: torch.device | str | None = None,
           ) -> Attached | AttachedPipeline:
    """Record this rank's training loop into `out` (a collective: every rank calls it).

    `model` is what the loop calls (a plain module, DistributedDataParallel, or fully_shard);
    `seq_lens(*args, **kwargs)` gets each forward's inputs and returns the microbatch's sequence
    lengths (or None). Environment (the launcher form, `stragglers record -- torchrun ...`):
    STRAGGLERS_RECORD=0 turns recording off; STRAGGLERS_RECORD_DIR, STRAGGLERS_RECORD_SAMPLE_EVERY
    and STRAGGLERS_RECORD_OVERWRITE=1 override `out`, `sample_every` and `overwrite`.
    Use the result as a context manager, or call `.close()` before destroy_process_group().
    A refusal (InputError) left uncaught prints one line per rank, not a traceback.
    """
    try:
        return _attach(model, optimizer, out, seq_lens=seq_lens, name=name,
                       sample_every=sample_every, overwrite=overwrite, enabled=enabled,
                       extra=extra, flush_interval_s=flush_interval_s, device=device)
    except StragglersError as exc:
        one_line_if_uncaught(exc)
        raise


def _attach(model, optimizer, out, *, seq_lens, name, sample_every, overwrite, enabled, extra,
            flush_interval_s, device) -> Attached | AttachedPipeline:
    """`attach`'s work (its docstring)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputError("attach", "optimizer", f"expected a torch.optim.Optimizer, got "
                         f"{type(optimizer).__name__}")
    from stragglers.record.pipelining import attach_pipeline, is_pipeline_schedule
    if is_pipeline_schedule(model):  # a torch.distributed.pipelining schedule: per action
        return attach_pipeline(model, optimizer, out, name=name, sample_every=sample_every,
                               overwrite=overwrite, enabled=enabled, extra=extra,
                               flush_interval_s=flush_interval_s)
    try:
        layout = read_layout(model)
        for m in (model, layout.inner):
            if m in _ATTACHED:
                raise InputError("attach", "model", "already has a recorder attached; attach "
                                 "once per job (close() the first one to attach again)")
        failure: Exception | None = None
    except Exception as exc:  # told to every rank: none is left waiting for this one
        failure = exc
    agree(failure)
    enabled, out, every, overwrite = launcher_settings(enabled, out, name, sample_every, overwrite)
    for note in layout.notes:
        warnings.warn(f"stragglers.record.attach: {note}", stacklevel=3)
    return Attached(model, optimizer, layout, out, seq_lens=seq_lens, name=_job_name(name),
                    sample_every=every, overwrite=overwrite, enabled=enabled, extra=extra or {},
                    flush_interval_s=flush_interval_s, device=device)


def launcher_settings(enabled, out, name, sample_every, overwrite) -> tuple[bool, Path, int, bool]:
    """(enabled, out, sample_every, overwrite) with the launcher's environment switches applied."""
    env = os.environ.get(ENV_SWITCH, "").strip().lower()
    if enabled is None:
        enabled = env not in ("0", "off", "false", "no")
    out = Path(os.environ.get(ENV_DIR) or out or Path("runs") / _job_name(name))
    every = sample_every or 1
    if os.environ.get(ENV_SAMPLE):
        try:
            every = int(os.environ[ENV_SAMPLE])
        except ValueError:
            raise InputError(ENV_SAMPLE, None, f"expected an integer >= 1, got "
                             f"{os.environ[ENV_SAMPLE][:40]!r}") from None
    return enabled, out, every, overwrite or os.environ.get(ENV_OVERWRITE, "") == "1"


def _job_name(name: str | None) -> str:
    if name:
        return name
    script = Path(sys.argv[0]).stem if sys.argv and sys.argv[0] else ""
    return script or "job"


_CALL = "_stragglers_call"
_RECORDED_CLASSES: dict[type, type] = {}


def _recorded_class(cls: type, native) -> type:
    """The subclass of `cls` whose instances' calls go through their `_stragglers_call` (a
    native Forward: its __call__ is native too, no Python frame of ours per call)."""
    sub = _RECORDED_CLASSES.get(cls)
    if sub is None:
        sub = type(cls.__name__, (cls,), {"__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__,
                                          "__reduce_ex__": _reduce_unrecorded,
                                          "__call__": native.call_method()})
        _RECORDED_CLASSES[cls] = sub
    return sub


def _reduce_unrecorded(module: nn.Module, protocol: int):
    """A recorded module copies and pickles as its own class, unrecorded (an EMA copy made with
    copy.deepcopy, torch.save of the whole model), not as the recorder's subclass."""
    cls = type(module).__mro__[1]
    state = {k: v for k, v in module.__dict__.items() if k != _CALL}
    # copyreg's own reconstructor (what pickle protocols 0-1 use): a file that holds the model
    # loads without stragglers installed
    return copyreg._reconstructor, (cls, object, None), state  # type: ignore[attr-defined]


def _coarse_ddp_warning(exc: Exception) -> None:
    # DDP takes one comm hook, and the user has one already
    warnings.warn("stragglers.record.attach: DistributedDataParallel already has a comm "
                  f"hook ({exc}); gradient all-reduces are recorded coarsely: their "
                  "waiting shows as launch delay before the optimizer", stacklevel=5)


def _model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device if p.device.type != "meta" else torch.device("cpu")
    return torch.device("cpu")


class Attached(ClosesOnExit):
    """The hooks `attach` installed on one rank, and the Recorder they feed."""

    def __init__(self, model: nn.Module, optimizer, layout: JobLayout, out: Path, *,
                 seq_lens: SeqLens | None, name: str, sample_every: int, overwrite: bool,
                 enabled: bool, extra: dict, flush_interval_s: float, device):
        # Any: the hooks call DDP's and FSDP2's own methods, and close() lets go of the model
        self.model: Any = model
        self.optimizer, self.layout = optimizer, layout
        self._seq_fn: SeqLens | None = seq_lens
        # every tensor-/context-parallel rank is a worker (column) of its own, as the Kineto
        # reader places them: dp_size counts the workers, the parallel degrees are in extra
        meta = JobMeta(name=name, dp_size=layout.workers, pp_size=1,
                       world_size=layout.world_size, ep_size=layout.ep_size,
                       run_id=os.environ.get("TORCHELASTIC_RUN_ID", "0"))
        meta.extra.update({"recorded_by": "attach", "wrapper": layout.wrapper, **extra})
        if layout.mesh is not None:
            meta.extra.update({"mesh": layout.mesh, "parallel": {
                "dp": layout.dp_size, "tp": layout.tp_size, "cp": layout.dsp_size, "ep": layout.ep_size,
                "pp": 1}, "tp_size_implied": layout.tp_size})
        device = torch.device(device) if device is not None else _model_device(model)
        config = RecorderConfig(sample_every=sample_every, flush_interval_s=flush_interval_s,
                                enabled=enabled, overwrite=overwrite)
        self.recorder = rec = Recorder(out, meta, dp_rank=layout.worker, stage=0, config=config,
                                       device=device)
        if layout.mesh is not None:
            rec.layout_extra.update(layout.places())
        # the open compute span, and what the collective wrappers record into
        self.compute = ComputeSpan(rec)
        self.collectives = Collectives(rec, self.compute, {"tp": layout.tp_size,
                                                           "cp": layout.dsp_size})
        # a span's marks (the CPU timer's are perf_counter_ns, the GPU timer's CUDA events)
        self._mark = rec.mark
        self._step = 0
        self._first_step = 0        # steps before it are not recorded (DDP's bucket rebuild)
        self._open = False          # a step (sampled or not) has begun
        self._mb = 0                # forwards so far in this step
        self._stack: list[bool] = []  # per forward call: whether it counts as a microbatch
        self._in_bwd = False
        self._in_opt = False
        self._opt: tuple[int, int] | None = None  # open optimizer span: (start mark, gc index)
        self._handles: list = []
        self._bwd_hooks: list = []
        self._restore: list = []
        self._closed = False
        self._native: Any = None    # native.cpp's event log, when the native hooks are used
        self._fwd: Any = None       # the native Forward timing the module's calls
        rec.start()
        if not enabled:
            self._closed = True
            return
        if layout.wrapper in ("none", "ddp") and not rec.on_gpu:
            # GPU spans need CUDA events recorded on the stream, and FSDP2 splits the backward
            # around its waits in Python (ComputeSpan.blocked): those keep the Python hooks.
            self._native = native_hooks.stamps()
            self._native_module = native_hooks.load()
        _ATTACHED[model] = _ATTACHED[layout.inner] = self
        self._install()
        if layout.wrapper == "fsdp2":
            meta.extra["fsdp_units"] = len(fsdp2_units(model))
        if layout.tp_size * layout.dsp_size > 1:
            self.collectives.record_pg()

    # ---- lifecycle -------------------------------------------------------------------------

    def _release(self, collective: bool) -> None:
        """Undo the patches, flush, and close the Recorder (joins its threads; a collective)."""
        self.collectives.paused = True
        for undo in self._restore:
            undo()
        self._restore.clear()
        if self._native is not None:
            self._native.close()
        for m in (self.model, self.layout.inner):
            _ATTACHED.pop(m, None)
        if self._open:
            self.recorder.drop_step()  # a step cut by close() has no optimizer end: dropped
        self.recorder.close(collective=collective)
        # Shutdown order (README, Lifecycle): close() → free the model → destroy_process_group.
        # Nothing here may keep the model (and through it DDP/FSDP2 and their process group)
        # alive once the caller drops it.
        self._bwd_hooks.clear()
        self.compute.current = self._opt = None
        self.model = self.optimizer = self._seq_fn = None
        self.layout.inner = None  # type: ignore[assignment]  # closed: let go of the model

    # ---- hooks -----------------------------------------------------------------------------

    def _install(self) -> None:
        inner = self.layout.inner
        self._restore.append(modelparallel.install(self.collectives))
        if self._native is not None:
            self._restore.append(self._wrap_call(inner))
        else:
            self._handles += [
                inner.register_forward_pre_hook(self._fwd_pre, prepend=True, with_kwargs=True),
                inner.register_forward_hook(self._fwd_post, always_call=True),
            ]
        native = self._native is not None
        self._handles += [
            self.optimizer.register_step_pre_hook(self._opt_pre),
            self.optimizer.register_step_post_hook(self._opt_post_native if native else
                                                   self._opt_post),
        ]
        if self.layout.wrapper == "ddp":
            self._install_ddp()
        elif self.layout.wrapper == "fsdp2":
            from stragglers.record.fsdp import install_fsdp2

            self._restore += install_fsdp2(self.collectives, fsdp2_units(self.model))

    def _install_ddp(self) -> None:
        # DDP builds provisional buckets for its first step and rebuilds them after it: that
        # step's rows would not line up with the later steps', so recording starts at step 1.
        self._first_step = 1
        coll = self.collectives
        coll.pg_defaults[OPTYPE_CODES["grads-all-reduce"]] = coll.groups.of(
            self.model.process_group)[0]
        if self._native is not None:
            try:  # DDP's default all-reduce, stamped in C++ (native.cpp: TimedAllReduce)
                self._native.register_ddp(self.model.reducer, self.model.process_group)
            except RuntimeError as exc:
                _coarse_ddp_warning(exc)
            return
        recorded = self.recorder.ddp_comm_hook()
        # DDP keeps the hook for its lifetime (there is no unregister) in C++, where Python's
        # garbage collector cannot see it: a hook holding this Attached (which holds the
        # model) would keep DDP, its reducer and its process group alive forever. A weak
        # reference breaks that cycle, so `del model` frees DDP before destroy_process_group.
        me = weakref.ref(self)

        def hook(state, bucket):
            att = me()
            if att is None or att._closed:
                return recorded(state, bucket)  # the Recorder is closed: no row is made
            # A bucket is ready: the backward so far produced it. Splitting the backward span
            # here gives each all-reduce the compute it depends on (docs/whatif.md §3).
            seg = att.compute.current
            if seg is not None and seg[0] == BWD and att.recorder.buffer is not None:
                att.compute.close()
                att.compute.open(BWD, seg[1])
            return recorded(state, bucket)

        try:
            self.model.register_comm_hook(None, hook)
        except RuntimeError as exc:
            _coarse_ddp_warning(exc)

    def _wrap_call(self, module: nn.Module):
        """Time the module's calls by wrapping them (module hooks cost more); returns the undo.

        The module's class becomes a subclass whose __call__ runs the instance's native Forward
        (as fully_shard swaps its modules' classes): trainers that patch `forward` for one call
        (Lightning's forward redirection) are still seen. The Forward times a sampled step's
        microbatches in C++; what needs Python (sequence lengths, a closure inside
        optimizer.step, the first call of a step) comes back here.
        """
        cls = type(module)
        call = cls.__call__
        rec, mark, start = self.recorder, self._native.mark_backward, self._native.start
        now, Tensor, compute = time.perf_counter_ns, torch.Tensor, self.compute

        def slow(mb, args, kwargs):
            """A microbatch's forward in a step the native side cannot time alone."""
            buf = rec.buffer
            assert buf is not None  # the native side calls this in sampled steps only
            if self._seq_fn is not None:
                self._read_seq(mb, args, kwargs)
            if self._in_opt:
                self._opt = None  # a closure inside optimizer.step (see _opt_post)
            gc0 = len(buf.gc)
            t0 = now()
            try:
                output = call(module, *args, **kwargs)
            finally:  # also when forward raised, as an always_call hook would
                t1 = now()
                attn, tok = compute.seq.get(mb, NO_SEQ)
                rec.add_op(buf, gc0, (FWD, mb, 0, 0, attn, tok, -1), t0, t1)
            for t in ((output,) if isinstance(output, Tensor) else tree_leaves(output)):
                if isinstance(t, Tensor) and t.requires_grad and not mark(t, mb):
                    leaf_hook(t, mb)
            return output

        def leaf_hook(t, mb):  # an output with no node to hook: a tensor hook starts its span
            t.register_hook(lambda _grad: start(mb))

        self._fwd = self._native.forward(call, self._begin, slow, tree_leaves, leaf_hook)
        # not nn.Module.__setattr__: a plain attribute
        capsule = module.__dict__[_CALL] = self._native_module.capsule(self._fwd)
        self._set_mode, self._step_end = self._native_module.step_calls(capsule)
        module.__class__ = _recorded_class(cls, self._native_module)

        def undo():
            self._fwd.release()
            if type(module) is _recorded_class(cls, self._native_module):
                module.__class__ = cls
                module.__dict__.pop(_CALL, None)
            else:  # its class was changed again since (e.g. fully_shard): calls pass through
                module.__dict__[_CALL] = types.MethodType(call, module)

        return undo

    def _fwd_pre(self, module, args, kwargs):
        counts = module.training and torch.is_grad_enabled() and not self._in_bwd
        self._stack.append(counts and len(self._stack) == 0)
        if not self._stack[-1]:
            return None
        if not self._open:
            self._begin()
        if self.recorder.buffer is None:
            return None
        if self._seq_fn is not None:
            self._read_seq(self._mb, args, kwargs)
        if self._in_opt:
            self._opt = None  # a closure inside optimizer.step: its span restarts after backward
        self.compute.open(FWD, self._mb)
        return None

    def _read_seq(self, mb: int, args, kwargs) -> None:
        assert self._seq_fn is not None  # called only when seq_lens was given
        lens = self._seq_fn(*args, **kwargs)
        if lens is not None:
            lens = [int(s) for s in lens]
            self.compute.seq[mb] = (float(sum(s * s for s in lens)), int(sum(lens)))

    def _fwd_post(self, module, args, output):
        if not self._stack.pop():
            return None
        mb = self._mb
        self._mb += 1
        if self.recorder.buffer is None:
            return None
        self.compute.close()
        outs = [output] if isinstance(output, torch.Tensor) else tree_leaves(output)
        start = self._bwd_hooks[mb] if mb < len(self._bwd_hooks) else self._bwd_hook(mb)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                # A pre-hook on the node that produced the output runs when backward reaches
                # the model (the cheapest hook autograd offers: no tensor hook wrapper).
                if t.grad_fn is not None:
                    t.grad_fn.register_prehook(start)
                else:
                    t.register_hook(start)
        return None

    def _bwd_hook(self, mb: int):
        """The backward-start hook of microbatch `mb` (made once, reused every step)."""
        while len(self._bwd_hooks) <= mb:
            i = len(self._bwd_hooks)
            self._bwd_hooks.append(lambda *_grads, i=i: self._bwd_start(i))
        return self._bwd_hooks[mb]

    def _bwd_start(self, mb: int) -> None:
        if self._in_bwd or self.recorder.buffer is None:
            return  # one backward over several microbatches' losses: one span (the first's id)
        self._in_bwd = True
        self.compute.open(BWD, mb)
        torch.autograd.Variable._execution_engine.queue_callback(self._bwd_end)

    def _bwd_end(self) -> None:
        self._in_bwd = False
        if self.recorder.buffer is None:
            return
        self.compute.close()
        if self._in_opt:
            # A closure inside optimizer.step (Lightning): the optimizer's own work starts after
            # the backward's end-of-pass callbacks, DDP's wait for its all-reduces among them;
            # a callback queued now runs after those queued before it.
            torch.autograd.Variable._execution_engine.queue_callback(self._opt_restart)

    def _opt_restart(self) -> None:
        buf = self.recorder.buffer
        if self._in_opt and buf is not None:
            self._opt = (self._mark(), len(buf.gc))

    def _opt_pre(self, optimizer, args, kwargs):
        if not self._open:
            self._begin()
        self._in_opt = self.collectives.paused = True
        buf = self.recorder.buffer
        if buf is not None:
            if self._native is not None:
                self._set_mode(SLOW)  # a forward now is a closure's: Python handles it
            self._opt = (self._mark(), len(buf.gc))

    def _opt_post(self, optimizer, args, kwargs):
        self._in_opt = self.collectives.paused = False
        buf = self.recorder.buffer
        if buf is not None and self._opt is None and self._native is not None:
            # a closure's forward ran inside optimizer.step: the optimizer's own work starts
            # once its backward and the all-reduces DDP waits for at the end of it are done
            buf.add_stamps(self._native.drain())
            last = native_hooks.last_stamp(buf.stamps or [])
            if last is not None:
                self._opt = (last, sum(1 for s, _ in buf.gc if s < last))
        if buf is not None and self._opt is not None:
            start, i0 = self._opt
            self.recorder.add_op(buf, i0, (OPT, -1, 0, 0, math.nan, -1, -1), start, self._mark())
        self._opt = None
        self._end()

    def _opt_post_native(self, optimizer, args, kwargs):
        """_opt_post for the common case with native hooks (no closure, no GC pause during the
        optimizer, nothing open in Python): the step's last row is appended, the step goes to
        the writer, and the next step begins now, armed by the same C call that drains this
        step's stamps — its forwards then run in C alone, with no call back into Python (a
        step's Python work on the training thread is these two hooks)."""
        end = perf_counter_ns()
        rec = self.recorder
        buf, opt = rec.buffer, self._opt
        if (buf is None or opt is None or len(buf.gc) > opt[1] or self._in_bwd
                or self.compute.seq or buf.pending or self.compute.current is not None):
            return self._opt_post(optimizer, args, kwargs)
        buf.ops.append((OPT, opt[0], end, -1, 0, 0, math.nan, -1, -1, ()))
        self._in_opt, self._opt, self._mb = False, None, 0
        self.collectives.paused = False
        step = self._step = self._step + 1
        # (as _begin; GC pauses before the step's first op are dropped by the writer)
        sampled = step >= self._first_step and rec.sampled(step)
        buf.add_stamps(self._step_end((SLOW if self._seq_fn is not None else FAST) if sampled
                                      else SKIP))
        rec.end_step()
        if sampled:
            rec.begin_step(step)

    # ---- steps and spans -------------------------------------------------------------------

    def _begin(self) -> None:
        self._open, self._mb = True, 0
        if self.compute.seq:  # a new dict: the last step's went to the writer with its stamps
            self.compute.seq = {}
        if self._step >= self._first_step:
            self.recorder.begin_step(self._step)
        if self._fwd is not None:
            self._fwd.arm(SKIP if self.recorder.buffer is None else
                          SLOW if self._seq_fn is not None or self._in_opt else FAST)

    def _end(self) -> None:
        if self._in_bwd:  # a backward that raised never ran its end callback: no span
            self._in_bwd, self.compute.current = False, None
        # the step's stamps (dropped when it is not sampled, or DDP's first); the forwards are
        # disarmed: the next one begins a step
        stamps = self._step_end(-1) if self._native is not None else None
        buf = self.recorder.buffer
        if buf is not None:
            self.compute.close()
            if stamps is not None:
                buf.add_stamps(stamps)
                if self.compute.seq:
                    buf.seq = self.compute.seq
            self.recorder.end_step()
        self._open = False
        self._step += 1

    @property
    def steps_seen(self) -> int:
        """Optimizer steps seen since attach (sampled or not)."""
        return self._step

