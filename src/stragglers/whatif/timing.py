"""Measured quantities: transfer/blocking split, launch delays, measured step times (docs/whatif.md §4)."""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import OPTYPE_CODES, P2P_OPTYPES
from stragglers.whatif.dependencies import DependencyModel, sync_max
from stragglers.whatif.grid import GC, OpGrid

P2P_CODES = [OPTYPE_CODES[o] for o in P2P_OPTYPES]


# Rows of one batched p2p call (batch_isend_irecv) share their start and end: the same timer
# values (exactly equal in NDTimeline traces); 1 ns leaves room for unit conversions only.
BATCH_EPS = 1e-9


def measured_costs(grid: OpGrid, model: DependencyModel) -> np.ndarray:
    """Per-op cost: duration for plain ops, transfer = end − max start over the group for comm.

    p2p rows of one batched call (same worker, same start and end) complete together, so
    waiting for any of their peers shows in all of them: their transfer is measured per call,
    from the latest start over all the call's groups.
    """
    cost = grid.duration.copy()
    # the group starts of the grouped rows only, ends computed a few rows at a time: on a big
    # job each of these arrays is a grid's size (10⁸ ops: 0.8 GB)
    grouped = np.flatnonzero(model.group_of >= 0)
    at = np.full(len(cost), -1, dtype=np.int64)
    at[grouped] = np.arange(len(grouped))
    group_start = np.full((len(grouped),) + grid.start.shape[1:], np.nan)
    for members, sync, parts in zip(model.groups, model.group_dp_sync, model.group_parts):
        g = np.max(grid.start[members], axis=0)
        if sync:
            g = sync_max(g, parts)
        group_start[at[members]] = g
    np.copyto(group_start, grid.start[grouped], where=np.isnan(group_start))
    _per_call(grid, model, at, group_start)
    # The member that arrived last waited for nobody; a small negative is clock error.
    for lo in range(0, len(grouped), _ROWS_AT_ONCE):
        rows = grouped[lo:lo + _ROWS_AT_ONCE]
        end = grid.start[rows] + grid.duration[rows]
        cost[rows] = np.maximum(end - group_start[lo:lo + _ROWS_AT_ONCE], 0.0)
    cost[model.no_op] = 0.0  # recorded but never launched: zero transfer time (docs/whatif.md §3)
    return cost


# Grid rows whose temporaries measured_costs and base_step_times hold at once.
_ROWS_AT_ONCE = 64


def _batched_somewhere(grid: OpGrid, nodes: np.ndarray, end: np.ndarray) -> bool:
    """Whether two of these p2p ops (`end`: their ends, [k, D, T]) share start and end on the
    first DP rank (a batched call).

    Batching is the schedule's, the same code on every rank: one DP rank tells, which keeps
    traces without batching from paying for the per-call pass.
    """
    present = grid.present[nodes, :1]
    start = np.where(present, grid.start[nodes, :1], np.inf)
    stop = np.where(present, end[:, :1], np.inf)
    order = np.argsort(start, axis=0, kind="stable")
    s = np.take_along_axis(start, order, axis=0)
    e = np.take_along_axis(stop, order, axis=0)
    with np.errstate(invalid="ignore"):
        same = (np.abs(np.diff(s, axis=0)) <= BATCH_EPS) & (np.abs(np.diff(e, axis=0)) <= BATCH_EPS)
    return bool(same.any())


