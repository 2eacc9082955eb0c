"""Collectives of model parallelism (tensor, expert) recorded where torch issues them.

- Tensor parallel: DTensor's redistributions (ColwiseParallel, RowwiseParallel, ...) call the
  functional collectives of `torch.distributed._functional_collectives` (funcol):
  `all_reduce`, `all_gather_single`, `reduce_scatter_single`, `all_to_all_single`; the
  deprecated and autograd-named variants reach the same functions. In forward and in backward
  (DTensor's redistribute is an autograd Function whose backward redistributes again).
- Expert parallel: `torch.distributed.all_to_all_single`, the c10d call a MoE layer makes for
  its dispatch and combine (directly or through `torch.distributed.nn.functional`).

Each is wrapped while a recorder is attached (module attributes: code that looks them up at
call time, as torch's own modules do, is seen). In a sampled step outside `optimizer.step`, one
call is one blocking row (all-reduce, all-gather, reduce-scatter, all-to-all) from its issue to
its result, with its process group's job-wide id (`pg`), and the compute span open around it is
cut there. A functional collective returns a tensor that waits at first use; the wrapper waits
at once (the same values; on a GPU the wait is the stream's, the host goes on), so the row ends
where the result is ready and the work after it is the next compute piece.

For an all-to-all, `tokens` holds the rows this rank received (the sum of its output split
sizes, or the output's rows): an expert rank's load in the dispatch; `sent` the rows it sent
(the sum of its input split sizes, or the input's rows): in the combine, the rows its experts
computed. Both are known when the call is made; together they are the rows the rank moved,
which the transfer grows with (a hot expert's rank receives the dispatch and sends the
combine). `bytes` is the received output's size. The first all-to-all's group size is the
job's expert-parallel degree (ep_size).

Not seen: collectives issued by code that bound the function before attach
(`from torch.distributed import all_to_all_single`), and the backward of a functional
collective with autograd (`funcol.all_to_all_single_autograd`: torch runs its backward
collective as an op, not through these functions); those backward pieces stay uncut.
"""

from __future__ import annotations

import functools
import math
import threading
import warnings
import zlib
from typing import Callable

import torch.distributed as dist

from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.runformat import PG_LATE_BASE

AR, AG, RS, A2A = (OPTYPE_CODES[n] for n in ("all-reduce", "all-gather", "reduce-scatter",
                                             "all-to-all"))
MODEL_PARALLEL_CODES = (AR, AG, RS, A2A)
# ids of groups first seen after attach: a hash of their ranks, above every gathered group's
FALLBACK_BASE = PG_LATE_BASE


# ---- process-group ids ---------------------------------------------------------------------

def member_groups() -> list[tuple[int, ...]]:
    """The sorted rank tuples of every process group this rank belongs to."""
    if not (dist.is_available() and dist.is_initialized()):
        return []
    me = dist.get_rank()
    world = getattr(dist.distributed_c10d, "_world", None)
    groups = getattr(world, "pg_group_ranks", {}) if world is not None else {}
    return sorted({tuple(sorted(int(r) for r in ranks)) for ranks in groups.values()
                   if me in ranks})


class GroupIds:
    """Job-wide ids of process groups: the index of a group's sorted rank tuple among every
    group the job's ranks belonged to at attach (gathered from all ranks, so every rank
    computes the same ids). A group made later gets FALLBACK_BASE + a hash of its ranks."""

    def __init__(self, groups):
        self.groups = sorted({tuple(int(r) for r in g) for g in groups})
        self._ids = {g: i for i, g in enumerate(self.groups)}
        self._cache: dict = {}

    def of_ranks(self, ranks) -> int:
        """The id of the group of these global ranks."""
        key = tuple(sorted(int(r) for r in ranks))
        found = self._ids.get(key)
        if found is None:
            found = FALLBACK_BASE + zlib.crc32(repr(key).encode()) % ((1 << 31) - FALLBACK_BASE)
        return found

    def of(self, group) -> tuple[int, int]:
        """(id, size) of a ProcessGroup (None: the world), a funcol group (a (mesh, dim) pair,
        a mesh, a group name) or a list of ranks."""
        try:
            hit = self._cache.get(group)
        except TypeError:  # an unhashable group (a list of ranks)
            hit = None
        if hit is not None:
            return hit
        ranks = _group_ranks(group)
        hit = (self.of_ranks(ranks), len(ranks))
        try:
            self._cache[group] = hit
        except TypeError:
            pass
        return hit


