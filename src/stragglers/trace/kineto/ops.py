"""Turn one rank's profiler events into op-table rows: compute runs, collectives, steps.

GPU traces use device kernels (time on the GPU clock); traces without device rows (gloo,
CPU-only) use CPU ops the same way. A step is the span of a `ProfilerStep#N` annotation; within
it, forward ends where backward starts (the first `autograd::engine::evaluate_function` op) and
backward ends where the optimizer starts (the first `Optimizer.step#` annotation).
"""

from __future__ import annotations

import bisect
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.kineto.events import RankEvents
from stragglers.trace.model import OPTYPE_CODES

# Collectives the op table has an op type for. The rest (all-to-all, broadcast, barrier, …)
# are left out of the rows but still used to align clocks.
COLLECTIVE_OPTYPES = {
    "allreduce": "grads-all-reduce",
    "reducescatter": "grads-reduce-scatter",
    "allgather": "params-all-gather",
}
P2P_KINDS = {"send", "recv", "sendrecv"}
PHASE_OPTYPES = ("forward-compute", "backward-compute", "optimizer")
_FWD, _BWD, _OPT = 0, 1, 2


@dataclass
class Placement:
    """Where a rank sits in the job: its DP rank and pipeline stage, and how to place a peer."""

    rank: int
    dp_rank: int
    stage: int
    stage_of: Callable[[int], int] | None = None  # peer rank → stage, when pipeline is known


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
    counts: Counter = field(default_factory=Counter)          # things worth a note


class _Steps:
    """ProfilerStep spans with lookups of the step a time falls in and its phase boundaries."""

    def __init__(self, spans: list[tuple[int, float, float]], ev: RankEvents):
        seen: dict[int, tuple[float, float]] = {}
        for n, ts, dur in sorted(spans, key=lambda s: s[1]):
            seen.setdefault(n, (ts, ts + dur))
        items = sorted(seen.items(), key=lambda kv: kv[1][0])
        self.ids = [n for n, _ in items]
        self.starts = [a for _, (a, _) in items]
        self.ends = [b for _, (_, b) in items]
        marks = sorted(ev.backward) or sorted(ev.backward_annotations)
        self.marks_from = "evaluate_function" if ev.backward else (
            "annotation" if ev.backward_annotations else None)
        opt = sorted(ev.optimizer)
        self.bwd = [self._first_in(marks, i) for i in range(len(self.ids))]
        self.opt = [self._first_in(opt, i) for i in range(len(self.ids))]

    def _first_in(self, times: list[float], i: int) -> float:
        j = bisect.bisect_left(times, self.starts[i])
        return times[j] if j < len(times) and times[j] <= self.ends[i] else float("inf")

    def index(self, t: float) -> int:
        """Index of the step whose span holds t, or -1."""
        i = bisect.bisect_right(self.starts, t) - 1
        return i if i >= 0 and t <= self.ends[i] else -1

    def phase(self, i: int, t: float) -> int:
        """0 forward, 1 backward, 2 optimizer for a CPU time t in step i."""
        if t >= self.opt[i]:
            return _OPT
        return _BWD if t >= self.bwd[i] else _FWD


def rank_rows(ev: RankEvents, placement: Placement) -> RankRows:
    """The op rows of one rank: GPU kernels when the trace has them, else CPU ops."""
    if not ev.steps and not ev.gpu_steps:
        raise InputError(ev.source, "traceEvents", "no ProfilerStep#N annotations, so steps "
                         "cannot be told apart; profile with torch.profiler.profile(schedule=...) "
                         "and call prof.step() once per training step")
    big = [n for n, _, _ in ev.steps + ev.gpu_steps if n >= 2**62]
    if big:
        raise InputError(ev.source, "traceEvents", f"ProfilerStep#{big[0]}: step number too large")
    steps = _Steps(ev.steps or ev.gpu_steps, ev)
    counts: Counter = Counter()
    if steps.marks_from is None:
        counts["no backward marker"] += 1
    elif steps.marks_from == "annotation":
        counts["backward from annotation"] += 1
    if ev.kernels:
        mode = "gpu"
        items, colls = _gpu_items(ev, steps, counts)
    else:
        mode = "cpu"
        items, colls = _cpu_items(ev, steps, counts)
    rows: list[tuple[int, int, float, float]] = []   # (step index, optype code, start, dur)
    sync: dict[tuple, float] = {}
    emitted = _collective_rows(colls, steps, placement, rows, sync, counts)
    # Only collectives that become rows split compute: the others (all-to-all, broadcast) would
    # make the number of compute ops differ between ranks that the engine must line up.
    _compute_runs(items, emitted, rows, counts)
    if not rows:
        raise InputError(ev.source, "traceEvents", f"no {'kernels' if mode == 'gpu' else 'CPU ops'}"
                         " or collectives fall inside any ProfilerStep#N span")
    step_ids = np.array(steps.ids, dtype=np.int64)[[r[0] for r in rows]]
    return RankRows(placement, mode, step_ids, np.array([r[1] for r in rows], dtype=np.int8),
                    np.array([r[2] for r in rows], dtype=np.float64),
                    np.array([r[3] for r in rows], dtype=np.float64), sync, counts)