def _per_call(grid: OpGrid, model: DependencyModel, at: np.ndarray,
              group_start: np.ndarray) -> None:
    """Raise each batched p2p row's group start to the latest over its call (in place;
    `group_start` holds the grouped rows, row n at at[n])."""
    p2p = np.isin(grid.node_optype, P2P_CODES) & ~model.no_op & (model.group_of >= 0)
    for stage in range(grid.pp_size):
        nodes = np.flatnonzero(p2p & (grid.node_stage == stage))
        if len(nodes) < 2:
            continue
        end = grid.start[nodes] + grid.duration[nodes]
        if not _batched_somewhere(grid, nodes, end):
            continue
        start = np.where(grid.present[nodes], grid.start[nodes], np.inf)
        order = np.argsort(start, axis=0, kind="stable")                  # [k, D, T]
        s = np.take_along_axis(start, order, axis=0)
        e = np.take_along_axis(np.where(grid.present[nodes], end, np.inf), order, axis=0)
        g = np.take_along_axis(group_start[at[nodes]], order, axis=0)
        same = (np.abs(np.diff(s, axis=0)) <= BATCH_EPS) & (np.abs(np.diff(e, axis=0)) <= BATCH_EPS)
        if not same.any():
            continue
        run = g.copy()
        for i in range(1, len(nodes)):                 # running max within each call ...
            run[i] = np.where(same[i - 1], np.maximum(run[i - 1], g[i]), g[i])
        for i in range(len(nodes) - 2, -1, -1):        # ... and the call's max back to all rows
            run[i] = np.where(same[i], run[i + 1], run[i])
        out = np.empty_like(run)
        np.put_along_axis(out, order, run, axis=0)
        group_start[at[nodes]] = np.where(grid.present[nodes], out, group_start[at[nodes]])


def step_starts(grid: OpGrid) -> np.ndarray:
    """Measured start of each step: the earliest op of any worker."""
    return np.nanmin(grid.start, axis=(0, 1))


def base_step_times(grid: OpGrid) -> np.ndarray:
    """T_base per step: last end − first start over all workers."""
    last = np.full(grid.start.shape[2], -np.inf)
    for lo in range(0, len(grid.start), _ROWS_AT_ONCE):   # a few rows at a time: no grid copy
        rows = slice(lo, lo + _ROWS_AT_ONCE)
        end = np.where(grid.present[rows], grid.start[rows] + grid.duration[rows], -np.inf)
        np.maximum(last, end.max(axis=(0, 1)), out=last)
    return last - step_starts(grid)


def launch_delays(grid: OpGrid, model: DependencyModel) -> np.ndarray:
    """start − max(end of dependencies) (or − step start), clamped at 0; absent ops get 0.

    Absent ops (a gc slot without a pause on this worker) are placed at the end of their
    dependencies with zero duration, in dependency order, so their successors see them.
    """
    end = grid.start + grid.duration
    first = step_starts(grid)
    delay = np.zeros_like(end)
    for sn in model.order:
        members = model.groups[-sn - 1] if sn < 0 else [sn]
        for m in members:
            dep = model.deps[m]
            ready = end[dep].max(axis=0) if dep else np.broadcast_to(first, end.shape[1:])
            absent = ~grid.present[m]
            start = grid.start[m]
            if absent.any():
                # an op's own row only: a copy of the grid's starts would be the job's size
                start = np.where(absent, ready, start)
                end[m][absent] = ready[absent]
            delay[m] = np.maximum(start - ready, 0.0)
    return delay


