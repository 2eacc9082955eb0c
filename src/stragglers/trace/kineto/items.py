"""One rank's compute items and collectives from its decoded events (the per-file stage).

GPU traces use device kernels (time on the GPU clock); traces without device rows (gloo,
CPU-only) use top-level CPU ops. Each item keeps its step, phase (forward, backward,
optimizer) and launch time, which orders it among the collectives the program issued.
"""

from __future__ import annotations

import bisect

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.kineto.events import (BACKWARD_OP, COMM_OP, KNOWN_COLLECTIVES, NO_CORR,
                                           NO_WORK_OP, RankEvents)
from stragglers.trace.kineto.ops import (
    _BWD, _FWD, _OPT, COLLECTIVE_OPTYPES, P2P_KINDS, Coll, RankParts, ReadCounts)


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

    def indices(self, t: np.ndarray) -> np.ndarray:
        """Index of the step whose span holds each time, or -1."""
        starts, ends = np.asarray(self.starts), np.asarray(self.ends)
        if not len(starts):
            return np.full(len(t), -1, dtype=np.int64)
        i = np.searchsorted(starts, t, side="right") - 1
        return np.where((i >= 0) & (t <= ends[np.maximum(i, 0)]), i, -1)

    def phase(self, i: int, t: float) -> int:
        """0 forward, 1 backward, 2 optimizer for a CPU time t in step i (by phase marks)."""
        if t >= self.opt[i]:
            return _OPT
        return _BWD if t >= self.bwd[i] else _FWD


class _TopLevel:
    """Top-level CPU ops per thread, to ask which op (autograd or not) holds a time."""

    def __init__(self, ev: RankEvents, steps: _Steps):
        ts, dur = _column(ev.cpu_ts, np.float64), _column(ev.cpu_dur, np.float64)
        tid, flag = _column(ev.cpu_tid, np.int64), _column(ev.cpu_flag, np.int8)
        end = ts + dur
        order = np.lexsort((-end, ts, tid))        # per thread, by start, the enclosing op first
        bounds = np.flatnonzero(np.diff(tid[order])) + 1 if len(order) else np.zeros(0, int)
        # thread id (as the trace names it) → (starts, ends, flags) of its top-level ops
        self.ops: dict = {}
        for part in np.split(order, bounds) if len(order) else []:
            starts, ends = ts[part], end[part]
            keep = np.zeros(len(part), dtype=bool)
            reach = -float("inf")
            for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
                if a >= reach:
                    keep[i] = True
                    reach = b
            self.ops[ev.tids[int(tid[part[0]])]] = (starts[keep], ends[keep], flag[part][keep])
        # A thread that only runs autograd ops (CUDA's device threads) is a backward thread;
        # before PyTorch 1.10 (no evaluate_function op: the nodes are the autograd ops) so is
        # one that begins every step it works in with one, since the engine's sum_to and views
        # between two nodes were top-level ops of its own. (Later, DDP's copy of the buckets
        # back to the grads runs there too: the optimizer's, not backward work.)
        old = not ev.evaluate_functions
        self.backward_threads = {t for t, (a, _, f) in self.ops.items()
                                 if len(f) and (np.sum(f == BACKWARD_OP) > 0.9 * len(f) or (
                                     old and np.sum(f == BACKWARD_OP) >= 0.5 * len(f)
                                     and _opens_its_steps(a, f, steps)))}
        self._whole = {t for t in self.backward_threads
                       if np.sum(self.ops[t][2] == BACKWARD_OP) <= 0.9 * len(self.ops[t][2])}

    def flags_at(self, tids: np.ndarray, t: np.ndarray, names: list) -> np.ndarray:
        """The flag of the top-level op holding each time t on its thread (tids index
        `names`); -1 outside every op (BACKWARD_OP on a backward thread)."""
        out = np.full(len(t), -1, dtype=np.int64)
        for no in np.unique(tids):
            at = np.flatnonzero(tids == no)
            name = names[int(no)]
            found = self.ops.get(name)
            if name in self.backward_threads:
                out[at] = BACKWARD_OP
            if found is None or not len(found[0]):
                continue
            if name in self._whole:
                continue  # every op on it is backward work
            starts, ends, flags = found
            i = np.searchsorted(starts, t[at], side="right") - 1
            inside = (i >= 0) & (t[at] <= ends[np.maximum(i, 0)])
            out[at[inside]] = flags[i[inside]]
        return out


