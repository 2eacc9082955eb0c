"""Parse one rank's PyTorch-profiler (Kineto) JSON into the few events the op table needs.

Memory is the point of this module: every trace event becomes a few values in typed columns
or a small tuple (or is dropped) as soon as it is decoded, so a rank's file never lives as millions of Python dicts, and only
one file is decoded at a time. With msgspec installed (`fastdecode`), events are decoded one
at a time into typed structs that hold only the fields used here; without it, a stdlib
json.loads object hook does the same job, slower.
"""

from __future__ import annotations

import gzip
import json
import math
import re
import zlib
from array import array
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple, Protocol, TypedDict, TypeGuard

from stragglers.errors import InputError
from stragglers.trace.jsontypes import JsonObject, JsonValue

_STEP = re.compile(r"ProfilerStep#(\d+)$")
# "<backend>:<collective>" record_function annotations, e.g. nccl:all_reduce, gloo:all_reduce.
_BACKEND_COLL = re.compile(r"([A-Za-z0-9_]+):([A-Za-z_]+)$")
# Device rows. MTIA writes its kernels (and DMA transfers) as mtia_ccp_events, launched by
# mtia_runtime events with the same correlation, as CUDA/HIP kernels by cuda_runtime ones.
_AUTOGRAD_NODE = re.compile(r"(?:torch::autograd::\w+|[A-Z][A-Za-z0-9]*Backward\d*)$")
_GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset", "memcpy", "memset", "mtia_ccp_events"}
_CPU_OP_CATS = {"cpu_op", "operator"}
_ANNOTATION_CATS = {"user_annotation", "gpu_user_annotation"}
NCCL_KERNEL_PREFIXES = ("ncclKernel_", "ncclDevKernel_")
COMM_OP, BACKWARD_OP, NO_WORK_OP = 1, 2, 3
NO_CORR = -(1 << 63)   # a kernel or launch without a usable correlation id
# Top-level CPU ops that allocate or re-view a tensor without touching its data: not compute
# (a pipeline stage allocates its recv buffer between two transfers).
NO_WORK_OPS = frozenset(f"aten::{n}" for n in (
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach",
    "detach_", "requires_grad_", "view", "reshape", "_reshape_alias", "t", "alias", "lift_fresh",
    "as_strided", "expand", "transpose", "permute", "slice", "select", "unsqueeze", "squeeze",
    "unbind", "split", "chunk", "narrow", "flatten", "unflatten", "resize_", "set_",
    # the seed gradient torch.autograd.backward creates before the engine runs (one scalar)
    "ones_like"))
# Keys under which launchers and schedulers name a run; files of one job agree on them.
RUN_ID_KEYS = ("distinct_run_id", "run_id", "job_id", "TORCHELASTIC_RUN_ID")
# c10d p2p ops: c10d::send(tensors, group, dstRank, tag) / c10d::recv_(tensors, group, srcRank,
# tag). With record_shapes the profiler writes the scalar arguments as 'Concrete Inputs'.
_C10D_PEER_ARG = {"c10d::send": 2, "c10d::recv_": 2}


def collective_kind(name: JsonValue) -> str | None:
    """Normalise a collective name ('all_reduce', '_allgather_base', 'AllReduce') to one token."""
    if not isinstance(name, str) or not name:
        return None
    s = name.lower().lstrip("_")
    for suffix in ("_coalesced", "_into_tensor", "_tensor", "_base", "_single", "_"):
        s = s.removesuffix(suffix)
    s = s.replace("_", "")
    return _ALIASES.get(s, s) or None


# Names of collectives that are one of the known ones under another name.
_ALIASES = {"monitoredbarrier": "barrier", "recvanysource": "recv",
            "batchisendirecv": "sendrecv"}


# Collective tokens that the op table knows, and those we recognise but have no op type for.
KNOWN_COLLECTIVES = {"allreduce", "reducescatter", "allgather", "alltoall", "broadcast", "reduce",
                     "gather", "scatter", "barrier", "send", "recv", "sendrecv", "alltoallv"}


