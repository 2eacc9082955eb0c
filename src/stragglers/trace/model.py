"""The op table (one row per op, docs/whatif.md §2) and the job metadata."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from stragglers.trace.jsontypes import JsonObject

# Canonical op types. The code of an op type is its index here; readers map names to codes.
OPTYPES: tuple[str, ...] = (
    "forward-compute",
    "backward-compute",
    "optimizer",
    "gc",
    "forward-send",
    "forward-recv",
    "backward-send",
    "backward-recv",
    "params-all-gather",
    "grads-reduce-scatter",
    "separate-grads-all-reduce",
    "grads-all-reduce",
    "layernorm-grads-all-reduce",
    "embedding-grads-all-reduce",
    "optimizer-clip-main-grad",
    # Weight-gradient half of a split backward (zero-bubble schedules' W; their I is
    # backward-compute): a compute-stream op with no pipeline send of its own.
    "backward-weight-compute",
    # Collectives that block the work after them on their rank until the whole process group
    # took part (docs/whatif.md §2, §12: every collective is modelled): MoE/DLRM all-to-alls,
    # broadcasts, barriers, and batched send/recv whose direction is no pipeline's.
    "all-to-all",
    "broadcast",
    "barrier",
    "send-recv",
    # Collectives of model parallelism inside forward/backward (tensor- and sequence-parallel
    # all-reduces, all-gathers and reduce-scatters, context-parallel exchanges): the next
    # compute of the rank needs their result, unlike the gradient collectives above, which
    # DDP/FSDP overlap with the backward.
    "all-reduce",
    "all-gather",
    "reduce-scatter",
)
OPTYPE_CODES = {name: i for i, name in enumerate(OPTYPES)}
COMPUTE_OPTYPES = ("forward-compute", "backward-compute", "optimizer", "gc",
                   "backward-weight-compute")
P2P_OPTYPES = ("forward-send", "forward-recv", "backward-send", "backward-recv")
DP_COLLECTIVES = ("params-all-gather", "grads-reduce-scatter", "separate-grads-all-reduce",
                  "grads-all-reduce")
# On the compute stream in program order: the next op of the rank needs their result.
BLOCKING_COLLECTIVES = ("all-to-all", "broadcast", "barrier", "send-recv", "all-reduce",
                        "all-gather", "reduce-scatter")

# Required columns and their in-memory dtypes (optype holds codes into OPTYPES).
COLUMNS: dict[str, np.dtype] = {
    "rank": np.dtype(np.int32),
    "dp_rank": np.dtype(np.int32),
    "stage": np.dtype(np.int32),
    "step": np.dtype(np.int64),
    "optype": np.dtype(np.int8),
    "start_ts": np.dtype(np.float64),
    "duration": np.dtype(np.float64),
    "seq_id": np.dtype(np.int32),
    "mb_id": np.dtype(np.int32),
    "mc": np.dtype(np.int32),
    "gmc": np.dtype(np.int32),
}
# Optional per-op metadata our recorder adds (NaN / -1 where unknown).
OPTIONAL_COLUMNS: dict[str, np.dtype] = {
    "attn_cost": np.dtype(np.float64),  # Σ s_i² of the microbatch
    # compute: tokens of the microbatch; all-to-all: rows this rank received (an EP rank's load)
    "tokens": np.dtype(np.int64),
    # all-to-all: rows this rank sent (the sum of its input split sizes); with `tokens`, the
    # rows it moved, which its transfer grows with
    "sent": np.dtype(np.int64),
    "bytes": np.dtype(np.int64),
    # s the op's threads were runnable but had no CPU during it (Linux schedstat, our recorder
    # on CPU): communication ops (its waiting thread, gloo's transport and collective threads:
    # CPU contention, not the link) and compute pieces between two model-parallel collectives
    # (the training thread: an expert's compute between dispatch and combine)
    "cpu_wait": np.dtype(np.float64),
    # compute pieces between two model-parallel collectives (our recorder on CPU): s the
    # training thread ran on a CPU (schedstat); duration − cpu_time − cpu_wait it slept (a
    # device it waited for). NaN elsewhere
    "cpu_time": np.dtype(np.float64),
    # every row of a step (our recorder): s of CPU the recording process (all its threads: the
    # training thread, the communication library's, the recorder's writer) used over the step;
    # a host's ranks cannot take less than their steps' CPU work over the CPUs they share
    "step_cpu": np.dtype(np.float64),
    # collectives: the process group they ran in, a job-wide id (-1 unknown): a collective
    # synchronises the ranks of its group only (a tensor-parallel pair, not every DP rank)
    "pg": np.dtype(np.int32),
}
OPTIONAL_FILL = {"attn_cost": np.nan, "tokens": -1, "sent": -1, "bytes": -1, "cpu_wait": np.nan,
                 "cpu_time": np.nan, "step_cpu": np.nan, "pg": -1}


def optype_code(name: str) -> int:
    """The integer code of an op type name (KeyError for unknown names)."""
    return OPTYPE_CODES[name]


@dataclass
class JobMeta:
    """Job metadata: parallel sizes, a name and run id, plus free-form extras (ground truth)."""

    name: str
    dp_size: int
    pp_size: int
    tp_size: int = 1
    dsp_size: int = 1            # context (sequence) parallel degree
    vpp_size: int = 1
    ep_size: int = 1             # expert parallel degree (MoE all-to-all groups; within dp·tp)
    world_size: int = 0
    run_id: str = "0"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.world_size:
            self.world_size = self.dp_size * self.pp_size * self.tp_size * self.dsp_size

    def to_dict(self) -> JsonObject:
        """A JSON-serialisable dict (`extra` as it was given: JSON values by contract)."""
        return asdict(self)


# Kinds of reader notes (Trace.notes), in the order reports show them.
NOTE_KINDS: tuple[str, ...] = ("ranks", "layout", "clock", "dropped", "other")


@dataclass(frozen=True)
class Note:
    """What the trace reader noted about what the trace does not show: kind (NOTE_KINDS), message."""

    # A frozen dataclass, not a msgspec Struct: the trace readers run without msgspec (the
    # result's JSON carries it as it is; msgspec encodes and decodes dataclasses).

    kind: str
    message: str


def as_note(note: Note | Mapping[str, Any]) -> Note:
    """`note` as a Note (a {"kind", "message"} mapping accepted, as older readers build them)."""
    return note if isinstance(note, Note) else Note(**note)


@dataclass(init=False)
class Trace:
    """An op table (dict of equal-length numpy columns, see COLUMNS) with its job metadata.

    `notes` is what the reader could not see or had to assume, for the report to state:
    a list of `Note(kind, message)` ({"kind", "message"} dicts given are converted), where
    kind is one of NOTE_KINDS:
      "ranks"   ranks read of the world size, and which are missing;
      "layout"  how ranks were placed on the DP x PP grid (given, taken from groups, assumed);
      "clock"   clock alignment across ranks and its residual;
      "dropped" ops read but left out (collectives without an op type, unpaired sends/recvs);
      "other"   anything else the user should know to trust the numbers.
    Readers add them with `trace.note(kind, message)`; `select` keeps them.
    """

    ops: dict[str, np.ndarray]
    meta: JobMeta
    source: str = "<memory>"
    notes: list[Note] = field(default_factory=list)

    def __init__(self, ops: dict[str, np.ndarray], meta: JobMeta, source: str = "<memory>",
                 notes: Iterable[Note | Mapping[str, Any]] = ()) -> None:
        self.ops, self.meta, self.source = ops, meta, source
        self.notes = [as_note(n) for n in notes]

    def __len__(self) -> int:
        return len(self.ops["step"])

    def note(self, kind: str, message: str) -> None:
        """Record one reader note (kind from NOTE_KINDS) for the report."""
        if kind not in NOTE_KINDS:
            raise ValueError(f"note kind {kind!r} is not one of {', '.join(NOTE_KINDS)}")
        self.notes.append(Note(kind, str(message)))

    @property
    def end_ts(self) -> np.ndarray:
        """End time of every op."""
        return self.ops["start_ts"] + self.ops["duration"]

    def optype_names(self) -> np.ndarray:
        """The op type of every row as strings (slow; for display and tests)."""
        return np.asarray(OPTYPES, dtype=object)[self.ops["optype"]]

    def select(self, mask: np.ndarray) -> "Trace":
        """A new trace with only the rows where mask is true."""
        return Trace({k: v[mask] for k, v in self.ops.items()}, self.meta, self.source,
                     list(self.notes))

    @classmethod
    def from_rows(cls, rows: dict[str, Any], meta: JobMeta, source: str = "<memory>") -> "Trace":
        """Build a trace from columns given as lists; optype may be names or codes."""
        ops: dict[str, np.ndarray] = {}
        for name, dtype in COLUMNS.items():
            values = rows[name]
            if name == "optype" and len(values) and isinstance(values[0], str):
                values = [OPTYPE_CODES[v] for v in values]
            ops[name] = np.asarray(values, dtype=dtype)
        for name, dtype in OPTIONAL_COLUMNS.items():
            if name in rows:
                ops[name] = np.asarray(rows[name], dtype=dtype)
        return cls(ops, meta, source)


# In-worker streams (docs/whatif.md §3): ops on one stream run in observed start order.
STREAMS: tuple[str, ...] = ("compute", "dp-comm", "f-send", "f-recv", "b-send", "b-recv")
_STREAM_BY_NAME = {
    "forward-send": "f-send", "forward-recv": "f-recv",
    "backward-send": "b-send", "backward-recv": "b-recv",
    **{name: "compute" for name in COMPUTE_OPTYPES},
}
# Stream index of every op type code, e.g. STREAM_OF_OPTYPE[trace.ops["optype"]].
STREAM_OF_OPTYPE = np.array([STREAMS.index(_STREAM_BY_NAME.get(name, "dp-comm"))
                             for name in OPTYPES], dtype=np.int8)