def _opens_its_steps(starts: np.ndarray, flags: np.ndarray, steps: _Steps) -> bool:
    """Whether a thread's first top-level op in every step it has ops in is an autograd op."""
    s = steps.indices(starts)
    firsts = np.flatnonzero(np.diff(s, prepend=-2) != 0)   # ops sorted by start: runs of a step
    firsts = firsts[s[firsts] >= 0]
    return bool(len(firsts)) and bool(np.all(flags[firsts] == BACKWARD_OP))


def _column(values, dtype) -> np.ndarray:
    """A decoded column (array.array) as numpy, without copying."""
    return np.frombuffer(values, dtype=dtype) if len(values) else np.zeros(0, dtype=dtype)


def rank_parts(ev: RankEvents) -> RankParts:
    """The compute items and collectives of one rank: GPU kernels when the trace has them,
    else top-level CPU ops."""
    counts = ReadCounts()
    if not ev.steps and not ev.gpu_steps:
        ev.steps = _steps_from_optimizer(ev)
        counts.steps_from_optimizer = len(ev.steps)
    if not ev.steps and not ev.gpu_steps:
        raise InputError(ev.source, "traceEvents", "no ProfilerStep#N annotations, so steps "
                         "cannot be told apart; profile with torch.profiler.profile(schedule=...) "
                         "and call prof.step() once per training step")
    big = [n for n, _, _ in ev.steps + ev.gpu_steps if n >= 2**62]
    if big:
        raise InputError(ev.source, "traceEvents", f"ProfilerStep#{big[0]}: step number too large")
    steps = _Steps(ev.steps or ev.gpu_steps, ev)
    top = _TopLevel(ev, steps)
    by_ops = BACKWARD_OP in ev.cpu_flag
    if not by_ops:
        if steps.marks_from is None:
            counts.no_backward_marker += 1
        elif steps.marks_from == "annotation":
            counts.backward_from_annotation += 1
    if ev.has_kernels:
        mode = "gpu"
        items, colls = _gpu_items(ev, steps, top, by_ops, counts)
        if not ev.nccl_kernels and any(c[8] not in (False, "nccl") for c in ev.collectives):
            # A device whose collectives leave no kernel (MTIA's hccl, gloo on GPU tensors):
            # the host-side annotations span the work. NCCL's only span its enqueue.
            colls = _host_collectives(ev, steps, counts)
            counts.host_collectives_on_device += 1
    else:
        mode = "cpu"
        items, colls = _cpu_items(ev, steps, top, by_ops, counts)
    if not len(items) and not colls:
        raise InputError(ev.source, "traceEvents", f"no {'kernels' if mode == 'gpu' else 'CPU ops'}"
                         " or collectives fall inside any ProfilerStep#N span")
    arr = np.asarray(items, dtype=np.float64).reshape(-1, 5)
    if by_ops:
        arr = arr[_step_tail_phases(arr, colls, counts)]
    return RankParts(
        ev.source, ev.rank, ev.distributed_info, ev.base_ns, ev.host, ev.run_ids,
        ev.record_shapes, ev.pg_ranks, mode, steps.ids,
        list(zip(steps.starts, steps.ends)), arr[:, 0].copy(), arr[:, 1].copy(),
        arr[:, 2].copy(), arr[:, 3].astype(np.int64), arr[:, 4].astype(np.int8), colls, counts)


def _steps_from_optimizer(ev: RankEvents) -> list[tuple[int, float, float]]:
    """Without ProfilerStep#N (a profiler without schedule or prof.step()): a training step
    ends where its Optimizer.step# does, so step k runs from the end of optimizer step k-1
    (the first from the first CPU op or launch) to the end of step k, numbered 1, 2, … in
    the window. None without at least two optimizer steps."""
    ends = sorted(ev.optimizer_ends)
    if len(ends) < 2:
        return []
    firsts = [float(np.min(_column(c, np.float64))) for c in (ev.cpu_ts, ev.runtime_ts) if len(c)]
    start = min(firsts + [min(ev.optimizer)])
    out = []
    for k, end in enumerate(ends):
        out.append((k + 1, start, end - start))
        start = end
    return out


