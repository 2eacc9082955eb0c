"""One rank's compute items and collectives from its decoded events (the per-file stage).

GPU traces use device kernels (time on the GPU clock); traces without device rows (gloo,
CPU-only) use top-level CPU ops. Each item keeps its step, phase (forward, backward,
optimizer) and launch time, which orders it among the collectives the program issued.
"""

from __future__ import annotations

import bisect
from collections import Counter

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.kineto.events import BACKWARD_OP, COMM_OP, NO_WORK_OP, RankEvents
from stragglers.trace.kineto.ops import (
    _BWD, _FWD, _OPT, COLLECTIVE_OPTYPES, P2P_KINDS, Coll, RankParts)


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
        """0 forward, 1 backward, 2 optimizer for a CPU time t in step i (by phase marks)."""
        if t >= self.opt[i]:
            return _OPT
        return _BWD if t >= self.bwd[i] else _FWD


class _TopLevel:
    """Top-level CPU ops per thread, to ask which op (autograd or not) holds a time."""

    def __init__(self, cpu_ops: list[tuple]):
        by_tid: dict = {}
        for ts, dur, tid, flag in cpu_ops:
            by_tid.setdefault(tid, []).append((ts, ts + dur, flag))
        self.ops: dict = {}
        for tid, ops in by_tid.items():
            ops.sort(key=lambda o: (o[0], -o[1]))
            top, end = [], -float("inf")
            for o in ops:
                if o[0] >= end:
                    top.append(o)
                    end = o[1]
            self.ops[tid] = ([o[0] for o in top], top)
        # A thread that only runs autograd ops (CUDA's device threads) is a backward thread.
        self.backward_threads = {tid for tid, (_, top) in self.ops.items()
                                 if top and sum(o[2] == BACKWARD_OP for o in top) > 0.9 * len(top)}

    def flag_at(self, tid, t: float) -> int | None:
        """The flag of the top-level op on tid holding t (None outside every op)."""
        found = self.ops.get(tid)
        if not found:
            return None
        starts, top = found
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and t <= top[i][1]:
            return top[i][2]
        return BACKWARD_OP if tid in self.backward_threads else None


def rank_parts(ev: RankEvents) -> RankParts:
    """The compute items and collectives of one rank: GPU kernels when the trace has them,
    else top-level CPU ops."""
    if not ev.steps and not ev.gpu_steps:
        raise InputError(ev.source, "traceEvents", "no ProfilerStep#N annotations, so steps "
                         "cannot be told apart; profile with torch.profiler.profile(schedule=...) "
                         "and call prof.step() once per training step")
    big = [n for n, _, _ in ev.steps + ev.gpu_steps if n >= 2**62]
    if big:
        raise InputError(ev.source, "traceEvents", f"ProfilerStep#{big[0]}: step number too large")
    steps = _Steps(ev.steps or ev.gpu_steps, ev)
    counts: Counter = Counter()
    top = _TopLevel(ev.cpu_ops)
    by_ops = any(flag == BACKWARD_OP for *_, flag in ev.cpu_ops)
    if not by_ops:
        if steps.marks_from is None:
            counts["no backward marker"] += 1
        elif steps.marks_from == "annotation":
            counts["backward from annotation"] += 1
    if ev.kernels:
        mode = "gpu"
        items, colls = _gpu_items(ev, steps, top, by_ops, counts)
    else:
        mode = "cpu"
        items, colls = _cpu_items(ev, steps, top, by_ops, counts)
    if not items and not colls:
        raise InputError(ev.source, "traceEvents", f"no {'kernels' if mode == 'gpu' else 'CPU ops'}"
                         " or collectives fall inside any ProfilerStep#N span")
    arr = np.array(items, dtype=np.float64).reshape(-1, 5)
    if by_ops:
        arr = arr[_step_tail_phases(arr, colls, counts)]
    return RankParts(
        ev.source, ev.rank, _small_info(ev.distributed_info), ev.base_ns, ev.host, ev.run_ids,
        ev.record_shapes, ev.pg_ranks, mode, steps.ids,
        list(zip(steps.starts, steps.ends)), arr[:, 0].copy(), arr[:, 1].copy(),
        arr[:, 2].copy(), arr[:, 3].astype(np.int64), arr[:, 4].astype(np.int8), colls, counts)