def _group_ranks(group) -> tuple[int, ...]:
    """The global ranks of any group form torch.distributed accepts."""
    if group is None:
        return tuple(range(dist.get_world_size()))
    if isinstance(group, dist.ProcessGroup):
        return tuple(dist.get_process_group_ranks(group))
    if isinstance(group, (list, tuple)) and group and all(isinstance(r, int) for r in group):
        return tuple(group)
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.distributed_c10d import _resolve_process_group

    name = funcol._resolve_group_name(group)
    return tuple(dist.get_process_group_ranks(_resolve_process_group(name)))


# ---- what the wrappers record into ----------------------------------------------------------

class Collectives:
    """One attached recorder as the collective wrappers (this module, fsdp.py) see it: its
    Recorder, its open compute span (cut around each blocking collective), the job's
    process-group ids and the pg column. Made before `recorder.start()`: the groups every rank
    belongs to are gathered with the layout."""

    def __init__(self, recorder, compute, sizes: dict[str, int]):
        self.recorder, self.compute = recorder, compute
        self.sizes = {k: v for k, v in sizes.items() if v > 1}  # {"tp": 2, "cp": ...}
        self.groups = GroupIds([])  # every rank's groups once gathered
        self.ep_size = 1
        self.pg_on = False
        self.pg_defaults: dict[int, int] = {}
        self.paused = False  # inside optimizer.step, or closed: collectives there are no rows
        # (the compute piece a collective opened after itself, the recording thread's run
        # delay and on-CPU time in ns then): the next collective that cuts it puts its run
        # delay and on-CPU time on its row
        self.resumed: tuple | None = None
        recorder.layout_extra["groups"] = member_groups()  # taken out in _on_layout
        recorder.on_layout = self._on_layout

    def _on_layout(self, entries: list[dict]) -> None:
        """Every rank's layout entry, gathered: the job's process groups get their ids."""
        groups: set[tuple[int, ...]] = set()
        for e in entries:
            groups.update(tuple(g) for g in e.pop("groups", ()))
        self.groups = GroupIds(groups)

    def taking_rows(self) -> bool:
        """Whether a collective now is a row (a sampled step, outside the optimizer step)."""
        return not self.paused and self.recorder.buffer is not None

    def record_pg(self) -> None:
        """From now on the rows carry their process group (the pg column)."""
        if self.pg_on:
            return
        self.pg_on = True
        rec = self.recorder
        rec.record_pg(self.pg_defaults)
        if rec.rank == 0:  # written with meta.json (at close at the latest)
            extra = rec.meta.extra
            extra["process_groups"] = [list(g) for g in self.groups.groups]
            # the compute rows are pieces between blocking collectives (as the Kineto reader's):
            # the i-th piece of a step is one kind of work, the pieces are not
            extra["compute_split_at_collectives"] = True
            extra.setdefault("group_sizes", {}).update(self.sizes)

    def op(self, code: int, group) -> "ModelParallelOp":
        """The span of one blocking model-parallel collective in `group`."""
        pg, size = self.groups.of(group)
        if code == A2A and self.ep_size == 1 and size > 1:
            self._note_ep(size)
        if not self.pg_on:
            self.record_pg()
        return ModelParallelOp(self, self.recorder.buffer, code, pg)

    def _note_ep(self, size: int) -> None:
        """The first all-to-all's group: the expert-parallel degree (meta.ep_size)."""
        meta = self.recorder.meta
        if meta.world_size % size:
            warnings.warn(f"stragglers.record.attach: an all-to-all group of {size} ranks does "
                          f"not divide the world size {meta.world_size}; ep_size stays 1",
                          stacklevel=5)
            self.ep_size = -1
            return
        self.ep_size = meta.ep_size = size
        if isinstance(meta.extra.get("parallel"), dict):
            meta.extra["parallel"]["ep"] = size
        meta.extra.setdefault("group_sizes", {})["ep"] = size