# A pg_config entry's name when it has no pg_name
UNNAMED = "None"


@dataclass(frozen=True)
class GroupConfig:
    """One process group of distributedInfo.pg_config (an entry with a list of ranks)."""

    name: str                 # pg_name as text ("None" when absent)
    ranks: tuple              # the members as the file lists them (checked where used)
    desc: str | None = None   # pg_desc, when it is text

    @property
    def unnamed(self) -> bool:
        """No pg_name in the entry (collectives name their group by it)."""
        return self.name == UNNAMED

    def whole_ranks(self) -> list[int] | None:
        """The members when every one is a whole number (not a bool), else None."""
        ok = all(isinstance(r, int) and not isinstance(r, bool) for r in self.ranks)
        return list(self.ranks) if ok else None


@dataclass(frozen=True)
class DistributedInfo:
    """What the reader reads of a trace's distributedInfo, decoded once (bad values: None)."""

    rank: int | None = None          # a whole number >= 0
    world_size: int | None = None    # a whole number > 0
    backend: str = ""
    groups: tuple[GroupConfig, ...] = ()


# The keys of distributedInfo and of a pg_config entry the reader reads (decode_info).
_INFO_KEYS = ("rank", "world_size", "backend", "pg_config")
_GROUP_KEYS = ("pg_name", "ranks", "pg_desc")


def decode_info(info: JsonObject) -> DistributedInfo:
    """The typed DistributedInfo of a distributedInfo object (stdlib only: no msgspec here)."""
    rank, world_size, backend, configs = (info.get(k) for k in _INFO_KEYS)
    groups = []
    for entry in configs if isinstance(configs, list) else []:
        if not isinstance(entry, dict):
            continue
        name, ranks, desc = (entry.get(k) for k in _GROUP_KEYS)
        if isinstance(ranks, list) or isinstance(desc, str):
            # a described group without a list of ranks: its collectives may give them
            groups.append(GroupConfig(str(name), tuple(ranks) if isinstance(ranks, list) else (),
                                      desc if isinstance(desc, str) else None))
    return DistributedInfo(
        rank=rank if _whole(rank) and rank >= 0 else None,
        world_size=world_size if _whole(world_size) and world_size > 0 else None,
        backend="" if backend is None else str(backend), groups=tuple(groups))


def _whole(x: Any) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class RankEvents:
    """What one rank's trace holds that the op table needs: typed columns and small tuples (µs)."""

    source: str
    distributed_info: DistributedInfo | None = None
    base_ns: int = 0                      # baseTimeNanoseconds (0 for absolute-µs traces)
    host: str | None = None               # host_name: ranks on one host share a clock
    steps: list[tuple[int, float, float]] = field(default_factory=list)      # (N, ts, dur) CPU
    gpu_steps: list[tuple[int, float, float]] = field(default_factory=list)  # GPU-side spans
    optimizer: list[float] = field(default_factory=list)                     # Optimizer.step# ts
    optimizer_ends: list[float] = field(default_factory=list)                # … and its end
    loader: list[tuple[float, float]] = field(default_factory=list)  # DataLoader spans (ts, end)
    backward: list[float] = field(default_factory=list)                      # evaluate_function ts
    backward_annotations: list[float] = field(default_factory=list)          # '## backward ##' ts
    # (ts, dur, tid, kind, pg, seq, src, dst, backend of the annotation ("gloo", "hccl", …;
    # False for the op that issued it), rows received, shapes)
    collectives: list[tuple] = field(default_factory=list)
    # The three kinds of event a GPU trace has millions of are kept as columns (8 bytes a
    # value): a tuple per event held ~0.2 KB, 1.2 GB for a 1.1 GB file. *_tid columns index
    # `tids`; a correlation id that is missing or no 64-bit whole number is NO_CORR.
    tids: list = field(default_factory=list)                  # distinct thread ids, first seen first
    runtime_corr: array = field(default_factory=lambda: array("q"))   # launches (cudaLaunch…)
    runtime_ts: array = field(default_factory=lambda: array("d"))
    runtime_tid: array = field(default_factory=lambda: array("q"))
    kernel_ts: array = field(default_factory=lambda: array("d"))      # compute kernels
    kernel_dur: array = field(default_factory=lambda: array("d"))
    kernel_corr: array = field(default_factory=lambda: array("q"))
    # NCCL kernels (few): (ts, dur, stream, correlation, kind from args, kind from name, pg,
    # seq, src, dst, rows received)
    nccl_kernels: list[tuple] = field(default_factory=list)
    # CPU ops: flag COMM_OP (collective enqueue), BACKWARD_OP (autograd), NO_WORK_OP or 0
    cpu_ts: array = field(default_factory=lambda: array("d"))
    cpu_dur: array = field(default_factory=lambda: array("d"))
    cpu_tid: array = field(default_factory=lambda: array("q"))
    cpu_flag: array = field(default_factory=lambda: array("b"))
    pg_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)  # from collective args
    run_ids: dict[str, str] = field(default_factory=dict)  # run identifiers the file names
    record_shapes: bool = False      # Concrete Inputs seen (c10d p2p ops then carry their peer)
    events: int = 0
    evaluate_functions: int = 0      # autograd::engine::evaluate_function ops (PyTorch >= 1.10)

    @property
    def has_kernels(self) -> bool:
        """Whether the trace has device rows (kernels): a GPU trace."""
        return bool(len(self.kernel_ts) or self.nccl_kernels)

    @property
    def rank(self) -> int | None:
        """distributedInfo.rank when it is a whole number."""
        return None if self.distributed_info is None else self.distributed_info.rank