def host_gaps(grid: OpGrid, delay: np.ndarray) -> np.ndarray:
    """The launch delays `delay` read as their workers' host-side gaps (what a stall is judged
    on: metrics.unexplained); `delay` itself, which the measured replay needs exact, is kept.

    A compute or GC row most replica-steps lack (`OpGrid.held`: a spurious row of one rank, a
    pause slot few steps hold) is placed by the model from a guess, so its wait there is no
    gap of its worker: its gap is measured from the later of its dependencies' end and the end
    of its worker's own last op before it (a 0.1 ms row right after one honest rank's
    optimizer, chained after its last backward, waited 0.43–0.48 s there: the worker read as
    gaps for 56–61% of its step and left out of the ideal, S 1.60 → 1.44). Its start in the
    replay is untouched: a recorded row starts where it was recorded.
    """
    rare = np.flatnonzero(~grid.held() & np.isin(grid.node_optype, _WORK + [GC]))
    if not len(rare):
        return delay
    gaps = delay.copy()
    for stage in np.unique(grid.node_stage[rare]):
        nodes = np.flatnonzero(grid.node_stage == stage)
        present = grid.present[nodes]
        start = np.where(present, grid.start[nodes], np.inf)                # [K, D, T]
        order = np.argsort(start, axis=0, kind="stable")
        end = np.where(present, grid.start[nodes] + grid.duration[nodes], -np.inf)
        # the latest end of the worker's ops begun before each one (in start order)
        run = np.maximum.accumulate(np.take_along_axis(end, order, axis=0), axis=0)
        before = np.full_like(run, -np.inf)
        before[1:] = run[:-1]
        busy = np.empty_like(before)
        np.put_along_axis(busy, order, before, axis=0)
        at = {int(n): k for k, n in enumerate(nodes)}
        for m in rare[grid.node_stage[rare] == stage]:
            k = at[int(m)]
            # busy until at most its own start: an op it began inside leaves it no gap
            ready = grid.start[m] - delay[m]
            own = np.minimum(busy[k], grid.start[m])
            gaps[m] = np.where(present[k], np.maximum(grid.start[m] - np.maximum(ready, own), 0.0),
                               delay[m])
    return gaps


_WORK = [OPTYPE_CODES[o] for o in ("forward-compute", "backward-compute",
                                    "backward-weight-compute", "optimizer")]
_SENDS = [OPTYPE_CODES["forward-send"], OPTYPE_CODES["backward-send"]]
_RECVS = [OPTYPE_CODES["forward-recv"], OPTYPE_CODES["backward-recv"]]
# seconds a row may overrun its own timeline before a warning names it: recorders' own timer
# rounding (NDTimeline's event pairs overlap their next op by up to 0.12 ms)
_CLIP_EPS = 1e-3


# the warning naming rows cut to their worker's own timeline (the monitor copies it to notes)
ROWS_CUT = "rows cut to their worker's own timeline (ops it cannot have run so)"


def clip_to_own_timeline(grid: OpGrid, model: DependencyModel) -> str | None:
    """Cut a worker's rows that its own timeline cannot hold (in place, before any cost is
    read), naming them in a grid warning (returned; None where nothing was cut):

    - a send that started before the compute op it follows in the model (the op producing its
      data) had started: charged from that op's end, its end kept;
    - a GC pause (on the compute stream, docs/whatif.md §3): only the gap the worker's own
      compute ops leave there, from the end of the one running when it began to the start of
      the first one begun inside it (the host, paused, launches nothing; transfers and
      collectives run on their own streams through it and do not cut it).
    - a compute op (forward, backward, optimizer: the one serial compute stream the model
      chains per worker, docs/whatif.md §3) running on past the start of the worker's next
      one, of a send it feeds, of a receive or collective launched after it (its successors
      in the model), or of its worker's first compute or transfer of the next step: ended
      there (one stream runs one op at a time, a send cannot carry what is not computed yet,
      a transfer or collective is launched behind the compute stream's work before it, so
      its worker was waiting on that op, not computing; a slow op's successors start after
      it ends, so only rows that cannot have run so are cut). Collectives and receives the
      model does not order after it, on their own streams, do not cut it.

    Before those cuts, a compute op that started before its input can have been there starts
    where the dependencies say, its end kept (`_clip_starts`); an overlap nothing settles is
    named in a second warning (`UNDECIDED`).
    """
    cut: dict[str, tuple[int, float, set]] = {}
    undecided: dict[str, tuple[int, float, set]] = {}
    for stage in range(grid.pp_size):
        nodes = np.flatnonzero(grid.node_stage == stage)
        _clip_starts(grid, model, nodes, cut, undecided)
        _clip_computes(grid, model, nodes, cut)
        is_work = set(nodes[np.isin(grid.node_optype[nodes], _WORK)].tolist())
        sends = nodes[np.isin(grid.node_optype[nodes], _SENDS) & ~model.no_op[nodes]]
        feeds = sorted((c, o) for o in sends.tolist() for c in set(model.deps[o]) & is_work)
        # a send cut starts later, never earlier: the pairs early before any cut are all
        early = _any_cell(grid, feeds, lambda c, o: grid.present[c] & grid.present[o]
                          & (grid.start[o] < grid.start[c]))
        for c, o in np.asarray(feeds, dtype=np.int64).reshape(-1, 2)[early]:
            _clip_sends(grid, int(c), [int(o)], cut)
        _clip_pauses(grid, nodes, cut)
    if undecided:
        grid.warnings.append(f"{UNDECIDED}: " + _listed(undecided))
    if not cut:
        return None
    message = f"{ROWS_CUT}: " + _listed(cut)
    grid.warnings.append(message)
    return message