# ---- the wrappers --------------------------------------------------------------------------

class _Depth(threading.local):
    """How many recorded calls this thread is inside."""

    depth = 0


class _Recording:
    """The attached recorders whose steps the wrapped collectives go to (usually one)."""

    def __init__(self):
        self.active: list = []
        self.restore: list[Callable[[], None]] = []
        self.lock = threading.Lock()
        self.inside = _Depth()  # a wrapped call inside another (no second row)


_REC = _Recording()


def install(att: Collectives) -> Callable[[], None]:
    """Record the model-parallel collectives into `att` from now on; returns the undo."""
    with _REC.lock:
        if not _REC.active:
            _patch()
        _REC.active.append(att)

    def undo():
        with _REC.lock:
            if att in _REC.active:
                _REC.active.remove(att)
            if not _REC.active:
                for restore in _REC.restore:
                    restore()
                _REC.restore.clear()

    return undo


def _set(module, name: str, value) -> None:
    old = getattr(module, name)
    setattr(module, name, value)
    _REC.restore.append(lambda: setattr(module, name, old))


def _patch() -> None:
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed import distributed_c10d as c10d

    for name, code in (("all_reduce", AR), ("all_gather_single", AG),
                       ("reduce_scatter_single", RS), ("all_to_all_single", A2A)):
        _set(funcol, name, _functional(getattr(funcol, name), code))
    wrapped = _c10d_all_to_all(c10d.all_to_all_single)
    _set(c10d, "all_to_all_single", wrapped)
    if dist.all_to_all_single is not wrapped:
        _set(dist, "all_to_all_single", wrapped)


def _recording():
    """The attached recorder that takes this call's row, or None (not sampled, not training,
    inside the optimizer step, or inside another recorded call)."""
    if not _REC.active or _REC.inside.depth:
        return None
    att = _REC.active[-1]
    return att if att.taking_rows() else None


class _Inside:
    """Marks a recorded call on this thread: collectives it makes itself are its own."""

    def __enter__(self):
        _REC.inside.depth += 1

    def __exit__(self, *exc):
        _REC.inside.depth -= 1
        return False


def _rows(tensor, split_sizes) -> int:
    """The rows an all-to-all takes from or puts into `tensor`: its split sizes' sum, or all of
    its rows (no split sizes: equal parts)."""
    if split_sizes is not None:
        return int(sum(int(s) for s in split_sizes))
    return int(tensor.shape[0]) if tensor.dim() else 1