def _step_tail_phases(arr: np.ndarray, colls: list[Coll], counts: ReadCounts) -> np.ndarray:
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
            counts.tail_work_between_collectives += int(between.sum())
            tail &= k > after[-1]
        phase[idx[tail]] = _OPT
    return keep


def _gpu_items(ev: RankEvents, steps: _Steps, top: _TopLevel, by_ops: bool, counts: ReadCounts):
    """Compute kernels as rows (start, end, key, step, phase) and NCCL collectives, on the GPU
    clock. Array work over the columns: a 1 GB trace holds over a million kernels."""
    n_comp = len(ev.kernel_ts)
    nccl = ev.nccl_kernels
    ts = np.concatenate([_column(ev.kernel_ts, np.float64),
                         np.array([k[0] for k in nccl], dtype=np.float64)])
    dur = np.concatenate([_column(ev.kernel_dur, np.float64),
                          np.array([k[1] for k in nccl], dtype=np.float64)])
    corr = np.concatenate([_column(ev.kernel_corr, np.int64),
                           np.array([NO_CORR if k[3] is None else k[3] for k in nccl],
                                    dtype=np.int64)])
    order = np.argsort(ts, kind="stable")
    ts, dur, corr = ts[order], dur[order], corr[order]
    launched, launch_ts, launch_tid = _launches(ev, corr)
    # Correlation ids grow with every launch: a kernel whose id is below every launch the
    # window recorded was launched before the window, by the step before the first traced
    # one (its GPU work runs into that step's span). It is no work of any traced step.
    before = np.zeros(len(ts), dtype=bool)
    if len(ev.runtime_corr):
        before = ~launched & (corr != NO_CORR) & (corr < min(ev.runtime_corr))
    counts.pre_window_kernels += int(before.sum())
    counts.kernels_without_launch += int((~launched & ~before).sum())
    step = np.full(len(ts), -1, dtype=np.int64)
    step[launched] = steps.indices(launch_ts[launched])
    lost = ~launched & ~before
    step[lost] = _gpu_step_indices(ev, steps, ts[lost])
    phase = np.full(len(ts), -1, dtype=np.int64)          # -1: continues the phase before it
    key = np.where(launched, launch_ts, np.nan)
    mine = launched & (step >= 0)
    phase[mine] = _phases(steps, top, by_ops, step[mine], launch_ts[mine], launch_tid[mine],
                          ev.tids)
    counts.outside_steps += int((~before & (step < 0)).sum())
    keep = ~before & (step >= 0)
    phase, key = _carry_within_steps(step[keep], phase[keep], key[keep], not by_ops)
    kept = np.flatnonzero(keep)
    is_nccl = order[kept] >= n_comp
    comp = ~is_nccl
    items = np.column_stack([ts[kept][comp], (ts + dur)[kept][comp], key[comp],
                             step[kept][comp], phase[comp]]) if comp.any() else np.zeros((0, 5))
    cpu_colls = _index_by_tid(ev.collectives)
    colls: list[Coll] = []
    for j in np.flatnonzero(is_nccl):
        i = kept[j]
        t0, d, _stream, _corr, kind, kind_name, pg, seq, src, dst, rows = \
            nccl[order[i] - n_comp]
        # a name the args give that is no collective we know ("coalesced": several under
        # one call) leaves the kind to the issuing op or the kernel's own name
        kind = kind if kind in KNOWN_COLLECTIVES else None
        host = _enclosing(cpu_colls, (float(launch_ts[i]), ev.tids[int(launch_tid[i])])) \
            if launched[i] else None
        if host is not None:
            kind = kind or host[3]
            pg = pg if pg is not None else host[4]
            seq = seq if seq is not None else host[5]
            src = src if src is not None else host[6]
            dst = dst if dst is not None else host[7]
            rows = rows if rows is not None else host[9]
        colls.append(Coll(t0, t0 + d, float(key[j]), int(step[i]), kind or kind_name, pg, seq,
                          src, dst, rows, host[10] if host is not None else None))
    return items, colls