# the warning naming overlaps on one compute stream that neither a dependency nor the stage's
# other rows settle
UNDECIDED = ("compute ops starting inside the one before them on their worker's stream, and "
             "nothing tells which of the two rows is wrong (the one before was cut where the "
             "other began: its step may read long by up to that)")


def _clip_starts(grid: OpGrid, model: DependencyModel, nodes: np.ndarray, cut: dict,
                 undecided: dict) -> None:
    """Each compute op among one stage's `nodes` started no earlier than its input can have
    been there (in place; its end kept, so the measured replay ends it where it was recorded):
    the end of a receive or collective it waits for in the model, and the end of the compute
    op before it on its stream where it began before that one did, or where another op launched after that one
    began right at that end (a send of its output: it did run to there), or where the stage's
    rows that overlap nothing read the pair's durations closer so (the start written early)
    than with the op before cut where it began (`_clip_computes`: its end written late). Where
    none of these tells, the rows are left to `_clip_computes` and named in `undecided`."""
    work = [int(c) for c in nodes[np.isin(grid.node_optype[nodes], _WORK)]]
    if not work:
        return
    is_work = set(work)
    # a batched call's rows end together, a receive's row where its call ends (its data may
    # have been there before): their ends tell nothing of the data's arrival
    p2p = nodes[np.isin(grid.node_optype[nodes], _SENDS + _RECVS) & ~model.no_op[nodes]]
    own_ends = len(p2p) < 2 or not _batched_somewhere(
        grid, p2p, grid.start[p2p] + grid.duration[p2p])
    after: dict[int, list[int]] = {}       # compute op → the other ops launched after it
    for o in nodes[grid.node_optype[nodes] != GC].tolist():
        if not model.no_op[o]:
            for c in model.deps[o]:
                if c in is_work:
                    after.setdefault(c, []).append(int(o))
    for b in work:
        here = grid.present[b] & (grid.duration[b] > 0)
        before = [f for f in model.deps[b] if f in is_work and f != b]
        # inputs whose end its other end or group confirms: a receive (where its row ends with
        # its own call) and a collective (its members end together)
        inputs = [r for r in model.deps[b] if not model.no_op[r] and (
            (own_ends and int(grid.node_optype[r]) in _RECVS)
            or (model.group_of[r] >= 0 and int(grid.node_optype[r]) not in P2P_CODES))]
        if not here.any() or not (before or inputs):
            continue
        end = grid.start[b] + grid.duration[b]
        ready = np.full(end.shape, -np.inf)
        for r in inputs:
            ready = np.maximum(ready, np.where(grid.present[r], grid.start[r]
                                               + grid.duration[r], -np.inf))
        if not (here & (grid.start[b] < ready - _CLIP_EPS)).any() and not any(
                (here & grid.present[f] & (grid.start[b] < grid.start[f] + grid.duration[f]
                                           - _CLIP_EPS)).any() for f in before):
            continue                      # (healthy traces: nothing early, nothing to read)
        open_ = np.zeros(end.shape, dtype=bool)
        for f in before:
            f_end = np.where(grid.present[f], grid.start[f] + grid.duration[f], -np.inf)
            early = here & grid.present[f] & (grid.start[b] < f_end - _CLIP_EPS)
            if not early.any():
                continue
            # begun before f began: whatever f's length, b's start is the impossible row
            ran = early & (grid.start[b] <= grid.start[f])
            for o in after.get(f, []):               # an op launched after f began at its end
                if o != b:
                    ran |= early & grid.present[o] & (np.abs(grid.start[o] - f_end) <= _CLIP_EPS)
            ran |= early & ~ran & _start_written_early(grid, f, b, early, ready)
            ready = np.where(ran, np.maximum(ready, f_end), ready)
            open_ |= early & ~ran
        # never past the start of a transfer or collective launched after it: that op was
        # queued behind it, so it had begun by then (a row stated long into such an op is
        # `_clip_computes`'s to cut; the next compute, if early too, is moved in its turn)
        bound = np.full(end.shape, np.inf)
        for o in (o for o in after.get(b, []) if o not in is_work):
            bound = np.minimum(bound, np.where(grid.present[o], grid.start[o], np.inf))
        move = here & (grid.start[b] < ready - _CLIP_EPS) & (end > ready) & (ready <= bound)
        if move.any():
            _note(cut, "compute ops starting before their input was there (a receive they "
                  "wait for, or the op before them on their stream)", grid, b,
                  np.where(move, ready - grid.start[b], 0.0))
            grid.start[b] = np.where(move, ready, grid.start[b])
            grid.duration[b] = np.where(move, end - ready, grid.duration[b])
        left = open_ & ~move
        if left.any():
            over = np.zeros(end.shape)
            for f in before:
                over = np.maximum(over, grid.start[f] + grid.duration[f] - grid.start[b])
            _note(undecided, "rows", grid, b, np.where(left, over, 0.0))