class EventArgs(Protocol):
    """The args of a trace event the reader reads, from either decoder (values unchecked)."""

    @property
    def correlation(self) -> JsonValue: ...
    @property
    def collective_name(self) -> JsonValue: ...   # "Collective name"
    @property
    def pg_name(self) -> JsonValue: ...           # "Process Group Name"
    @property
    def seq(self) -> JsonValue: ...               # "Seq"
    @property
    def src_rank(self) -> JsonValue: ...          # "Src Rank"
    @property
    def dst_rank(self) -> JsonValue: ...          # "Dst Rank"
    @property
    def pg_ranks(self) -> JsonValue: ...          # "Process Group Ranks"
    @property
    def out_split(self) -> JsonValue: ...         # "Out split size"
    @property
    def in_split(self) -> JsonValue: ...          # "In split size"

    def concrete_inputs(self) -> JsonValue:
        """'Concrete Inputs' (decoded on demand: rarely read, sometimes long), or None."""

    def input_dims(self) -> JsonValue:
        """'Input Dims' (decoded on demand, read for collectives only), or None."""


# An event's args object as the profiler writes it: the keys the reader reads (their values
# unchecked; the JSON names have spaces, hence the functional form).
KinetoArgs = TypedDict("KinetoArgs", {
    "correlation": JsonValue, "Collective name": JsonValue, "Process Group Name": JsonValue,
    "Seq": JsonValue, "Src Rank": JsonValue, "Dst Rank": JsonValue,
    "Process Group Ranks": JsonValue, "Out split size": JsonValue, "In split size": JsonValue,
    "Concrete Inputs": JsonValue, "Input Dims": JsonValue}, total=False)


def _json_arg(key: str) -> property:
    """An EventArgs attribute read from the args dict under its JSON name."""
    return property(lambda self: self.raw.get(key), doc=f"args[{key!r}] or None")


class JsonArgs:
    """EventArgs over the stdlib decoder's args dict (each key read when asked for)."""

    __slots__ = ("raw",)
    correlation = _json_arg("correlation")
    collective_name = _json_arg("Collective name")
    pg_name = _json_arg("Process Group Name")
    seq = _json_arg("Seq")
    src_rank = _json_arg("Src Rank")
    dst_rank = _json_arg("Dst Rank")
    pg_ranks = _json_arg("Process Group Ranks")
    out_split = _json_arg("Out split size")
    in_split = _json_arg("In split size")
    _concrete = _json_arg("Concrete Inputs")
    _dims = _json_arg("Input Dims")

    def __init__(self, raw: KinetoArgs):
        self.raw = raw

    def concrete_inputs(self) -> JsonValue:
        """'Concrete Inputs', or None."""
        return self._concrete

    def input_dims(self) -> JsonValue:
        """'Input Dims', or None."""
        return self._dims