# An item: (start, end, step index, phase) for compute; collectives carry their metadata.
@dataclass
class _Coll:
    start: float
    end: float
    step: int
    kind: str | None
    pg: str | None
    seq: int | None
    src: int | None
    dst: int | None


def _gpu_items(ev: RankEvents, steps: _Steps, counts: Counter):
    """Compute kernels (start, end, step, phase) and NCCL collectives, on the GPU clock."""
    gpu_steps = _Steps(ev.gpu_steps, ev) if ev.gpu_steps and ev.steps else None
    cpu_colls = _index_by_tid(ev.collectives)
    order = sorted(range(len(ev.kernels)), key=lambda k: ev.kernels[k][0])
    items: list[tuple[float, float, int, int]] = []
    colls: list[_Coll] = []
    last_phase: dict[int, int] = {}
    for k in order:
        ts, dur, _stream, corr, nccl, kind_args, kind_name, pg, seq, src, dst = ev.kernels[k]
        launch = ev.runtime.get(corr) if corr is not None else None
        if launch is not None:
            s = steps.index(launch[0])
            phase = steps.phase(s, launch[0]) if s >= 0 else _FWD
        else:
            counts["kernels without launch"] += 1
            s = gpu_steps.index(ts) if gpu_steps is not None else steps.index(ts)
            phase = last_phase.get(s, _FWD)  # an unlinked kernel continues the phase before it
        if s < 0:
            counts["outside steps"] += 1
            continue
        # Kernels run in launch order per stream; keep phases monotone in GPU time.
        phase = max(phase, last_phase.get(s, _FWD))
        last_phase[s] = phase
        if not nccl:
            items.append((ts, ts + dur, s, phase))
            continue
        kind = kind_args
        host = _enclosing(cpu_colls, launch) if launch is not None else None
        if host is not None:
            kind = kind or host[3]
            pg = pg if pg is not None else host[4]
            seq = seq if seq is not None else host[5]
            src = src if src is not None else host[6]
            dst = dst if dst is not None else host[7]
        kind = kind or kind_name
        colls.append(_Coll(ts, ts + dur, s, kind, pg, seq, src, dst))
    return items, colls


def _cpu_items(ev: RankEvents, steps: _Steps, counts: Counter):
    """Top-level CPU ops (start, end, step, phase) and CPU-side collectives."""
    counts["cpu mode"] += 1
    by_tid: dict = {}
    for ts, dur, tid, comm in ev.cpu_ops:
        by_tid.setdefault(tid, []).append((ts, ts + dur, comm))
    items: list[tuple[float, float, int, int]] = []
    for ops in by_tid.values():
        ops.sort(key=lambda o: (o[0], -o[1]))
        top_end = -float("inf")
        for start, end, comm in ops:
            if start < top_end:
                continue  # nested inside the current top-level op
            top_end = end
            s = steps.index(start)
            if s < 0:
                counts["outside steps"] += 1
            if comm or s < 0:
                continue
            items.append((start, end, s, steps.phase(s, start)))
    # Collective annotations (gloo:all_reduce) are the work itself; record_param_comms and
    # c10d:: ops are only the enqueue, so use them only when there are no annotations.
    annotated = [c for c in ev.collectives if c[8]]
    chosen = annotated or list(ev.collectives)
    if annotated and len(annotated) < len(ev.collectives):
        counts["enqueue ops ignored"] += len(ev.collectives) - len(annotated)
    colls: list[_Coll] = []
    for tid_colls in _index_by_tid(chosen).values():
        outer_end = -float("inf")
        for c in tid_colls:
            ts, dur, _tid, kind, pg, seq, src, dst, _ = c
            if ts < outer_end:
                continue  # the same collective seen twice (record_param_comms ⊃ nccl:all_reduce)
            outer_end = ts + dur
            s = steps.index(ts)
            if s >= 0:
                colls.append(_Coll(ts, ts + dur, s, kind, pg, seq, src, dst))
            else:
                counts["outside steps"] += 1
    if ev.distributed_info and str(ev.distributed_info.get("backend", "")).lower() == "nccl":
        counts["nccl without device rows"] += 1
    return items, colls