def _functional(fn, code: int):
    """A funcol collective recorded as one blocking row; it waits for its result at once."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    # the group's place after the tensor: all_reduce(t, op, group), all_gather_single(t, dim,
    # group), reduce_scatter_single(t, op, dim, group), all_to_all_single(t, out, in, group)
    group_at = 1 if code in (AR, AG) else 2

    def recorded(self, *args, **kwargs):
        att = _recording()
        if att is None:
            return fn(self, *args, **kwargs)
        group = kwargs["group"] if "group" in kwargs else args[group_at]
        with _Inside(), att.op(code, group) as op:
            out = fn(self, *args, **kwargs)
            if isinstance(out, AsyncCollectiveTensor):
                out = out.trigger_wait()
            if code == A2A:
                splits = kwargs.get("output_split_sizes", args[0] if args else None)
                sent = kwargs.get("input_split_sizes", args[1] if len(args) > 1 else None)
                op.tokens, op.sent = _rows(out, splits), _rows(self, sent)
                op.nbytes = out.numel() * out.element_size()
            else:
                op.nbytes = (out if code == AG else self).numel() * self.element_size()
        return out

    # __wrapped__ lets detach() find the original; the doc stays the library's.
    return functools.update_wrapper(recorded, fn, assigned=("__doc__",))


def _c10d_all_to_all(fn):
    """dist.all_to_all_single recorded as an all-to-all row (tokens: rows received, sent: rows
    sent)."""

    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op: bool = False):
        att = _recording()
        if att is None:
            return fn(output, input, output_split_sizes, input_split_sizes, group, async_op)
        tokens = _rows(output, output_split_sizes)
        sent = _rows(input, input_split_sizes)
        nbytes = output.numel() * output.element_size()
        if async_op:  # the row is the wait: where the rank blocks, in program order
            work = fn(output, input, output_split_sizes, input_split_sizes, group, True)
            return _WaitRecorded(work, att, group, tokens, sent, nbytes)
        with _Inside(), att.op(A2A, group) as op:
            op.tokens, op.sent, op.nbytes = tokens, sent, nbytes
            return fn(output, input, output_split_sizes, input_split_sizes, group, False)

    return functools.update_wrapper(all_to_all_single, fn, assigned=("__doc__",))


class _WaitRecorded(dist.Work):
    """An asynchronous all-to-all: its row is its wait() (recorded once, in its step)."""

    def __init__(self, work, att, group, tokens: int, sent: int, nbytes: int):
        super().__init__()
        self._work, self._att, self._group = work, att, group
        self._tokens, self._sent, self._nbytes = tokens, sent, nbytes
        self._buf = att.recorder.buffer
        self._done = False

    def wait(self, timeout=None) -> bool:
        if self._done or self._att.recorder.buffer is not self._buf or self._att.paused:
            return self._work.wait() if timeout is None else self._work.wait(timeout)
        self._done = True
        with _Inside(), self._att.op(A2A, self._group) as op:
            op.tokens, op.sent, op.nbytes = self._tokens, self._sent, self._nbytes
            return self._work.wait() if timeout is None else self._work.wait(timeout)

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def get_future(self):
        return self._work.get_future()


class ModelParallelOp:
    """One recorded collective in progress: the context Collectives.op returns."""

    __slots__ = ("att", "buf", "code", "pg", "tokens", "sent", "nbytes", "start", "seg", "waits",
                 "piece")

    def __init__(self, att: Collectives, buf, code: int, pg: int):
        self.att, self.buf, self.code, self.pg = att, buf, code, pg
        self.tokens, self.sent, self.nbytes = -1, -1, -1

    def __enter__(self):
        att = self.att
        compute, rec = att.compute, att.recorder
        self.seg = compute.current
        end = compute.close() if self.seg is not None else None
        self.waits = probe, mark = rec.comm_wait_mark()
        resumed, att.resumed = att.resumed, None
        if end is not None and resumed is not None and resumed[0] is self.seg:
            # the piece between two collectives (an expert's compute after its dispatch): its
            # run delay, from the counters both collectives read anyway (no read of its own)
            self.buf.add_cpu_wait(self.seg[0], end, max(0, mark[0] - resumed[1]) / 1e9)
            self.piece: tuple | None = (self.seg[0], end, resumed[2])
        else:
            self.piece = None
        self.start = rec.mark()
        return self

    def __exit__(self, exc_type, *exc):
        rec, buf = self.att.recorder, self.buf
        end = rec.mark()
        if exc_type is None and rec.buffer is buf:
            # the microbatch and chunks of the compute it cut (none: -1 and chunk 0)
            mb, mc, gmc = self.seg[1:4] if self.seg is not None else (-1, 0, 0)
            buf.ops.append((self.code, self.start, end, mb, mc, gmc, math.nan, self.tokens,
                            self.nbytes, ()))
            rec.note_comm_wait(buf, self.code, end, *self.waits)
            if self.piece is not None and self.waits[0] is not None:
                # the piece's on-CPU time, read at this collective's end: the kernel updates a
                # running thread's count only at a tick or a switch, so read as the piece ends
                # it lags by up to a tick; blocked in the collective, the thread was switched
                # out and back (gloo does not spin), its count then exact. The collective's own
                # CPU in it is the wrapper's (µs). The rest of the piece's time it slept
                code, piece_end, cpu0 = self.piece
                buf.add_cpu_time(code, piece_end,
                                 max(0, self.waits[0].own_cpu_last - cpu0) / 1e9)
            buf.add_pg(self.code, end, self.pg)
            if self.sent >= 0:
                buf.add_sent(self.code, end, self.sent)
        if self.seg is not None and rec.buffer is buf:
            compute = self.att.compute
            compute.open(*self.seg[:4])
            probe = self.waits[0]
            if exc_type is None and probe is not None and probe.own_last is not None:
                self.att.resumed = (compute.current, probe.own_last, probe.own_cpu_last)
        return False