# What an event is, by its name and category (classified once per distinct pair).
(_SKIP, _STEP_SPAN, _KERNEL, _RUNTIME, _OPTIMIZER, _LOADER, _BACKWARD_MARK, _BACKEND,
 _CPU) = range(9)


def _classify(name: Any, cat: Any) -> tuple:
    """(what, details...) for an 'X' event's name and category; see _Collector.file."""
    if not isinstance(name, str) or not isinstance(cat, str):
        return (_SKIP,)
    cat = cat.lower()
    step = _STEP.match(name)
    if step:
        return (_STEP_SPAN, int(step.group(1)), cat == "gpu_user_annotation")
    if cat in _GPU_CATS:
        nccl = name.startswith(NCCL_KERNEL_PREFIXES)
        return (_KERNEL, nccl, _kernel_kind(name) if nccl else None)
    if cat.endswith("runtime") or cat.endswith("driver"):
        return (_RUNTIME,)
    annotation = cat == "user_annotation"
    if cat not in _CPU_OP_CATS and not annotation:
        return (_SKIP,)
    if name.startswith("Optimizer.step#"):
        return (_OPTIMIZER,)
    if annotation and name.startswith("enumerate(DataLoader)"):
        return (_LOADER,)
    # PyTorch before 1.10 writes no evaluate_function op: the autograd node itself is the
    # top-level op of the backward thread (CudnnConvolutionBackward, ReluBackward1,
    # torch::autograd::AccumulateGrad).
    evaluate = name.startswith("autograd::engine::evaluate_function") or (
        cat in _CPU_OP_CATS and _AUTOGRAD_NODE.match(name) is not None)
    if not evaluate and annotation and "backward" in name.lower():
        return (_BACKWARD_MARK,)
    m = _BACKEND_COLL.match(name)
    if m and collective_kind(m.group(2)) in KNOWN_COLLECTIVES:
        return (_BACKEND, collective_kind(m.group(2)), m.group(1).lower())
    comm = name == "record_param_comms" or name.startswith("c10d::")
    c10d_kind = collective_kind(name[len("c10d::"):]) if name.startswith("c10d::") else None
    flag = COMM_OP if comm else (
        BACKWARD_OP if evaluate else NO_WORK_OP if name in NO_WORK_OPS else 0)
    return (_CPU, evaluate, comm, c10d_kind, _C10D_PEER_ARG.get(name), cat in _CPU_OP_CATS,
            flag, name.startswith("autograd::engine::evaluate_function"))


def _checked(ts: float, dur: float) -> tuple[float, float]:
    return ts, dur


def _as_is(args: Any) -> Any:
    return args


_NO_ARGS: dict = {}   # an event without args (read only)