def _start_written_early(grid: OpGrid, f: int, b: int, early: np.ndarray,
                         ready: np.ndarray) -> np.ndarray:
    """[D, T] where compute op b, begun inside f before it on its stream (`early`), reads its
    start written early rather than f's end written late: f and b's durations so (f's kept,
    b's from f's end) lie closer to the stage's cells where b began after f and its receives
    ended (their medians; log ratios summed) than with f cut where b began. False where the
    stage holds no such cell."""
    f_end = grid.start[f] + grid.duration[f]
    b_end = grid.start[b] + grid.duration[b]
    clean = (grid.present[f] & grid.present[b] & (grid.duration[f] > 0)
             & (grid.duration[b] > 0) & (grid.start[b] >= np.maximum(f_end, ready) - _CLIP_EPS))
    if not clean.any():
        return np.zeros(early.shape, dtype=bool)
    ref_f = float(np.median(grid.duration[f][clean]))
    ref_b = float(np.median(grid.duration[b][clean]))

    def off(x: np.ndarray, ref: float) -> np.ndarray:
        return np.abs(np.log(np.maximum(x, 1e-12) / ref))

    with np.errstate(invalid="ignore"):
        moved = off(grid.duration[f], ref_f) + off(b_end - f_end, ref_b)
        cut_f = off(grid.start[b] - grid.start[f], ref_f) + off(grid.duration[b], ref_b)
    return early & (moved < cut_f)


def _any_cell(grid: OpGrid, pairs: list[tuple[int, int]], test) -> np.ndarray:
    """[len(pairs)] whether `test(a, b)` (node index arrays → [k, D, T] bools) holds in any cell
    of each pair (a, b): a few pairs at a time, no temporary of a grid's size."""
    out = np.zeros(len(pairs), dtype=bool)
    for lo in range(0, len(pairs), _ROWS_AT_ONCE):
        a, b = np.asarray(pairs[lo:lo + _ROWS_AT_ONCE], dtype=np.int64).T
        with np.errstate(invalid="ignore"):
            out[lo:lo + _ROWS_AT_ONCE] = test(a, b).any(axis=(1, 2))
    return out