def _small_info(info: dict | None) -> dict | None:
    """distributedInfo without bulky entries we never read."""
    if info is None:
        return None
    return {k: v for k, v in info.items() if k in ("backend", "rank", "world_size", "pg_config",
                                                    "pg_count", "nccl_version")}


def _phase_of(steps: _Steps, top: _TopLevel, by_ops: bool, s: int, t: float, tid) -> int:
    """Phase of work issued at CPU time t on thread tid in step s.

    With autograd ops in the trace, work issued inside an autograd op is backward and other
    work forward (pipelines interleave them); the step tail is fixed up afterwards. Without
    them, phases follow the step's marks in time.
    """
    if t >= steps.opt[s]:
        return _OPT
    if by_ops:
        return _BWD if top.flag_at(tid, t) == BACKWARD_OP else _FWD
    return steps.phase(s, t)


def _step_tail_phases(arr: np.ndarray, colls: list[Coll], counts: Counter) -> np.ndarray:
    """Phases of the step tail: non-autograd work issued after a step's last backward item.

    Work issued before the tail's first gradient collective ends backward; work issued after
    its last one (DDP's copy of buckets back to the grads, clipping, the optimizer) waits for
    it: the optimizer op. Work between two of them (a gradient norm between the gradient and
    the clipping all-reduce) is no op type of the model; like the recorder, it is left to show
    as launch delay of the next collective. Returns the mask of items kept.
    """
    keep = np.ones(len(arr), dtype=bool)
    if not len(arr):
        return keep
    key, step, phase = arr[:, 2], arr[:, 3].astype(np.int64), arr[:, 4]
    launches: dict[int, list[float]] = {}
    p2p: dict[int, list[float]] = {}
    for c in colls:
        if c.kind in COLLECTIVE_OPTYPES:
            launches.setdefault(c.step, []).append(c.launch)
        elif c.kind in P2P_KINDS:
            p2p.setdefault(c.step, []).append(c.launch)
    # one pass over the steps, each on its own slice (a mask over all items per step was
    # quadratic: 16 s of a 1 GB trace's 37)
    order = np.argsort(step, kind="stable")
    bounds = np.flatnonzero(np.diff(step[order])) + 1
    for idx in np.split(order, bounds):
        s = int(step[idx[0]])
        k, ph = key[idx], phase[idx]
        bwd = ph == _BWD
        if not bwd.any():
            continue
        last = k[bwd].max()
        tail = (ph == _FWD) & (k > last)
        after = sorted(t for t in launches.get(s, []) if t > last)
        if after:
            # Before the first gradient collective: the end of backward (work the backward
            # did after its last autograd op, grads gathered into buckets).
            # (Only when no send/recv separates it from backward; else it would be a new
            # backward op of its own: launch delay, as between collectives.)
            cut = min([t for t in p2p.get(s, []) if t > last] + [after[0]])
            phase[idx[tail & (k < cut)]] = _BWD
            between = tail & (k > cut) & (k < after[-1])
            keep[idx[between]] = False
            counts["tail work between collectives"] += int(between.sum())
            tail &= k > after[-1]
        phase[idx[tail]] = _OPT
    return keep


