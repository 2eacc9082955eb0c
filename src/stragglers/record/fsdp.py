"""FSDP2 (`fully_shard`): per-unit all-gathers and reduce-scatters, recorded through its comm API.

`FSDPModule.set_custom_all_gather` / `set_custom_reduce_scatter` let a caller replace the
collectives FSDP2 issues for each unit; the recorded versions wrap the comms FSDP2 had (its
defaults, or a user's), so the bytes moved and the result are the same. An asynchronous
all-gather returns a Work whose wait() is recorded: the compute span that waits is split
around it (ComputeSpan.blocked), so compute rows hold compute and the wait shows in the gather.
On CPU each row carries its threads' waits for a CPU (cpu_wait, as Recorder.collective's), so
the diagnosis tells a busy host from a slow link.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

from stragglers.trace.model import OPTYPE_CODES

AG, RS = OPTYPE_CODES["params-all-gather"], OPTYPE_CODES["grads-reduce-scatter"]


def _row(code: int, start, end, nbytes: int) -> tuple:
    return (code, start, end, -1, 0, 0, math.nan, -1, nbytes, ())


class _RecordedWork(dist.Work):
    """An asynchronous all-gather: the row ends at completion, the wait() splits compute."""

    def __init__(self, work, att, buf, start, nbytes: int, waits: tuple, pg: int):
        super().__init__()
        self._work, self._att, self._buf, self._pg = work, att, buf, pg
        self._start, self._nbytes = start, nbytes
        self._waits = waits  # (probe, mark): CPU waits from the issue on
        self._closed = False
        # No done-callback on the work's future: a Python callback runs (and is freed) on
        # gloo's worker thread, which must take the GIL there; at interpreter exit that thread
        # is ended by pthread_exit inside a noexcept frame ("terminate called without an
        # active exception"). Completion is read at wait() instead.

    def wait(self, timeout=None) -> bool:
        rec = self._att.recorder
        entered = rec.mark()
        # a prefetched gather already done when waited: it ended no later than the wait began
        done_before = not rec.on_gpu and self._work.is_completed()
        with self._att.compute.blocked():
            ok = self._work.wait() if timeout is None else self._work.wait(timeout)
            end = rec.mark()
        if not self._closed:
            self._closed = True
            if done_before:
                end = entered
            if rec.buffer is self._buf:  # still the step it was issued in
                self._buf.ops.append(_row(AG, self._start, end, self._nbytes))
                rec.note_comm_wait(self._buf, AG, end, *self._waits)
                if self._att.pg_on:
                    self._buf.add_pg(AG, end, self._pg)
        return ok

    def is_completed(self) -> bool:
        return self._work.is_completed()


class RecordedAllGather(AllGather):
    """FSDP2's all-gather of one unit, recorded as params-all-gather."""

    def __init__(self, att, inner: AllGather):
        self.att, self.inner = att, inner

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        att = self.att
        rec = att.recorder
        buf = rec.buffer
        if buf is None:
            return self.inner(output_tensor, input_tensor, group, async_op)
        nbytes = output_tensor.numel() * output_tensor.element_size()
        waits = rec.comm_wait_mark()
        start = rec.mark()
        if async_op:
            work = self.inner(output_tensor, input_tensor, group, True)
            return _RecordedWork(work, att, buf, start, nbytes, waits,
                                 att.groups.of(group)[0]) if work is not None else None
        with _host_wait(att):
            work = self.inner(output_tensor, input_tensor, group, False)
        end = rec.mark()
        buf.ops.append(_row(AG, start, end, nbytes))
        rec.note_comm_wait(buf, AG, end, *waits)
        if att.pg_on:
            buf.add_pg(AG, end, att.groups.of(group)[0])
        return work


class RecordedReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter of one unit's gradients, recorded as grads-reduce-scatter."""

    def __init__(self, att, inner: ReduceScatter):
        self.att, self.inner = att, inner

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        att = self.att
        rec = att.recorder
        buf = rec.buffer
        if buf is None:
            return self.inner(output_tensor, input_tensor, group, op, async_op)
        nbytes = input_tensor.numel() * input_tensor.element_size()
        waits = rec.comm_wait_mark()
        start = rec.mark()
        with _host_wait(att):
            work = self.inner(output_tensor, input_tensor, group, op, async_op)
            if async_op and work is not None:
                work.wait()
        end = rec.mark()
        buf.ops.append(_row(RS, start, end, nbytes))
        rec.note_comm_wait(buf, RS, end, *waits)
        if att.pg_on:
            buf.add_pg(RS, end, att.groups.of(group)[0])
        return work


class _host_wait:
    """On CPU a synchronous collective blocks the training thread: split compute around it.

    On CUDA FSDP2 issues it on its own stream and the host does not wait, so nothing is split.
    """

    def __init__(self, att):
        self.cm = att.compute.blocked() if not att.recorder.on_gpu else None

    def __enter__(self):
        if self.cm is not None:
            self.cm.__enter__()

    def __exit__(self, *exc):
        if self.cm is not None:
            return self.cm.__exit__(*exc)
        return False


def _put_back(group, all_gather, reduce_scatter) -> None:
    """Give an FSDP2 param group back the comms it had before install_fsdp2."""
    group._all_gather_comm, group._reduce_scatter_comm = all_gather, reduce_scatter


def install_fsdp2(att, units) -> list[Callable[[], None]]:
    """Wrap every unit's comms to record into `att` (modelparallel.Collectives); returns the
    callables that put FSDP2's own comms back."""
    undo: list[Callable[[], None]] = []
    for unit in units:
        groups = getattr(unit._get_fsdp_state(), "_fsdp_param_groups", [])
        if len(groups) != 1:
            continue  # a unit without parameters has no comms; several groups: not wrappable
        group = groups[0]
        ag, rs = group._all_gather_comm, group._reduce_scatter_comm
        unit.set_custom_all_gather(RecordedAllGather(att, ag))
        unit.set_custom_reduce_scatter(RecordedReduceScatter(att, rs))
        undo.append(functools.partial(_put_back, group, ag, rs))
    if att.recorder.on_gpu:
        warnings.warn("stragglers.record.attach: FSDP2 on CUDA waits for its all-gathers on the "
                      "device; those waits stay inside the compute spans around them (recorded "
                      "coarsely; the gathers themselves are recorded on their stream)",
                      stacklevel=3)
    return undo