class _Collector:
    """Files trace events into RankEvents; as a json object hook it returns None for each event.

    `checked=True` for the msgspec decoder: ts and dur are already finite floats (dur >= 0)
    and args arrive as its EventArgs struct; the stdlib's args dicts are made JsonArgs, and
    only for the few events that read more than the correlation id (a wrapper per event would
    cost the stdlib path a tenth of its time).
    """

    def __init__(self, out: RankEvents, checked: bool = False):
        self.out = out
        self._kinds: dict[tuple, tuple] = {}
        self._tids: dict[Any, int] = {}     # thread id → its index in out.tids
        self._times = _checked if checked else self._check_times
        self._args: Callable[[Any], EventArgs] = _as_is if checked else JsonArgs

    def __call__(self, obj: JsonObject) -> JsonObject | None:
        if "ph" not in obj:
            return obj  # the document, distributedInfo, args: kept as they are
        self.out.events += 1
        if obj.get("ph") != "X":
            return None  # flows, counters, metadata, instants: the op table needs none of them
        # this hook is the stdlib decoder: its reads are the decode (a field table or a typed
        # record per event costs this path 5-7% of its time)
        args = obj.get("args")
        args = args if isinstance(args, dict) else _NO_ARGS
        self.file(obj.get("name"), obj.get("cat"), obj.get("ts"), obj.get("dur", 0),
                  obj.get("tid"), args.get("correlation"), args)
        return None

    def file(self, name: Any, cat: Any, ts: Any, dur: Any, tid: Any, corr: Any,
             args: Any) -> None:
        """File one complete ('X') event: its fields and args as the decoder gave them."""
        try:
            what = self._kinds[(name, cat)]
        except KeyError:
            what = self._kinds[(name, cat)] = _classify(name, cat)
        except TypeError:
            return  # an unhashable name or category (a list, an object): not an event we read
        code = what[0]
        if code == _SKIP:
            return
        out = self.out
        if tid.__class__ is not int:
            tid = _hashable(tid)
        tid_no = self._tids.get(tid)
        if tid_no is None:
            tid_no = self._tids[tid] = len(out.tids)
            out.tids.append(tid)
        if code == _RUNTIME:
            if corr.__class__ is int and NO_CORR < corr < -NO_CORR:  # not a bool; fits int64
                out.runtime_corr.append(corr)
                out.runtime_ts.append(self._times(ts, dur)[0])
                out.runtime_tid.append(tid_no)
            return
        ts, dur = self._times(ts, dur)
        if code == _KERNEL:
            corr = corr if corr.__class__ is int and NO_CORR < corr < -NO_CORR else None
            if what[1]:  # an NCCL kernel
                a = self._args(args)
                pg, seq, src, dst = _comm_args(a)
                out.nccl_kernels.append((ts, dur, tid, corr,
                                         collective_kind(a.collective_name), what[2],
                                         pg, seq, src, dst, split_rows(a)))
            else:
                out.kernel_ts.append(ts)
                out.kernel_dur.append(dur)
                out.kernel_corr.append(NO_CORR if corr is None else corr)
        elif code == _CPU:
            _, evaluate, comm, c10d_kind, peer_arg, cpu_op, flag, engine = what
            if evaluate:
                out.backward.append(ts)
                out.evaluate_functions += engine
            if comm:
                self._issued(name, ts, dur, tid, self._args(args), c10d_kind, peer_arg)
            if cpu_op:
                out.cpu_ts.append(ts)
                out.cpu_dur.append(dur)
                out.cpu_tid.append(tid_no)
                out.cpu_flag.append(flag)
        elif code == _STEP_SPAN:
            (out.gpu_steps if what[2] else out.steps).append((what[1], ts, dur))
        elif code == _BACKEND:
            a = self._args(args)
            pg, seq, src, dst = _comm_args(a)
            out.collectives.append((ts, dur, tid, what[1], pg, seq, src, dst, what[2],
                                    split_rows(a), shapes_of(a)))
        elif code == _OPTIMIZER:
            out.optimizer.append(ts)
            out.optimizer_ends.append(ts + dur)
        elif code == _LOADER:
            out.loader.append((ts, ts + dur))
        elif code == _BACKWARD_MARK:
            out.backward_annotations.append(ts)

    def _issued(self, name: str, ts: float, dur: float, tid: Any, args: EventArgs,
                c10d_kind: str | None,
                peer_arg: int | None) -> None:
        """A collective as the program issued it (record_param_comms, c10d::*)."""
        out = self.out
        kind = collective_kind(args.collective_name)
        if kind is None:
            kind = c10d_kind
        if kind not in KNOWN_COLLECTIVES:
            return
        pg, seq, src, dst = _comm_args(args)
        if args.concrete_inputs() is not None:
            out.record_shapes = True
        if peer_arg is not None and src is None and dst is None:
            peer = _concrete_int(args, peer_arg)
            if kind == "send":
                dst = peer
            else:
                src = peer
        self._group(pg, args)
        out.collectives.append((ts, dur, tid, kind, pg, seq, src, dst, False,
                                split_rows(args), shapes_of(args)))

    def _group(self, pg: str | None, args: EventArgs) -> None:
        """Remember the member ranks a collective's args give for its process group."""
        if pg is None or pg in self.out.pg_ranks:
            return
        ranks = args.pg_ranks
        if isinstance(ranks, str):
            try:
                ranks = json.loads(ranks)
            except ValueError:
                return
        if not isinstance(ranks, list):
            return
        whole = tuple(r for r in ranks if isinstance(r, int) and not isinstance(r, bool))
        if whole and len(whole) == len(ranks):
            self.out.pg_ranks[pg] = whole

    def _check_times(self, ts: Any, dur: Any) -> tuple[float, float]:
        where = f"traceEvents[{self.out.events - 1}]"
        if not _finite_number(ts):
            raise InputError(self.out.source, f"{where}.ts", f"expected a finite number of "
                             f"microseconds, got {_short(ts)}")
        if not _finite_number(dur) or dur < 0:
            raise InputError(self.out.source, f"{where}.dur", f"expected a duration >= 0 µs, "
                             f"got {_short(dur)}")
        return float(ts), float(dur)


