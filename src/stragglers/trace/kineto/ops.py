"""One rank's op-table rows from its compute items and collectives: compute from busy time.

Two stages, so ranks can be parsed in parallel and placed once every rank is known:
`items.rank_parts` (per file, in a worker process) keeps the compute items — GPU kernels, or
top-level CPU ops when the trace has no device rows — with their step and phase, and the
collectives; `rank_rows` here (once the job's layout is known) turns them into rows. A compute
op's duration is the time its items were busy (the union of their intervals), not the span
between communication ops, so a sleep or a host stall inside a phase shows as launch delay of
the op after it, not as compute.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.kineto.events import DistributedInfo, SplitRows
from stragglers.trace.model import OPTYPE_CODES

# Gradient/parameter collectives: DDP and FSDP launch them beside the backward, so they do not
# cut compute (the dependency model links each to the compute that produced its bucket).
COLLECTIVE_OPTYPES = {
    "allreduce": "grads-all-reduce",
    "reducescatter": "grads-reduce-scatter",
    "allgather": "params-all-gather",
}
# Collectives whose result the rank's next work needs (an all-to-all's tokens or embeddings, a
# broadcast's tensor, a barrier): they sit between two compute ops (docs/whatif.md §2, §12: every
# collective is modelled, synchronising its process group).
BLOCKING_OPTYPES = {
    "alltoall": "all-to-all",
    "alltoallv": "all-to-all",
    "broadcast": "broadcast",
    "barrier": "barrier",
    "reduce": "broadcast",     # one root, the group waits: the same shape as a broadcast
    "gather": "broadcast",
    "scatter": "broadcast",
    # ring attention's send/recv pairs, one op each (kineto/exchanges.py): the next chunk of
    # attention needs what it received, and the group's ranks pass it on round by round
    "exchange": "send-recv",
}
# The same collectives in a model-parallel group (tensor parallel's all-reduce after a row-
# parallel matmul, sequence parallel's all-gather/reduce-scatter): the next compute needs them.
MODEL_PARALLEL_OPTYPES = {
    "allreduce": "all-reduce",
    "reducescatter": "reduce-scatter",
    "allgather": "all-gather",
}
P2P_KINDS = {"send", "recv", "sendrecv"}
# All-reduces whose group spans pipeline stages (cross_stage_optype): they cut compute, so
# the work after the gradient norm's all-reduce is the optimizer's, not the work before it
CROSS_STAGE_NAMES = {"optimizer-clip-main-grad", "embedding-grads-all-reduce"}
GRADIENT_NAMES = set(COLLECTIVE_OPTYPES.values())
BLOCKING_NAMES = (set(BLOCKING_OPTYPES.values()) | set(MODEL_PARALLEL_OPTYPES.values())
                  | {"send-recv"})
# Batched send/recv with no pipeline direction (NCCL's grouped SendRecv kernels of an
# all-to-all written as p2p, or pairs of exchanges): a blocking exchange among its peers.
SEND_RECV = "send-recv"
# On CPU traces a gap this short between two ops of one phase is Python dispatching the next
# op (tens of µs normally, more on a busy machine), so it counts as busy; longer gaps (a sleep,
# waiting on input) are idle and become launch delay of the next op.
CPU_DISPATCH_GAP_US = 1000.0
PHASE_OPTYPES = ("forward-compute", "backward-compute", "optimizer")
_FWD, _BWD, _OPT = 0, 1, 2


@dataclass
class Placement:
    """Where a rank sits in the job: its DP rank and pipeline stage, and how to place a peer."""

    rank: int
    dp_rank: int
    stage: int
    stage_of: Callable[[int], int] | None = None  # peer rank → stage, when pipeline is known
    pp_size: int = 1
    # the rank's tensor/context/expert-parallel process groups: their all-reduces, all-gathers
    # and reduce-scatters feed the next compute (blocking), unlike DP gradient buckets
    model_parallel: frozenset = frozenset()


@dataclass
class Coll:
    """One collective or p2p op of a rank (µs on the file's time base)."""

    start: float
    end: float
    launch: float      # when the program issued it (CPU time): orders it among compute items
    step: int          # index into RankParts.step_ids
    kind: str | None
    pg: str | None
    seq: int | None
    src: int | None
    dst: int | None
    rows: SplitRows | None = None   # all-to-all: rows this rank received and sent
    shapes: str | None = None       # its tensors' shapes ('Input Dims'), where recorded


@dataclass
class ReadCounts:
    """What reading left out or assumed, counted for the notes (per rank, then summed)."""

    outside_steps: int = 0                   # kernels/ops outside every ProfilerStep#N span
    pre_window_kernels: int = 0              # launched before the profiling window
    kernels_without_launch: int = 0          # no launch record (correlation id)
    unpaired_annotations: int = 0            # collective annotations without their issuing op
    nccl_without_device_rows: int = 0        # NCCL collectives traced without GPU rows
    host_collectives_on_device: int = 0      # device rows, collectives only on the host (hccl)
    steps_from_optimizer: int = 0            # steps read from Optimizer.step# (no ProfilerStep)
    no_backward_marker: int = 0              # ranks without autograd ops or a backward annotation
    backward_from_annotation: int = 0        # ranks whose backward starts at an annotation
    runs_clipped: int = 0                    # compute runs cut where the next one starts
    tail_work_between_collectives: int = 0   # ops between two gradient collectives of a step
    data_loading_ops: int = 0                # CPU ops under enumerate(DataLoader)
    # collectives of unknown kind ("<kind>") and p2p ops ("<kind>: <why>") left out
    left_out: Counter[str] = field(default_factory=Counter)
    p2p_left_out: Counter[tuple[str, str]] = field(default_factory=Counter)

    def add(self, other: ReadCounts) -> None:
        """Add `other`'s counts to these."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, Counter):
                mine.update(theirs)
            else:
                setattr(self, f.name, mine + theirs)

    def copy(self) -> ReadCounts:
        """An independent copy."""
        return dataclasses.replace(self, left_out=Counter(self.left_out),
                                   p2p_left_out=Counter(self.p2p_left_out))


@dataclass
class RankParts:
    """What one file contributes, before the job's layout is known (picklable, compact)."""

    source: str
    rank: int | None
    distributed_info: DistributedInfo | None
    base_ns: int
    host: str | None
    run_ids: dict[str, str]
    record_shapes: bool
    pg_ranks: dict[str, tuple[int, ...]]
    mode: str                                   # "gpu" or "cpu"
    step_ids: list[int]
    step_spans: list[tuple[float, float]]
    # compute items: start, end, launch key, step index, phase (one row per kernel / CPU op)
    item_start: np.ndarray
    item_end: np.ndarray
    item_key: np.ndarray
    item_step: np.ndarray
    item_phase: np.ndarray
    colls: list[Coll]
    counts: ReadCounts = field(default_factory=ReadCounts)


@dataclass
class RankRows:
    """One rank's op rows (times in µs on the file's own time base) and its sync points."""

    placement: Placement
    mode: str                                      # "gpu" or "cpu"
    step: np.ndarray
    optype: np.ndarray
    start_us: np.ndarray
    dur_us: np.ndarray
    sync: dict[tuple, float] = field(default_factory=dict)   # collective key → end (µs)
    sync_span: dict[tuple, tuple[float, float]] = field(default_factory=dict)  # key → start, end
    counts: ReadCounts = field(default_factory=ReadCounts)    # things worth a note
    group: list = field(default_factory=list)   # per row: its collective's process group or None
    tokens: list = field(default_factory=list)  # per row: rows an all-to-all received, else -1
    sent: list = field(default_factory=list)    # per row: rows an all-to-all sent, else -1
    # ring exchange groups (three or more ranks): group → (previous, next) rank in the ring
    ring_peers: dict[str, tuple[int, int]] = field(default_factory=dict)


def rank_rows(parts: RankParts, placement: Placement) -> RankRows:
    """The op rows of one rank, once its place in the job (and its peers') is known."""
    counts = parts.counts.copy()
    rows: list[tuple[int, int, float, float]] = []   # (step index, optype code, start, dur)
    sync: dict[tuple, float] = {}
    spans: dict[tuple, tuple[float, float]] = {}
    peers: dict[str, tuple[int, int]] = {}
    emitted = _collective_rows(parts, placement, rows, sync, spans, counts, peers)
    # Every collective splits compute: pipeline sends/recvs separate microbatches, the work
    # after an all-to-all needs its result, and each of DDP's bucket all-reduces follows the
    # backward work that produced its bucket (whole, the backward would hide a slow rank's
    # progress in the buckets' launch delays). The pieces are unlike work: the trace says so
    # (meta.extra["compute_split_at_collectives"]) and the ideal is taken per piece.
    cuts = [(c, o) for c, o in emitted if c.kind in P2P_KINDS or o in BLOCKING_NAMES
            or o in GRADIENT_NAMES or o in CROSS_STAGE_NAMES]
    _compute_ops(parts, cuts, rows, counts)
    if not rows:
        raise InputError(parts.source, "traceEvents", "no compute or collective falls inside "
                         "any ProfilerStep#N span")
    step_ids = np.array(parts.step_ids, dtype=np.int64)[[r[0] for r in rows]]
    return RankRows(placement, parts.mode, step_ids,
                    np.array([r[1] for r in rows], dtype=np.int8),
                    np.array([r[2] for r in rows], dtype=np.float64),
                    np.array([r[3] for r in rows], dtype=np.float64), sync, spans, counts,
                    [r[4] if len(r) > 4 else None for r in rows],
                    [r[5] if len(r) > 5 else -1 for r in rows],
                    [r[6] if len(r) > 6 else -1 for r in rows], peers)


def _or_unknown(rows: int | None) -> int:
    """A row count for the op table: -1 where the trace does not give it."""
    return -1 if rows is None else rows


def _compute_ops(parts: RankParts, colls: list[tuple[Coll, str]], rows: list,
                 counts: ReadCounts) -> None:
    """Compute ops: items of one phase issued between two collectives; the duration is the busy
    time (union of the items' intervals) from the first item's start.

    Array work, not an object per item: a rank of a 1 GB trace holds over a million items, and
    per-item lists held ~0.4 GB each (kept by the allocator after they were freed).
    """
    n = len(parts.item_start)
    if not n:
        return
    bridge = CPU_DISPATCH_GAP_US if parts.mode == "cpu" else 0.0
    seg, step, phase, idx = _segments(parts, colls)
    # A run: consecutive items (in issue order) of one segment, step and phase.
    cut = np.ones(n, dtype=bool)
    cut[1:] = (seg[1:] != seg[:-1]) | (step[1:] != step[:-1]) | (phase[1:] != phase[:-1])
    bounds = np.flatnonzero(cut)
    out: list[tuple[int, int, float, float]] = []
    for lo, hi in zip(bounds, np.append(bounds[1:], n)):
        items = idx[lo:hi]
        start, end = parts.item_start[items], parts.item_end[items]
        order = np.argsort(start, kind="stable")
        start, end = start[order], end[order]
        reach = np.maximum.accumulate(end)
        # Busy time: the union of the intervals (kernels on concurrent streams overlap).
        gaps = np.maximum(start[1:] - reach[:-1], 0.0)
        # On CPU traces the interpreter runs between two recorded ops: short gaps are that
        # work (Python dispatching the next op), not idle time.
        gaps[gaps < bridge] = 0.0
        busy = float(reach[-1] - start[0] - gaps.sum())
        out.append((int(step[lo]), int(phase[lo]), float(start[0]), busy))
    out.sort(key=lambda r: (r[0], r[2]))
    for i, (s, ph, start, busy) in enumerate(out):
        # Work on concurrent streams can overlap the next op; the chain model needs them apart.
        if i + 1 < len(out) and out[i + 1][0] == s and start + busy > out[i + 1][2]:
            busy = max(out[i + 1][2] - start, 0.0)
            counts.runs_clipped += 1
        rows.append((s, OPTYPE_CODES[PHASE_OPTYPES[ph]], start, busy))


def _segments(parts: RankParts, colls: list[tuple[Coll, str]]):
    """(segment, step, phase, item index) of every item in issue order: a segment is the work
    between two collectives (issued before an item at the same time: the collective first);
    the work just before a pipeline send takes the send's direction."""
    n, m = len(parts.item_start), len(colls)
    steps = np.concatenate([parts.item_step.astype(np.int64),
                            np.array([c.step for c, _ in colls], dtype=np.int64)])
    keys = np.concatenate([parts.item_key.astype(np.float64),
                           np.array([c.launch for c, _ in colls], dtype=np.float64)])
    is_item = np.concatenate([np.ones(n, dtype=bool), np.zeros(m, dtype=bool)])
    which = np.concatenate([np.arange(n), np.arange(m)])
    order = np.lexsort((which, is_item, keys, steps))
    seen = np.cumsum(~is_item[order])                     # collectives issued so far
    mine = is_item[order]
    which = which[order]
    idx = which[mine]
    seg, step = seen[mine], steps[order][mine]
    phase = parts.item_phase[idx].astype(np.int64)
    # The work just before a send produced what it sends: an activation (forward) or a
    # gradient (backward), whatever the ops looked like (extra work after an autograd call).
    for pos in np.flatnonzero(~mine):
        optype = colls[which[pos]][1]
        if optype not in ("forward-send", "backward-send"):
            continue
        before = int(seen[pos]) - 1                       # the segment this send closes
        hi = int(np.searchsorted(seg, before, side="right"))
        lo = int(np.searchsorted(seg, before, side="left"))
        if hi == lo:
            continue
        lo = hi - int(np.sum(step[lo:hi] == step[hi - 1]))   # the last step's items of it
        tail = phase[lo:hi]
        other = np.flatnonzero(tail != tail[-1])
        first = lo + (int(other[-1]) + 1 if len(other) else 0)
        phase[first:hi] = _FWD if optype == "forward-send" else _BWD
    return seg, step, phase, idx


# The first item of a ring exchange's sync key (align.clock_offsets uses those last).
RING_SYNC = "ring"
# How a collective is matched across ranks: (group, "seq", Seq) or (group, step, kind, order).
SyncKey = tuple[str, str, int] | tuple[str, int, str, int]


def sync_key(c: Coll, parts: RankParts, placement: Placement, index: Counter) -> SyncKey:
    """How one collective is matched across ranks: (group, Seq), else order within the group."""
    pg = c.pg if c.pg is not None else f"?{placement.stage}"
    kind = c.kind or "unknown"
    if c.seq is not None:
        return (pg, "seq", c.seq)
    step_id = parts.step_ids[c.step]
    key: SyncKey = (pg, step_id, kind, index[(pg, step_id, kind)])
    index[(pg, step_id, kind)] += 1
    return key


def ring_peers(rank: int, src: int | None, dst: int | None, members: tuple[int, ...]
               ) -> tuple[int, int] | None:
    """(previous, next) rank of `rank` in its ring: the exchange's own peers where the trace
    names them (global ranks, or group-local ones as gloo's are), else its neighbours in the
    group's member order (ring attention's order)."""
    if src is not None and dst is not None:
        if src in members and dst in members:
            return src, dst
        if 0 <= src < len(members) and 0 <= dst < len(members):
            return members[src], members[dst]
    if rank not in members:
        return None
    i = members.index(rank)
    return members[i - 1], members[(i + 1) % len(members)]


def _collective_rows(parts: RankParts, placement: Placement, rows: list, sync: dict,
                     spans: dict, counts: ReadCounts, peers: dict[str, tuple[int, int]]
                     ) -> list[tuple[Coll, str]]:
    """Rows for collectives with an op type; every non-p2p collective is a clock sync point
    (a ring exchange's a weaker one: its group's ring `peers` go with it)."""
    index: Counter = Counter()
    emitted: list[tuple[Coll, str]] = []
    for c in sorted(parts.colls, key=lambda c: c.start):
        kind = c.kind or "unknown"
        if kind in P2P_KINDS:
            optype, why = p2p_optype(kind, c, placement)
            if optype is None and kind == "sendrecv" and placement.pp_size <= 1:
                optype = SEND_RECV   # an exchange among peers: blocking, as a collective
                key = sync_key(c, parts, placement, index)
                sync.setdefault(key, c.end)
                spans.setdefault(key, (c.start, c.end))
            elif optype is None:
                counts.p2p_left_out[(kind, why)] += 1
                continue
        else:
            gradient = COLLECTIVE_OPTYPES.get(kind)
            if gradient is not None and c.pg is not None and c.pg in placement.model_parallel:
                gradient = MODEL_PARALLEL_OPTYPES[kind]
            optype = cross_stage_optype(kind, c, parts, placement) or gradient \
                or BLOCKING_OPTYPES.get(kind)
            key = sync_key(c, parts, placement, index)
            members = parts.pg_ranks.get(c.pg or "") or ()
            if kind == "exchange" and len(members) > 2:
                # a ring's rank ends its round when its own neighbours' transfers end, not
                # with the group: a clock sync point only where nothing else is shared
                key = (RING_SYNC, *key)
                ring = ring_peers(placement.rank, c.src, c.dst, tuple(members))
                if ring is not None and c.pg is not None:
                    peers.setdefault(c.pg, ring)
            sync.setdefault(key, c.end)
            spans.setdefault(key, (c.start, c.end))
            if optype is None:
                counts.left_out[kind] += 1
                continue
        # pipeline p2p pairs its two stages (the model's own groups); collectives their group
        group = c.pg if kind not in P2P_KINDS or optype == SEND_RECV else None
        moved = c.rows if optype == "all-to-all" else None
        rows.append((c.step, OPTYPE_CODES[optype], c.start, c.end - c.start, group,
                     _or_unknown(moved.received if moved else None),
                     _or_unknown(moved.sent if moved else None)))
        emitted.append((c, optype))
    return emitted


def cross_stage_optype(kind: str, c: Coll, parts: RankParts, placement: Placement
                       ) -> str | None:
    """The model's cross-stage op type of a pipeline job's all-reduce whose process group
    spans stages: every stage, the gradient norm of clipping (`optimizer-clip-main-grad`);
    some, a tied embedding's gradients (`embedding-grads-all-reduce`). Read as a stage's DP
    all-reduce, the wait of one stage for another became transfer time. None otherwise (also
    where the collective names no group: gloo's profiler does not)."""
    if kind != "allreduce" or placement.pp_size <= 1 or placement.stage_of is None \
            or c.pg is None:
        return None
    members = parts.pg_ranks.get(c.pg) or ()
    stages = {placement.stage_of(m) for m in members} - {-10} | {placement.stage}
    if len(stages) < 2:
        return None
    return ("optimizer-clip-main-grad" if len(stages) >= placement.pp_size
            else "embedding-grads-all-reduce")


def p2p_optype(kind: str, c: Coll, placement: Placement) -> tuple[str | None, str]:
    """(forward/backward send/recv, "") when the peer's stage is known, else (None, why)."""
    if kind == "sendrecv":
        return None, "combined send/recv"
    peer = c.dst if kind == "send" else c.src
    if placement.stage_of is None:
        return None, "no pipeline stages"
    if peer is None:
        # The first stage only sends forward and receives backward, the last the reverse.
        last = placement.pp_size - 1
        if placement.stage == 0 and last > 0:
            return ("forward-send" if kind == "send" else "backward-recv"), ""
        if placement.stage == last and last > 0:
            return ("backward-send" if kind == "send" else "forward-recv"), ""
        return None, "no peer rank (profile with record_shapes=True so c10d ops carry it)"
    delta = placement.stage_of(peer) - placement.stage
    if kind == "send":
        optype = {1: "forward-send", -1: "backward-send"}.get(delta)
    else:
        optype = {-1: "forward-recv", 1: "backward-recv"}.get(delta)
    return optype, ("" if optype else "peer not on a neighbouring stage")