def _listed(kinds: dict) -> str:
    """'n kind (by up to s; workers ...)' for each kind of rows counted by `_note`."""
    return "; ".join(f"{n} {kind} (by up to {most:.3g} s; workers "
                     + ", ".join(f"(dp {d}, pp {p})" for d, p in sorted(workers)) + ")"
                     for kind, (n, most, workers) in sorted(kinds.items()))


def _note(cut: dict, kind: str, grid: OpGrid, node: int, by: np.ndarray) -> None:
    """Count the cells of `by` ([D, T] seconds cut from `node`'s rows) beyond clock rounding
    under `kind`, with their workers."""
    big = by > _CLIP_EPS
    if big.any():
        n, most, workers = cut.get(kind, (0, 0.0, set()))
        stage = int(grid.node_stage[node])
        workers |= {(int(d), stage) for d in grid.dp_ranks[np.flatnonzero(big.any(axis=1))]}
        cut[kind] = (n + int(big.sum()), max(most, float(by[big].max())), workers)


def _clip_computes(grid: OpGrid, model: DependencyModel, nodes: np.ndarray, cut: dict) -> None:
    """Each compute op among one stage's `nodes` ended no later than the start of the next one
    its worker began, nor than that of a send it feeds in the model (in place; per worker and
    step): a serial stream's busy time is kept once, by the op that began first."""
    work = nodes[np.isin(grid.node_optype[nodes], _WORK)]
    if not len(work):
        return
    present = grid.present[work] & (grid.duration[work] > 0)
    start = np.where(present, grid.start[work], np.inf)                   # [K, D, T]
    later = np.full_like(start, np.inf)
    if len(work) > 1:
        order = np.argsort(start, axis=0, kind="stable")
        s = np.take_along_axis(start, order, axis=0)
        nxt = np.full_like(s, np.inf)
        nxt[:-1] = s[1:]                             # the next start of the same worker/step
        np.put_along_axis(later, order, nxt, axis=0)
    needs = {int(c): k for k, c in enumerate(work)}
    ends = grid.start[work] + grid.duration[work]                          # [K, D, T]
    # the ops launched after a compute op (o after work[k]), in node order; only those begun
    # inside it somewhere can end it: one begun past its end where it began after it never
    # holds the earliest start below that end, which alone cuts
    edges = [(needs[c], o) for o in nodes[(grid.node_optype[nodes] != GC)
                                          & ~model.no_op[nodes]].tolist()
             for c in model.deps[o] if c in needs and c != o]
    inside = _any_cell(grid, edges, lambda k, o: grid.present[o] & (grid.start[o] > start[k])
                       & (grid.start[o] < ends[k]))
    # where each op was cut: its stream's next op or a send it feeds, a receive posted after
    # it, the next step
    why = np.zeros(start.shape, dtype=np.int8)
    for (k, o), keep in zip(edges, inside):
        if keep:
            send = int(grid.node_optype[o]) in _SENDS
            # the op's start, where it began after this op began (and was recorded)
            there = grid.present[o] & (grid.start[o] < later[k]) & (grid.start[o] > start[k])
            later[k] = np.where(there, grid.start[o], later[k])
            why[k] = np.where(there, 0 if send else 1, why[k])
    nxt = _next_step_starts(grid, nodes)                                      # [D, T]
    there = (nxt[None] < later) & (nxt[None] > start)
    later = np.where(there, nxt[None], later)
    why = np.where(there, 2, why)
    past = present & (ends > later + np.where(why > 0, _CLIP_EPS, 0.0))
    for k in np.flatnonzero(past.any(axis=(1, 2))).tolist():
        o = int(work[k])
        end = grid.start[o] + grid.duration[o]
        # (past a receive, collective or next step: only beyond timer rounding, which the
        # recorders' rows show there, not evidence of a row no timeline holds)
        over = present[k] & (end > later[k] + np.where(why[k] > 0, _CLIP_EPS, 0.0))
        if not over.any():
            continue
        to = np.maximum(later[k], grid.start[o])
        for code, kind in enumerate(_PAST):
            _note(cut, kind, grid, int(o), np.where(over & (why[k] == code), end - to, 0.0))
        grid.duration[o] = np.where(over, to - grid.start[o], grid.duration[o])