def _finite_number(x: Any) -> bool:
    if not isinstance(x, (int, float)) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:   # an integer of hundreds of digits: no float holds it
        return False


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _hashable(x: Any) -> Any:
    return x if isinstance(x, (int, float, str)) or x is None else repr(x)


def _int_or_none(x: Any) -> int | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int):
        return x if -(1 << 63) <= x < 1 << 63 else None
    digits = x.strip().lstrip("-") if isinstance(x, str) else ""
    # ASCII digits only, int64's at most: isdigit() takes '²' and a 5,000-digit string, both
    # of which int() refuses (ValueError out of the reader: internal error)
    if digits.isascii() and digits.isdigit() and len(digits) <= 19:
        return int(x)
    return None


def _concrete_int(args: EventArgs, index: int) -> int | None:
    """The index-th 'Concrete Inputs' scalar of an op as a whole number, if recorded."""
    values = args.concrete_inputs()
    if isinstance(values, list) and len(values) > index:
        return _int_or_none(values[index])
    return None


class SplitRows(NamedTuple):
    """The rows an all-to-all moved on this rank: received (its experts' load in a dispatch)
    and sent; None where the trace does not say."""

    received: int | None
    sent: int | None


def shapes_of(args: EventArgs) -> str | None:
    """A collective's tensor shapes ('Input Dims', with record_shapes) as canonical text, or
    None: the members of one collective pass the same shapes."""
    dims = args.input_dims()
    if not isinstance(dims, list):
        return None
    return json.dumps(dims, separators=(",", ":"))


def split_rows(args: EventArgs) -> SplitRows | None:
    """The rows an all-to-all received and sent: the sums of its `Out split size` and `In
    split size`; None when it gives neither."""
    received, sent = _split_sum(args.out_split), _split_sum(args.in_split)
    return None if received is None and sent is None else SplitRows(received, sent)


def _split_sum(sizes: Any) -> int | None:
    """The sum of split sizes (a list, or the profiler's text of one); None where absent or not
    whole numbers >= 0."""
    if isinstance(sizes, str):
        text = sizes.strip()
        if not (text.startswith("[") and text.endswith("]")) or len(text) > 1 << 16:
            return None
        sizes = [_int_or_none(x) for x in text[1:-1].split(",")] if text[1:-1].strip() else []
    if not isinstance(sizes, list) or not sizes or len(sizes) > 1 << 16:
        return None
    values: list[int] = []
    for x in sizes:
        if not isinstance(x, int) or isinstance(x, bool) or x < 0:
            return None
        values.append(x)
    total = sum(values)
    return total if total < 1 << 62 else None


def _comm_args(args: EventArgs) -> tuple[str | None, int | None, int | None, int | None]:
    """(process group, sequence number, src rank, dst rank) of a collective's args."""
    pg = args.pg_name
    pg = str(pg) if isinstance(pg, (str, int)) and not isinstance(pg, bool) else None
    return (pg, _int_or_none(args.seq), _int_or_none(args.src_rank),
            _int_or_none(args.dst_rank))