def _gpu_step_indices(ev: RankEvents, steps: _Steps, t: np.ndarray) -> np.ndarray:
    """Index into `steps` of the step whose GPU-side span holds each device time t, or -1.
    GPU spans are numbered as the CPU's are: a GPU span whose number no CPU span has (the
    profiler window cut the CPU's off) belongs to no step we keep."""
    if not (ev.gpu_steps and ev.steps):
        return steps.indices(t)
    gpu = _Steps(ev.gpu_steps, ev)
    at = gpu.indices(t)
    where = {n: i for i, n in enumerate(steps.ids)}
    to_cpu = np.array([where.get(n, -1) for n in gpu.ids] + [-1], dtype=np.int64)
    return to_cpu[at]          # at == -1 reads the trailing -1


def _launches(ev: RankEvents, corr: np.ndarray):
    """(found, launch time, launching thread's index in ev.tids) of each kernel by its
    correlation id; a later launch record of one id replaces an earlier one."""
    rc = _column(ev.runtime_corr, np.int64)
    found = np.zeros(len(corr), dtype=bool)
    at, tid = np.full(len(corr), np.nan), np.zeros(len(corr), dtype=np.int64)
    if not len(rc):
        return found, at, tid
    order = np.argsort(rc, kind="stable")
    last = np.append(rc[order][1:] != rc[order][:-1], True)   # the last record of each id
    order = order[last]
    ids = rc[order]
    pos = np.minimum(np.searchsorted(ids, corr), len(ids) - 1)
    found = (ids[pos] == corr) & (corr != NO_CORR)
    at[found] = _column(ev.runtime_ts, np.float64)[order[pos[found]]]
    tid[found] = _column(ev.runtime_tid, np.int64)[order[pos[found]]]
    return found, at, tid


def _phases(steps: _Steps, top: _TopLevel, by_ops: bool, step: np.ndarray, t: np.ndarray,
            tids: np.ndarray, names: list) -> np.ndarray:
    """Phase of work issued at CPU times t (on threads tids) in steps `step`.

    With autograd ops in the trace, work issued inside an autograd op is backward and other
    work forward (pipelines interleave them); the step tail is fixed up afterwards. Without
    them, phases follow the step's marks in time.
    """
    opt = np.asarray(steps.opt)[step]
    if by_ops:
        phase = np.where(top.flags_at(tids, t, names) == BACKWARD_OP, _BWD, _FWD)
    else:
        phase = np.where(t >= np.asarray(steps.bwd)[step], _BWD, _FWD)
    return np.where(t >= opt, _OPT, phase)


def _carry_within_steps(step: np.ndarray, phase: np.ndarray, key: np.ndarray, monotone: bool):
    """Kernels without a launch (phase -1, key NaN) continue the phase and key of the kernel
    before them in their step (GPU order; forward and -inf first); by phase marks, phases
    never go back within a step."""
    n = len(step)
    by_step = np.argsort(step, kind="stable")
    s, ph, k = step[by_step], phase[by_step].copy(), key[by_step].copy()
    first = np.ones(n, dtype=bool)
    first[1:] = s[1:] != s[:-1]
    group_start = np.maximum.accumulate(np.where(first, np.arange(n), 0))
    has = ph >= 0
    last = np.maximum.accumulate(np.where(has, np.arange(n), -1))
    ok = ~has & (last >= group_start)
    ph[~has] = _FWD
    k[~has] = -np.inf
    ph[ok] = ph[last[ok]]
    k[ok] = k[last[ok]]
    if monotone:   # a running maximum that starts again at each step
        group = np.cumsum(first)
        ph = np.maximum.accumulate(ph + 8 * group) - 8 * group
    out_phase, out_key = np.empty(n, dtype=np.int64), np.empty(n)
    out_phase[by_step], out_key[by_step] = ph, k
    return out_phase, out_key