def _index_by_tid(colls: list[tuple]) -> dict:
    out: dict = {}
    for c in colls:
        out.setdefault(c[2], []).append(c)
    for v in out.values():
        v.sort(key=lambda c: (c[0], -c[1]))
    return out


def _enclosing(cpu_colls: dict, launch: tuple[float, object]) -> tuple | None:
    """The innermost CPU collective op on the launching thread whose span holds the launch."""
    t, tid = launch
    colls = cpu_colls.get(tid)
    if not colls:
        return None
    j = _bisect_ts(colls, t)
    for c in reversed(colls[max(0, j - 16):j]):
        if c[0] <= t <= c[0] + c[1]:
            return c
    return None


def _bisect_ts(colls: list[tuple], t: float) -> int:
    lo, hi = 0, len(colls)
    while lo < hi:
        mid = (lo + hi) // 2
        if colls[mid][0] <= t:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _compute_runs(items, colls: list[_Coll], rows: list, counts: Counter) -> None:
    """Contiguous runs of compute within a step: a collective start or a phase change ends one."""
    events = [(a, 1, b, s, p) for a, b, s, p in items] + [(c.start, 0, c.end, c.step, -1)
                                                          for c in colls]
    events.sort(key=lambda e: (e[3], e[0], e[1]))
    runs: list[list] = []   # [step, phase, start, end]
    current: list | None = None
    for start, is_compute, end, s, phase in events:
        if not is_compute:
            current = None
            continue
        if current is None or current[0] != s or current[1] != phase:
            current = [s, phase, start, end]
            runs.append(current)
        else:
            current[3] = max(current[3], end)
    for i, (s, phase, start, end) in enumerate(runs):
        # Work on concurrent streams can overlap the next run; the chain model needs them apart.
        if i + 1 < len(runs) and runs[i + 1][0] == s and end > runs[i + 1][2]:
            end = runs[i + 1][2]
            counts["runs clipped"] += 1
        rows.append((s, OPTYPE_CODES[PHASE_OPTYPES[phase]], start, end - start))


def _collective_rows(colls: list[_Coll], steps: _Steps, placement: Placement, rows: list,
                     sync: dict, counts: Counter) -> list[_Coll]:
    """Rows for collectives with an op type; every non-p2p collective is a clock sync point."""
    index: Counter = Counter()
    emitted: list[_Coll] = []
    for c in sorted(colls, key=lambda c: c.start):
        kind = c.kind or "unknown"
        if kind in P2P_KINDS:
            optype = _p2p_optype(kind, c, placement)
            if optype is None:
                counts[f"p2p {kind} left out"] += 1
                continue
        else:
            optype = COLLECTIVE_OPTYPES.get(kind)
            pg = c.pg if c.pg is not None else "?"
            if c.seq is not None:
                key: tuple = (pg, "seq", c.seq)
            else:
                step_id = steps.ids[c.step]
                key = (pg, step_id, kind, index[(pg, step_id, kind)])
                index[(pg, step_id, kind)] += 1
            sync.setdefault(key, c.end)
            if optype is None:
                counts[f"{kind} left out"] += 1
                continue
        rows.append((c.step, OPTYPE_CODES[optype], c.start, c.end - c.start))
        emitted.append(c)
    return emitted


def _p2p_optype(kind: str, c: _Coll, placement: Placement) -> str | None:
    """forward/backward send/recv when the peer's pipeline stage is known, else None."""
    if placement.stage_of is None or kind == "sendrecv":
        return None
    peer = c.dst if kind == "send" else c.src
    if peer is None:
        return None
    delta = placement.stage_of(peer) - placement.stage
    if kind == "send":
        return {1: "forward-send", -1: "backward-send"}.get(delta)
    return {-1: "forward-recv", 1: "backward-recv"}.get(delta)