def _kernel_kind(name: str) -> str | None:
    """The collective in an NCCL kernel name: ncclDevKernel_AllGather_RING_LL → 'allgather'."""
    for prefix in NCCL_KERNEL_PREFIXES:
        if name.startswith(prefix):
            token = re.split(r"[_(]", name[len(prefix):], maxsplit=1)[0]
            kind = collective_kind(token)
            return kind if kind in KNOWN_COLLECTIVES else None
    return None


# The stdlib reader holds the whole text and then its objects (up to about twelve times the
# text: a list of floats): it reads what the streaming decoder gave up on (invalid JSON, NaN,
# unexpected shapes: mostly to name the place) only up to this much text. A 4.7 MB .json.gz of
# blanks unpacked to 1 GiB whole (2.2 GB of memory); at 256 MiB a 260 KB .json.gz of floats
# with one NaN still held 2.9 GB before its refusal.
MAX_STDLIB_BYTES = 32 << 20


def _read_upto(fh, size: int) -> bytearray:
    """At most `size` bytes of `fh`, a MiB at a time into one buffer (one read of `size`
    gathers its pieces and joins them: twice the text at its peak)."""
    raw = bytearray()
    while len(raw) < size:
        chunk = fh.read(min(1 << 20, size - len(raw)))
        if not chunk:
            break
        raw += chunk
    return raw


def open_bytes(path: Path, limit: int = MAX_STDLIB_BYTES) -> bytearray:
    """The (decompressed) bytes of a .json or .json.gz file (gzip is told by its magic bytes),
    at most `limit` of them: more is an InputError naming the file."""
    too_big = (f"holds more than {limit >> 20} MiB of JSON that the streaming reader could not "
               "read event by event; expected a PyTorch profiler trace")
    try:
        with open(path, "rb") as fh:
            head = fh.read(2)
            fh.seek(0)
            if head != b"\x1f\x8b":
                raw = _read_upto(fh, limit + 1)
            else:
                try:
                    with gzip.GzipFile(fileobj=fh) as unpacked:
                        raw = _read_upto(unpacked, limit + 1)   # (never the whole of a bomb)
                except (EOFError, OSError, zlib.error) as exc:
                    raise InputError(path, None, f"not a readable gzip file (truncated or "
                                     f"corrupt: {exc})") from None
    except FileNotFoundError:
        raise InputError(path, None, "no such file") from None
    except IsADirectoryError:
        raise InputError(path, None, "is a directory; expected a .json or .json.gz trace") from None
    except OSError as exc:
        raise InputError(path, None, f"cannot read ({exc.strerror})") from None
    if len(raw) > limit:
        raise InputError(path, None, too_big)
    return raw


def open_text(path: Path) -> str:
    """The decoded text of a .json or .json.gz file."""
    return _text(path, open_bytes(path))


def _text(path: Path, raw: bytes | bytearray) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(path, None, f"not UTF-8 text (byte {exc.start}); expected profiler "
                         "JSON") from None


def read_rank_events(path: Path | str, decoder: str | None = None) -> RankEvents:
    """Decode one trace file into RankEvents; any problem is an InputError naming file and field.

    `decoder`: "msgspec" (typed decoding that skips unused fields; the default when msgspec is
    installed) or "json" (the stdlib, with an object hook). A file msgspec refuses (invalid
    JSON, NaN, unexpected shapes) is decoded again by the stdlib, whose errors name the place.
    """
    path = Path(path)
    if decoder not in (None, "msgspec", "json"):
        raise InputError("decoder", None, f"expected 'msgspec' or 'json', got {decoder!r}")
    if decoder != "json":
        from stragglers.trace.kineto import fastdecode  # noqa: PLC0415  (optional msgspec)

        if fastdecode.AVAILABLE:
            out = _read_streaming(path, fastdecode)
            if out is not None:
                return out
        elif decoder == "msgspec":
            raise InputError("decoder", None, "msgspec is not installed (pip install msgspec)")
    raw = open_bytes(path)
    out = RankEvents(str(path))
    text = _text(path, raw)
    del raw
    try:
        doc = json.loads(text, object_hook=_Collector(out))
    except json.JSONDecodeError as exc:
        raise InputError(path, None, f"not valid JSON (line {exc.lineno}, column {exc.colno}: "
                         f"{exc.msg})") from None
    except RecursionError:
        raise InputError(path, None, "JSON nested too deeply; expected a profiler trace") from None
    del text
    if not isinstance(doc, dict):
        raise InputError(path, None, "expected a JSON object with 'traceEvents' (a PyTorch "
                         "profiler trace)")
    return _finish(path, out, _top_level(doc))