# the kinds of compute rows cut, by what cut them (_clip_computes's `why`)
_PAST = ("compute ops running past their rank's next compute or send",
         "compute ops running into their rank's wait on a receive or collective launched "
         "after them",
         "compute ops running into their rank's next step")


def _next_step_starts(grid: OpGrid, nodes: np.ndarray) -> np.ndarray:
    """[D, T] the first start of one stage's `nodes` computes and transfers in each worker's
    next step: the training loop launches them once the step before has run, behind its
    compute stream's work. inf where that tells nothing: the last step, a next one that is not
    the step after it, or one whose first op starts before the last of this step began (a
    clock restarted every step, as NDTimeline's: a step's times are not the next one's)."""
    own = nodes[np.isin(grid.node_optype[nodes], _WORK + _SENDS + _RECVS)]
    out = np.full(grid.start.shape[1:], np.inf)
    if not len(own) or grid.start.shape[2] < 2:
        return out
    first = np.full(out.shape, np.inf)
    last = np.full(out.shape, -np.inf)
    for lo in range(0, len(own), _ROWS_AT_ONCE):          # a few rows at a time: no copy
        rows = own[lo:lo + _ROWS_AT_ONCE]
        np.minimum(first, np.where(grid.present[rows], grid.start[rows], np.inf).min(axis=0),
                   out=first)
        np.maximum(last, np.where(grid.present[rows], grid.start[rows], -np.inf).max(axis=0),
                   out=last)
    follows = (np.diff(grid.steps) == 1)[None] & (first[:, 1:] > last[:, :-1])   # [D, T - 1]
    out[:, :-1] = np.where(follows, first[:, 1:], np.inf)
    return out


def _clip_sends(grid: OpGrid, c: int, sends: list[int], cut: dict) -> None:
    """Each of `sends` (following compute op c) that started before c did, from c's end."""
    for o in sends:
        early = grid.present[c] & grid.present[o] & (grid.start[o] < grid.start[c])
        if not early.any():
            continue
        o_end = grid.start[o] + grid.duration[o]
        to = np.minimum(grid.start[c] + grid.duration[c], o_end)
        _note(cut, "sends starting before the compute op they follow", grid, o,
              np.where(early, to - grid.start[o], 0.0))
        grid.start[o] = np.where(early, to, grid.start[o])
        grid.duration[o] = np.where(early, o_end - to, grid.duration[o])


def _clip_pauses(grid: OpGrid, nodes: np.ndarray, cut: dict) -> None:
    """Each GC pause among one stage's `nodes` cut to the gap its worker's compute stream
    leaves there (in place): from the end of the compute op running when it began to the
    start of the first one begun inside it (the host, paused, launches nothing)."""
    pauses = nodes[grid.node_optype[nodes] == GC]
    work = nodes[np.isin(grid.node_optype[nodes], _WORK)]
    if not len(pauses) or not len(work):
        return
    present = grid.present[work]
    w_start = np.where(present, grid.start[work], np.nan)
    w_end = w_start + grid.duration[work]
    for g in pauses:
        here = grid.present[g] & (grid.duration[g] > 0)
        if not here.any():
            continue
        a = np.where(here, grid.start[g], 0.0)
        b = a + np.where(here, grid.duration[g], 0.0)
        with np.errstate(invalid="ignore"):
            begun = w_start <= a                                        # [K, D, T]
            s = np.maximum(a, np.where(begun, w_end, -np.inf).max(axis=0))
            e = np.minimum(b, np.where(w_start > a, w_start, np.inf).min(axis=0))
        e = np.maximum(e, s)
        _note(cut, "GC pauses through their rank's own compute", grid, int(g),
              np.where(here, grid.duration[g] - (e - s), 0.0))
        grid.start[g] = np.where(here, s, grid.start[g])
        grid.duration[g] = np.where(here, e - s, grid.duration[g])