def _gpu_items(ev: RankEvents, steps: _Steps, top: _TopLevel, by_ops: bool, counts: Counter):
    """Compute kernels (start, end, key, step, phase) and NCCL collectives, on the GPU clock."""
    gpu_steps = _Steps(ev.gpu_steps, ev) if ev.gpu_steps and ev.steps else None
    cpu_colls = _index_by_tid(ev.collectives)
    order = sorted(range(len(ev.kernels)), key=lambda k: ev.kernels[k][0])
    items: list[tuple] = []
    colls: list[Coll] = []
    last_phase: dict[int, int] = {}
    last_key: dict[int, float] = {}
    # Correlation ids grow with every launch: a kernel whose id is below every launch the
    # window recorded was launched before the window, by the step before the first traced
    # one (its GPU work runs into that step's span). It is no work of any traced step.
    first_corr = min(ev.runtime) if ev.runtime else None
    for k in order:
        ts, dur, _stream, corr, nccl, kind_args, kind_name, pg, seq, src, dst = ev.kernels[k]
        launch = ev.runtime.get(corr) if corr is not None else None
        if launch is None and first_corr is not None and _before(corr, first_corr):
            counts["pre-window kernels"] += 1
            continue
        if launch is not None:
            s = steps.index(launch[0])
            phase = _phase_of(steps, top, by_ops, s, launch[0], launch[1]) if s >= 0 else _FWD
            key = launch[0]
        else:
            counts["kernels without launch"] += 1
            s = gpu_steps.index(ts) if gpu_steps is not None else steps.index(ts)
            phase = last_phase.get(s, _FWD)  # an unlinked kernel continues the phase before it
            key = last_key.get(s, -float("inf"))
        if s < 0:
            counts["outside steps"] += 1
            continue
        if not by_ops:  # phases by marks never go back in GPU order
            phase = max(phase, last_phase.get(s, _FWD))
        last_phase[s] = phase
        last_key[s] = key
        if not nccl:
            items.append((ts, ts + dur, key, s, phase))
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
        colls.append(Coll(ts, ts + dur, key, s, kind, pg, seq, src, dst))
    return items, colls


def _before(corr, first) -> bool:
    """Whether a correlation id precedes the window's first recorded launch."""
    try:
        return corr < first
    except TypeError:      # ids of mixed types (a malformed trace): no order to go by
        return False


def _cpu_items(ev: RankEvents, steps: _Steps, top: _TopLevel, by_ops: bool, counts: Counter):
    """Top-level CPU ops (start, end, key, step, phase) and CPU-side collectives."""
    counts["cpu mode"] += 1
    loader = sorted(ev.loader)
    loader_starts = [a for a, _ in loader]
    items: list[tuple] = []
    for tid, (_, ops) in top.ops.items():
        for start, end, flag in ops:
            s = steps.index(start)
            if s < 0:
                counts["outside steps"] += 1
            if flag in (COMM_OP, NO_WORK_OP) or s < 0:
                continue
            j = bisect.bisect_right(loader_starts, start) - 1
            if j >= 0 and start <= loader[j][1]:
                counts["data loading ops"] += 1
                continue  # host-side input work: a launch delay of the forward, not compute
            if start >= steps.opt[s]:
                phase = _OPT
            elif by_ops:
                phase = _BWD if flag == BACKWARD_OP else _FWD
            else:
                phase = steps.phase(s, start)
            items.append((start, end, start, s, phase))
    colls: list[Coll] = []
    for ts, dur, launch, kind, pg, seq, src, dst in _cpu_collectives(ev, counts):
        s = steps.index(launch)
        if s < 0:
            s = steps.index(ts)
        if s >= 0:
            colls.append(Coll(ts, ts + dur, launch, s, kind, pg, seq, src, dst))
        else:
            counts["outside steps"] += 1
    if ev.distributed_info and str(ev.distributed_info.get("backend", "")).lower() == "nccl":
        counts["nccl without device rows"] += 1
    return items, colls