_ABSENT = object()   # a top-level key the document does not have


@dataclass
class TopLevel:
    """The document's top-level keys the reader reads, as the file has them (_finish checks)."""

    events: JsonValue | object = _ABSENT   # traceEvents (the stdlib's list; [] when streamed)
    distributed_info: JsonValue = None     # distributedInfo
    base_ns: JsonValue = None              # baseTimeNanoseconds (absent or null: 0)
    host_name: JsonValue = None
    record_shapes: JsonValue = None
    run_ids: JsonObject = field(default_factory=dict)   # the RUN_ID_KEYS it has


# JSON name → TopLevel attribute, for both decoders.
TOP_KEYS = {"traceEvents": "events", "distributedInfo": "distributed_info",
            "baseTimeNanoseconds": "base_ns", "host_name": "host_name",
            "record_shapes": "record_shapes"}


def _top_level(doc: JsonObject) -> TopLevel:
    """The TopLevel of a document the stdlib decoded."""
    present = {attr: doc[key] for key, attr in TOP_KEYS.items() if key in doc}
    return TopLevel(**present, run_ids={k: doc[k] for k in RUN_ID_KEYS if k in doc})


def _read_streaming(path: Path, fastdecode) -> RankEvents | None:
    """RankEvents by msgspec a chunk at a time, or None: the stdlib path then reads the file
    (and reports what is wrong with it)."""
    try:
        fh = open(path, "rb")
    except OSError:
        return None
    with fh:
        stream = gzip.GzipFile(fileobj=fh) if fh.read(2) == b"\x1f\x8b" else fh
        fh.seek(0)
        out = RankEvents(str(path))
        top = fastdecode.decode_stream(stream, _Collector(out, checked=True))
    return None if top is None else _finish(path, out, top)


def _finish(path: Path, out: RankEvents, doc: TopLevel) -> RankEvents:
    """Check the document's top-level fields and file them into `out`."""
    if doc.events is _ABSENT:
        raise InputError(path, "traceEvents", "missing; expected a PyTorch profiler trace "
                         "(torch.profiler export_chrome_trace / tensorboard_trace_handler)")
    if not isinstance(doc.events, list):
        raise InputError(path, "traceEvents", f"expected a list of events, got "
                         f"{type(doc.events).__name__}")
    info = doc.distributed_info
    if info is not None and not isinstance(info, dict):
        raise InputError(path, "distributedInfo", "expected an object")
    out.distributed_info = None if info is None else decode_info(info)
    base = 0 if doc.base_ns is None else doc.base_ns
    if isinstance(base, float) and base.is_integer():
        base = int(base)
    # int64 nanoseconds since the epoch, as Kineto writes them (to the year 2262)
    if not isinstance(base, int) or isinstance(base, bool) or not 0 <= base < 2**63:
        raise InputError(path, "baseTimeNanoseconds", f"expected whole nanoseconds since the "
                         f"epoch (>= 0, below 2^63), got {_short(base)}")
    out.base_ns = base
    host = doc.host_name
    out.host = host if isinstance(host, str) and host else None
    for where in (doc.run_ids, info or {}):
        for key in RUN_ID_KEYS:
            value = where.get(key)
            if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
                out.run_ids[key] = str(value)
    out.record_shapes = bool(doc.record_shapes) or out.record_shapes
    return out