def _cpu_items(ev: RankEvents, steps: _Steps, top: _TopLevel, by_ops: bool, counts: ReadCounts):
    """Top-level CPU ops (start, end, key, step, phase) and CPU-side collectives."""
    loader = sorted(ev.loader)
    loader_starts = [a for a, _ in loader]
    items: list[tuple] = []
    for starts, ends, flags in top.ops.values():
        for start, end, flag in zip(starts.tolist(), ends.tolist(), flags.tolist()):
            s = steps.index(start)
            if s < 0:
                counts.outside_steps += 1
            if flag in (COMM_OP, NO_WORK_OP) or s < 0:
                continue
            j = bisect.bisect_right(loader_starts, start) - 1
            if j >= 0 and start <= loader[j][1]:
                counts.data_loading_ops += 1
                continue  # host-side input work: a launch delay of the forward, not compute
            if start >= steps.opt[s]:
                phase = _OPT
            elif by_ops:
                phase = _BWD if flag == BACKWARD_OP else _FWD
            else:
                phase = steps.phase(s, start)
            items.append((start, end, start, s, phase))
    colls = _host_collectives(ev, steps, counts)
    if ev.distributed_info and ev.distributed_info.backend.lower() == "nccl":
        counts.nccl_without_device_rows += 1
    return items, colls


def _host_collectives(ev: RankEvents, steps: _Steps, counts: ReadCounts) -> list[Coll]:
    """The host-side collectives (_cpu_collectives) of the traced steps."""
    colls: list[Coll] = []
    for ts, dur, launch, kind, pg, seq, src, dst, rows, shapes in _cpu_collectives(ev, counts):
        s = steps.index(launch)
        if s < 0:
            s = steps.index(ts)
        if s >= 0:
            colls.append(Coll(ts, ts + dur, launch, s, kind, pg, seq, src, dst, rows, shapes))
        else:
            counts.outside_steps += 1
    return colls


def _cpu_collectives(ev: RankEvents, counts: ReadCounts) -> list[tuple]:
    """CPU collectives as (ts, dur, launch, kind, pg, seq, src, dst, rows received, shapes).

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
        return [(c[0], c[1], c[0], c[3], c[4], c[5], c[6], c[7], c[9], c[10])
                for c in _outermost(issued)]
    # A backend annotation spans one collective's work, from its start to its end: two of
    # them on one thread may overlap or nest (gloo's isends in flight together), and each
    # is a collective; only the issuing ops may record one collective twice.
    issued = _outermost(issued)
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
        counts.unpaired_annotations += len(mine) - len(pairs)
    out = []
    for i, a in enumerate(annotated):
        ts, dur, _tid, kind, pg, seq, src, dst, _, rows, shapes = a
        c = partner.get(i)
        launch = ts
        if c is not None:
            launch = min(ts, c[0])
            pg = pg if pg is not None else c[4]
            seq = seq if seq is not None else c[5]
            src = src if src is not None else c[6]
            dst = dst if dst is not None else c[7]
            rows = rows if rows is not None else c[9]
            shapes = shapes if shapes is not None else c[10]
        out.append((ts, dur, launch, kind, pg, seq, src, dst, rows, shapes))
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
    """Issuing ops less the ones nested in one of the same kind on the same thread (one
    collective seen twice: c10d::allreduce_ around record_param_comms); the outer one keeps
    its time and takes the metadata (group, Seq, peer, rows) it lacks from those inside.

    Only an op that lies wholly inside another is the same collective: an op that starts
    inside one and ends after it is a collective of its own.
    """
    out: list[tuple] = []
    for tid_colls in _index_by_tid(colls).values():
        outer: dict = {}   # kind → index in out of the kept op that reaches furthest
        for c in tid_colls:
            j = outer.get(c[3])
            if j is not None and c[0] < out[j][0] + out[j][1] \
                    and c[0] + c[1] <= out[j][0] + out[j][1]:
                o = out[j]
                out[j] = (*o[:4], *(mine if mine is not None else theirs
                                    for mine, theirs in zip(o[4:8], c[4:8])),
                          o[8], *(mine if mine is not None else theirs
                                  for mine, theirs in zip(o[9:], c[9:])))
                continue
            if j is None or c[0] + c[1] > out[j][0] + out[j][1]:
                outer[c[3]] = len(out)
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