def _cpu_collectives(ev: RankEvents, counts: Counter) -> list[tuple]:
    """CPU collectives as (ts, dur, launch, kind, pg, seq, src, dst).

    Backend annotations (gloo:all_reduce, nccl:send) span the work itself; record_param_comms
    and c10d:: ops are where the program issued it, and carry the process group, sequence
    number and peer. Each annotation takes its issuing op's metadata and time: the op on the
    same thread overlapping it (nccl: record_param_comms around nccl:all_reduce), else the
    issuing op of the same kind in the same order (gloo runs collectives on its own threads).
    Without annotations the issuing ops stand in for the work.
    """
    annotated = sorted((c for c in ev.collectives if c[8]), key=lambda c: c[0])
    issued = sorted((c for c in ev.collectives if not c[8]), key=lambda c: c[0])
    if not annotated:
        return [(c[0], c[1], c[0], c[3], c[4], c[5], c[6], c[7]) for c in _outermost(issued)]
    annotated = _outermost(annotated)
    partner: dict[int, tuple] = {}
    used: set[int] = set()
    by_tid = _index_by_tid(issued)
    index = {id(c): i for i, c in enumerate(issued)}
    for i, a in enumerate(annotated):
        for c in by_tid.get(a[2], []):
            if c[3] == a[3] and c[0] <= a[0] + a[1] and a[0] <= c[0] + c[1] and index[id(c)] not in used:
                partner[i] = c
                used.add(index[id(c)])
                break
    for kind in {a[3] for a in annotated}:
        mine = [i for i, a in enumerate(annotated) if a[3] == kind and i not in partner]
        theirs = [c for j, c in enumerate(issued) if c[3] == kind and j not in used]
        pairs = _pair_in_order([annotated[i] for i in mine], theirs)
        partner.update((mine[i], theirs[j]) for i, j in pairs)
        counts["unpaired annotations"] += len(mine) - len(pairs)
    out = []
    for i, a in enumerate(annotated):
        ts, dur, _tid, kind, pg, seq, src, dst, _ = a
        c = partner.get(i)
        launch = ts
        if c is not None:
            launch = min(ts, c[0])
            pg = pg if pg is not None else c[4]
            seq = seq if seq is not None else c[5]
            src = src if src is not None else c[6]
            dst = dst if dst is not None else c[7]
        out.append((ts, dur, launch, kind, pg, seq, src, dst))
    return out


MAX_CUT_OFF = 8   # works or ops a profiled window's edges may cut off, per collective kind


def _pair_in_order(work: list[tuple], issued: list[tuple]) -> list[tuple[int, int]]:
    """(i, j) pairs of annotations (the work, in time order) with the ops that issued them (in
    time order): in order, at the offset that fits their times.

    An op is issued before its work starts, so a right pairing has no work starting before its
    op, and among those the shortest waits. Pairing simply first-with-first is off by one for
    the whole trace when the profiled window holds the work of an op issued before it started
    (on a busy machine gloo's thread runs it late) or misses the work of its last op; every op
    then took its neighbour's issue time and peer, and all steps came out incomplete.
    """
    n, m = len(work), len(issued)
    if not n or not m or abs(n - m) > MAX_CUT_OFF:
        return []   # not a window's edges: more than that is missing on one side
    reach = abs(n - m) + 2
    best, best_key = [], None
    for off in range(-reach, reach + 1):   # work i ↔ op i - off
        pairs = [(i, i - off) for i in range(max(0, off), min(n, m + off))]
        if not pairs:
            continue
        lags = sorted(work[i][0] - issued[j][0] for i, j in pairs)
        early = sum(lag < -1e-6 for lag in lags)   # work before its op: not its op
        key = (early, lags[len(lags) // 2], -len(pairs))
        if best_key is None or key < best_key:
            best, best_key = pairs, key
    return best


def _outermost(colls: list[tuple]) -> list[tuple]:
    """Drop collectives nested in one of the same kind on the same thread (one collective
    seen twice). Other kinds may overlap: an isend's span lasts until it completes."""
    out = []
    for tid_colls in _index_by_tid(colls).values():
        outer_end: dict = {}
        for c in tid_colls:
            if c[0] < outer_end.get(c[3], -float("inf")):
                continue
            outer_end[c[3]] = c[0] + c[1]
            out.append(c)
    return sorted(out, key=lambda c: c[0])


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
    j = bisect.bisect_right([c[0] for c in colls], t) if len(colls) < 64 else _bisect_ts(colls, t)
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
