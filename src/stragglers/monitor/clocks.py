"""Rank clocks of a window, step by step: a rank on another clock for a step is aligned on
its collectives' ends (trace/kineto/align.consensus_offset), or its step is left out.

A collective ends at about the same instant on all its ranks (within the step's tolerance,
1/256 of its span and at least 20 us: _TOL_SHARE; a pipeline transfer's two ends likewise),
whether a rank waited in it or was waited for. So the ends, not the spans, tell the clocks
apart: a rank whose ends of a step lie after (or before) its peers' by one offset beyond the
tolerance is on another clock for that step (a host's clock stepped by NTP or by hand, a
constant offset of 20 ms or of a day, a wild jump). The what-if engine reads the offset as
waiting (one rank 0.3 s ahead, less than a step, made a healthy job's windows S 1.21 and fired
`straggling`), so it is moved onto the others' clock by the consensus of its ends against those
of the ranks already placed. A real straggler's ends agree with its peers' (they wait for it in
the collective): it is never moved. Where its ends agree on no offset, a rank whose span of the
step lies apart from the others' (by more than the step lasts) has its step left out; one whose
span meets theirs stays as it is (a host's jitter scatters its ends around its peers') unless
most of its ends lie on one side of its peers' beyond the tolerance and their own scatter (a
clock drifting within the step): its step is left out, named. A rank whose ends lie apart from
its peers' (beyond two ends' jitter and the shorter op) by amounts that vary op to op, in more
than a quarter of its collectives where an offset would place it (its durations in another
unit: /1,000 made a healthy job S 1.32 and blamed an honest rank), is neither joined to their
clock nor placed: its step is left out, named. Steps each timed from their own start on every
rank (NDTimeline's samples) keep their ends together and are not moved. The reference clock is
the one the most ranks of the step share (among equals, the one holding the lowest rank).

Then over the window, two things no clock explains, each leaving out every step of the rank,
named, and the steps it was in judged again without it: its steps numbered one apart from its
peers' (its collective ends agree with theirs one step on or back: a recorder counting from 1;
12 of 19 such steps were moved by a step's length and analysed with the numbers of the step
before), and more than a quarter of its collectives ending before a peer of theirs began, on the
clock that best places them (a reduction ends only once every member is in it: durations too
short for the waits; half of a 2x2 job writing durations /1,000 read S 2.0, no majority of ranks
on one clock to tell which half was off). The cost is about linear in the window's rows: a
step is looked at only where a collective's ends spread past the tolerance or spans lie apart,
its ranks placed round by round (all that meet the last round's at once: one step of 1,024
ranks each on its own clock took 74 s placing one set at a time), and a chain of clocks too
long for MAX_ROUNDS or MAX_ROWS_READ is left out, named, not followed.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from stragglers.monitor.part_limits import OpSpans, op_spans
from stragglers.trace.model import BLOCKING_COLLECTIVES, DP_COLLECTIVES, OPTYPE_CODES, \
    P2P_OPTYPES

# ops whose ends the members of their group share (p2p: the two ends of one transfer)
_SYNC = [OPTYPE_CODES[o] for o in (*DP_COLLECTIVES, *BLOCKING_COLLECTIVES,
                                   "layernorm-grads-all-reduce", "embedding-grads-all-reduce")]
_EMBEDDING, _LAYERNORM = (OPTYPE_CODES["embedding-grads-all-reduce"],
                          OPTYPE_CODES["layernorm-grads-all-reduce"])
_SEND = {OPTYPE_CODES["forward-send"]: 1, OPTYPE_CODES["backward-send"]: -1}
_RECV = {OPTYPE_CODES["forward-recv"]: 1, OPTYPE_CODES["backward-recv"]: -1}
assert set(_SEND) | set(_RECV) == {OPTYPE_CODES[o] for o in P2P_OPTYPES}
_KEPT = _SYNC + list(_SEND) + list(_RECV)
# matched rows of the placed ranks read per row of a rank being placed (a DP all-reduce of a
# thousand ranks matches each row a thousand times; a few agree as well as all)
_PEERS_PER_ROW = 8
# rounds of placement in a step (each places the sets sharing a collective with those placed in
# the round before: a pipeline of P stages each on its own clock takes about P); the sets not
# reached by then are left out, named, rather than the one analysis process spinning on a chain
MAX_ROUNDS = 128
# ... and rows read in all per sync row of the step (a row is read a few times; a set whose
# ends do not agree is read again whenever a set it shares a collective with is placed)
MAX_ROWS_READ = 32
# two ends of one collective each within END_TOLERANCE_S of its instant (a host's jitter) lie
# within _JITTER times it of each other, and a ring's members end a chunk apart, less than the
# op lasts (_stray); a set of ranks whose ends lie further from every peer's, where an offset
# would place it, in more than 1/_ODD_SHARE of its matched collectives is not placed (no clock
# explains them: durations in another unit, or numbers not what happened). The healthy 2x2
# job's rank 3 with durations /1,000: 4 of its 11 a step (where it waited), x1,000: 11 of 11;
# jittered hosts, real stragglers, steps of 6 s, NDTimeline's samples: none left out
_JITTER, _ODD_SHARE = 2, 4
# a step's tolerance (_TOL_SHARE): two ends of one collective on one clock lie within
# 1/_TOL_SHARE of the step (the lower median of its ranks' spans: one rank's numbers cannot
# raise it past an honest rank's span), at least _TOL_FLOOR_S. A flat 1 ms (the Kineto
# reader's END_TOLERANCE_S) was wrong at both ends: an offset under it is not moved and reads
# as waiting (0.9 ms on 20-ms steps S 1.10, 0.5 ms on 5-ms steps S 1.18), and on long steps
# the hosts' jitter passes it (ends within ±0.1 s on 58-s steps, 0.17 % of them: 15-17 honest
# rank steps of 80 left out as numbers no offset explains). An offset within 1/256 of the
# step reads as at most about 1 % of waiting (the straggling threshold is 10 %), and jitter
# stays within it: NDTimeline's samples' ends up to 2.5 ms apart on steps of 2-46 s (8-180 ms
# here), the synthetic jobs' ±1 ms on steps of 0.33 s (1.26 ms). The floor only bounds steps
# under 5 ms: recorders' timers and float64 seconds since 1970 (0.24 us apart in 2026)
# resolve far finer than it
_TOL_SHARE, _TOL_FLOOR_S = 256, 20e-6
# steps numbered apart from the peers' by these (_shifted): a recorder counting from 1
_SHIFTS = (-1, 1)
# ... looked for in ranks moved by at most this many steps' spans (or left out)
_SHIFT_REACH = 4
# collectives whose members are all in them before any of them ends (a reduction, a gather, a
# barrier: each needs every member's part; a broadcast's root or a send-recv's sender may end
# first): a member that ends before another began is not what happened (_early)
_MEETS = [OPTYPE_CODES[o] for o in (*DP_COLLECTIVES, "all-to-all", "barrier", "all-reduce",
                                    "all-gather", "reduce-scatter",
                                    "layernorm-grads-all-reduce", "embedding-grads-all-reduce")]
_OFF = ("step {s}: the rank's span of the step lies apart from the other ranks' by more than "
        "the step lasts (another clock) and shares no collective whose ends agree with theirs; "
        "expected its ops within the others' step on one clock: the step is left out of the "
        "window")
_SKEW = ("step {s}: most of the rank's collective ends lie {side} its peers' by more than "
         "{tol:g} s and their own scatter, by no one offset that half of them agree on (a "
         "clock drifting within the step, or its steps numbered apart from theirs: its "
         "step holding their step before or after); expected them to end with its peers' on "
         "one clock: the step is left out of the window")
_ODD = ("step {s}: {far} of the rank's {rows} collective ends lie more than {gap:g} s from every "
        "peer's end, by amounts that no one offset explains (its durations in another unit, "
        "or not what happened); expected them to end with its peers' within {tol:g} s on one "
        "clock: the step is left out of the window")
_SHIFT = ("step {s}: the rank's steps are numbered apart from its peers' by {d:+d} (its step "
          "{s} holds their step {to}: {agree} of its {rows} collective ends in the window agree "
          "with theirs there, {own} at its own numbers; a recorder counting from 1, or a "
          "resume); expected each step numbered as its peers number it: its steps are left "
          "out of the window")
_EARLY = ("step {s}: {early} of the rank's {rows} collectives in the window end before a peer "
          "of theirs began (by more than {gap:g} s, on the clock that best places them: no "
          "one offset puts them with their peers'; its durations too short to hold its waits, "
          "in another unit or not what happened); expected each to end once every member is "
          "in it: its steps are left out of the window")
_FAR = ("step {s}: the rank's span of the step lies apart from the other ranks' by more than "
        "the step lasts (another clock) and was not placed within the bounds on aligning the "
        "step's sets of ranks on their shared collectives ({rounds} rounds, {read} reads of "
        "each row); expected a chain of at most {rounds} clocks to the largest set of ranks on "
        "one clock: the step is left out of the window")


class Placed(NamedTuple):
    """_place's answer for one set of ranks."""

    ranks: np.ndarray
    offset: float | None   # puts its collective ends on the placed sets' (None: none agreed)
    why: str               # (None:) why not
    side: int              # (None:) most ends after (1) or before (-1) the placed ones' by
    #                        more than the tolerance plus their scatter (the spread between
    #                        their quartiles) when last tried, else 0
    odd: str = ""          # (None:) _ODD where more than 1/_ODD_SHARE of its ends lay apart
    #                        from every peer's (by more than _JITTER tolerances) when last tried
    tried: float = float("nan")   # (None:) the consensus offset when last tried (nan: never)


class StepClocks(NamedTuple):
    """align_step_clocks' answer."""

    start_ts: np.ndarray | None              # the aligned starts (None: nothing moved)
    moved: dict[tuple[int, int], float]      # (rank, step) → seconds subtracted from its starts
    left_out: dict[tuple[int, int], str]     # (rank, step) → why its step is left out


class _Window(NamedTuple):
    """One window's (rank, step) groups and sync rows, as align_step_clocks reads them."""

    groups: list[np.ndarray]   # per step: its (rank, step) groups, in rank order
    g_rank: np.ndarray         # per group: its rank
    g_step: np.ndarray         # ... its step
    lo: np.ndarray             # ... its first start
    hi: np.ndarray             # ... its last end
    span: np.ndarray           # per step: the lower median of its ranks' spans
    tol: np.ndarray            # ... its tolerance (_TOL_SHARE)
    cut: np.ndarray            # per step: its sync rows' run (cut[j]:cut[j + 1])
    node: np.ndarray           # per sync row: its group
    key: np.ndarray            # ... its collective (_sync_keys)
    end: np.ndarray            # ... its end
    start: np.ndarray          # ... its start
    rank: np.ndarray           # ... its rank
    duration: np.ndarray       # ... its duration
    tols: np.ndarray           # ... its step's tolerance


class _Judged(NamedTuple):
    """One step judged (_judge_step)."""

    at: np.ndarray               # its groups judged (w.groups[j] less the ranks dropped)
    offset: np.ndarray           # ... each one's: 0 on the reference clock, a placed set's
    #                              own, a set left out its last tried (nan: never tried)
    role: np.ndarray             # ... its set's: 2 the reference, 1 placed, 0 left out
    moved: dict[int, float]      # rank → seconds subtracted from its starts
    left: dict[int, str]         # rank → why its step is left out


def align_step_clocks(ops: dict[str, np.ndarray],
                      spans: tuple[dict[str, np.ndarray], OpSpans] | None = None) -> StepClocks:
    """Per step, the sets of ranks whose collective ends agree (_same_clock) other than the
    largest (among equals, the one holding the lowest rank), moved onto its clock by the
    consensus of their ends where that lies beyond the step's tolerance (_TOL_SHARE); where
    their ends agree on no offset, their step left out if their span of it lies apart from the
    others' (by more than its median span) or most of their ends lie on one side (module
    docstring). Then, over the window, a rank whose steps are numbered apart from its peers'
    (_shifted) or whose collectives end before a peer of theirs began (_early) has every step
    left out, named, and the steps it was in judged again without it. `spans`: the columns
    whose first rows are `ops`'s, and their op_spans (windows.step_op_spans: rows past
    `ops`'s, the step after, are not judged)."""
    n = len(ops["rank"])
    if not n:
        return StepClocks(None, {}, {})
    cols, sp = spans or (ops, op_spans(ops))
    end = (cols["start_ts"] + cols["duration"])[sp.order]
    mine = sp.order[sp.head] < n
    lo, hi = sp.first[mine], np.maximum.reduceat(end, sp.head)[mine]
    g_rank, g_step = sp.rank[sp.head][mine], sp.step[sp.head][mine]
    # the (rank, step) groups step by step, each step's in rank order (one stable sort: a scan
    # of every group per step cost steps x groups)
    by_step = np.argsort(g_step, kind="stable")
    groups = np.split(by_step, np.flatnonzero(np.diff(g_step[by_step])) + 1)
    # the rows step by step in row order, and their sync keys: once a window
    rows = _step_rows(ops["step"], [int(g_step[at[0]]) for at in groups])
    at_rows = np.concatenate(rows)
    kept, key, s_end, s_rank = _sync_keys(ops, at_rows)
    cut = np.searchsorted(kept, np.cumsum([0] + [len(r) for r in rows]))
    span = np.array([_lower_median(hi[at] - lo[at]) for at in groups])
    tol = np.maximum(span / _TOL_SHARE, _TOL_FLOOR_S)   # (see _TOL_SHARE)
    s_tol = np.repeat(tol, np.diff(cut))
    # the steps to look at: spans apart, or a collective whose ends spread past the tolerance
    # (a job on one clock has few or none: its steps cost a sort of their sync rows)
    wide = set(_spread(key, s_end, s_tol, cut).tolist())
    look = [j for j, at in enumerate(groups) if len(at) > 1 and (
        j in wide or float(lo[at].max()) > float(hi[at].min()) + float(np.median(hi[at] - lo[at])))]
    if not look:
        return StepClocks(None, {}, {})
    group = np.empty(len(cols["rank"]), np.int64)   # each row's (rank, step) group, mine's
    group[sp.order] = (np.cumsum(mine) - 1)[sp.group]
    sync = at_rows[kept]
    w = _Window(groups, g_rank, g_step, lo, hi, span, tol, cut, group[sync], key, s_end,
                ops["start_ts"][sync].astype(np.float64), s_rank,
                ops["duration"][sync].astype(np.float64), s_tol)
    # their (rank, step)s by clock, from the ends they share, then placed step by step
    judged = _judge_steps(w, look, set())
    # over the window: ranks whose steps are numbered apart from their peers', then ranks
    # whose collectives end before a peer began; each left out, the steps they were in judged
    # again without them (a rank left out may have been the reference: no majority)
    offset = np.zeros(len(g_rank))   # per group: its offset (nan: none; steps not looked: 0)
    role = np.full(len(g_rank), 2, np.int8)   # ... and its set's role (_early)
    for at, offs, roles, _, _ in judged.values():
        offset[at], role[at] = offs, roles
    # (a rank numbered apart on its own clock is moved by about a step where it is moved: one
    # moved further, another clock, is not looked at, nor _rest_ids' sort taken for it)
    flagged = sorted({r for j, (*_, moved, left) in judged.items() for r in (
        *left, *(r for r, o in moved.items() if abs(o) <= _SHIFT_REACH * w.span[j]))})
    shifted = _shifted(w, ops["step"][sync].astype(np.int64), _rest_ids(ops, sync), offset,
                       flagged) if flagged else {}
    early = _early(w, np.isin(ops["optype"][sync], _MEETS), offset, role, set(shifted))
    drop = set(shifted) | set(early)
    first = {(r, int(g_step[groups[j][0]])): why for j, judged_j in judged.items()
             for r, why in judged_j.left.items()} if early else {}
    if drop:
        judged.update(_judge_steps(w, [j for j in look
                                       if np.isin(g_rank[groups[j]], list(drop)).any()], drop))
    start = ops["start_ts"].astype(np.float64, copy=True)
    moved: dict[tuple[int, int], float] = {}
    left_out: dict[tuple[int, int], str] = {}
    for j, (*_, step_moved, step_left) in judged.items():
        s = int(g_step[groups[j][0]])
        left_out.update({(r, s): why for r, why in step_left.items()})
        moved.update({(r, s): o for r, o in step_moved.items()})
        if step_moved:   # (each row's rank looked up once among the moved ranks)
            by = np.array(sorted(step_moved))
            off_of = np.array([step_moved[r] for r in by.tolist()])
            rank = ops["rank"][rows[j]]
            i = np.minimum(np.searchsorted(by, rank), len(by) - 1)
            hit = by[i] == rank
            start[rows[j][hit]] -= off_of[i[hit]]
    for g in np.flatnonzero(np.isin(g_rank, list(drop))).tolist():
        r, s = int(g_rank[g]), int(g_step[g])
        if r in shifted:
            d, agree, matched, own = shifted[r]
            left_out[(r, s)] = _SHIFT.format(s=s, d=d, to=s + d, agree=agree, rows=matched,
                                             own=own)
        else:   # (a step the first judgement left out keeps its why: as true, and nearer)
            left_out[(r, s)] = first.get((r, s)) or _EARLY.format(
                s=s, early=early[r][0], rows=early[r][1], gap=early[r][2])
    return StepClocks(start if moved else None, dict(sorted(moved.items())),
                      dict(sorted(left_out.items())))


def _lower_median(values: np.ndarray) -> float:
    """The lower of the two middle values (the middle one of an odd count)."""
    return float(np.partition(values, (len(values) - 1) // 2)[(len(values) - 1) // 2])


def _judge_steps(w: _Window, steps: list[int], drop: set[int]) -> dict[int, _Judged]:
    """Per step (an index of w.groups), without the ranks in `drop`: _Judged, from the clocks
    _same_clock finds among the steps' sync rows."""
    if not steps:
        return {}
    sel = np.concatenate([np.arange(w.cut[j], w.cut[j + 1]) for j in steps])
    if drop:
        sel = sel[~np.isin(w.rank[sel], list(drop))]
    clock = _same_clock(w.node[sel], w.key[sel], w.end[sel], len(w.g_rank), w.tols[sel],
                        w.duration[sel])
    out = {}
    for j in steps:
        at = w.groups[j]
        if drop:
            at = at[~np.isin(w.g_rank[at], list(drop))]
        out[j] = _judge_step(w, j, at, clock)
    return out


def _judge_step(w: _Window, j: int, at: np.ndarray, clock: np.ndarray) -> _Judged:
    """One step's answer for _judge_steps (`at`: its groups judged, `clock`: each group's)."""
    s, part = int(w.g_step[w.groups[j][0]]), slice(w.cut[j], w.cut[j + 1])
    sets = _by_clock(w.g_rank[at], clock[at])
    if len(at) < 2 or len(sets) < 2:
        return _Judged(at, np.zeros(len(at)), np.full(len(at), 2, np.int8), {}, {})
    lo, hi = w.lo[at], w.hi[at]
    margin = float(np.median(hi - lo))
    spanned = [w.g_rank[at][k] for k in _apart(lo, hi, margin)] \
        if float(lo.max()) > float(hi.min()) + margin else [w.g_rank[at]]
    # (the ranks whose spans meet the reference clock's)
    near_set = set(next(k for k in spanned if sets[0][0] in k).tolist())
    inside = np.array([near_set.issuperset(k.tolist()) for k in sets])
    tol = float(w.tol[j])
    moved: dict[int, float] = {}
    left: dict[int, str] = {}
    off_of: dict[int, float] = {r: 0.0 for r in sets[0].tolist()}
    role_of: dict[int, int] = {r: 2 for r in sets[0].tolist()}
    for ranks, off, why, side, odd, tried in _place(w.key[part], w.end[part], w.rank[part],
                                                    sets, inside, w.duration[part], tol):
        off_of.update({r: tried if off is None else off for r in ranks.tolist()})
        role_of.update({r: int(off is not None) for r in ranks.tolist()})
        if off is not None:
            if off:   # (0.0: placed where it was)
                moved.update({r: off for r in ranks.tolist()})
            continue
        for r in ranks.tolist():
            if r not in near_set:
                left[r] = why.format(s=s, rounds=MAX_ROUNDS, read=MAX_ROWS_READ)
            elif side:
                left[r] = _SKEW.format(s=s, side="after" if side > 0 else "before", tol=tol)
            elif odd:   # (else: jitter around its peers' ends, or no collective shared)
                left[r] = odd.format(s=s)
    ranks = w.g_rank[at].tolist()
    return _Judged(at, np.array([off_of[r] for r in ranks]),
                   np.array([role_of[r] for r in ranks], np.int8), moved, left)


def _same_clock(node: np.ndarray, key: np.ndarray, end: np.ndarray, nodes: int,
                tolerance: np.ndarray, duration: np.ndarray | None = None) -> np.ndarray:
    """Per (rank, step) node 0..nodes-1, the lowest node on its clock: nodes are joined where
    at least half of the ends they share (each sync row against the next _PEERS_PER_ROW of its
    collective, by node) agree within their step's `tolerance` (per row) and none is _stray,
    and a clock is a run of such joins. A real straggler's ends agree with its peers' (they
    wait for it): it stays joined."""
    order = np.lexsort((node, key))
    k = key[order]
    head = np.flatnonzero(np.r_[True, k[1:] != k[:-1]]) if len(k) else np.zeros(0, np.int64)
    count = np.diff(np.r_[head, len(k)])
    place = np.arange(len(k)) - np.repeat(head, count)           # (within its collective)
    ahead = np.minimum(np.repeat(count, count) - 1 - place, _PEERS_PER_ROW)
    a = np.repeat(np.arange(len(k)), ahead)
    b = _segments(np.arange(len(k)) + 1, ahead)
    a, b = order[a], order[b]
    a, b = a[node[a] != node[b]], b[node[a] != node[b]]
    lo, hi = np.minimum(node[a], node[b]), np.maximum(node[a], node[b])
    pair, which = np.unique(lo * nodes + hi, return_inverse=True)
    gap = np.abs(end[a] - end[b])
    agree = np.bincount(which, weights=gap <= tolerance[a], minlength=len(pair))
    # (and none _stray: a rank whose durations are in another unit agrees where it did not
    # wait and lies far off where it did; placed against the others, not joined to them)
    far = np.bincount(which, weights=_stray(gap, duration, a, b, tolerance[a]),
                      minlength=len(pair))
    same = (2 * agree >= np.bincount(which, minlength=len(pair))) & (far == 0)
    return _components(nodes, pair[same] // nodes, pair[same] % nodes)


def _stray(gap: np.ndarray, duration: np.ndarray | None, a: np.ndarray, b: np.ndarray,
           tolerance: float | np.ndarray) -> np.ndarray:
    """Where two ends of one collective (rows a and b, `gap` apart) lie apart by more than two
    ends' jitter (_JITTER tolerances) and than the shorter of the two ops lasted: a ring's
    members end a chunk apart, never a whole op (durations None: the jitter alone)."""
    bound = np.broadcast_to(_JITTER * np.asarray(tolerance, np.float64), gap.shape)
    if duration is not None:
        bound = np.maximum(bound, np.minimum(duration[a], duration[b]))
    return gap > bound


def _spread(key: np.ndarray, end: np.ndarray, tolerance: np.ndarray, cut: np.ndarray
            ) -> np.ndarray:
    """The steps (indices of `cut`'s runs of sync rows) holding a collective whose ends spread
    past its step's `tolerance` (per row)."""
    if not len(key):
        return np.zeros(0, np.int64)
    order = np.argsort(key, kind="stable")
    head = np.flatnonzero(np.r_[True, key[order][1:] != key[order][:-1]])
    wide = (np.maximum.reduceat(end[order], head)
            - np.minimum.reduceat(end[order], head)) > tolerance[order[head]]
    first = order[head[wide]]   # (a key's rows are all of one step: its first row tells)
    return np.unique(np.searchsorted(cut, first, side="right") - 1)


def _components(nodes: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The lowest node joined to each node by the edges (a, b): each round the higher of the
    two roots of every edge whose roots differ is hooked under the lower, then every node
    points to its root (pointer jumping). A few rounds, each linear in the edges (lowering
    nodes' labels along the edges instead took as many rounds as a chain is long when its
    nodes are numbered out of order: 158 s for 200,000 nodes, 0.03 s so)."""
    parent = np.arange(nodes)
    while True:
        while True:
            up = parent[parent]
            if np.array_equal(up, parent):
                break
            parent = up
        ra, rb = parent[a], parent[b]
        apart = ra != rb
        if not apart.any():
            return parent
        np.minimum.at(parent, np.maximum(ra[apart], rb[apart]),
                      np.minimum(ra[apart], rb[apart]))


def _by_clock(ranks: np.ndarray, clock: np.ndarray) -> list[np.ndarray]:
    """One step's ranks as sets by clock: largest first, among equals the one holding the
    lowest rank (`ranks` ascending)."""
    order = np.argsort(clock, kind="stable")
    sets = np.split(ranks[order], np.flatnonzero(np.diff(clock[order])) + 1)
    return sorted(sets, key=lambda k: (-len(k), int(k[0])))


def _apart(lo: np.ndarray, hi: np.ndarray, margin: float) -> list[np.ndarray]:
    """The sets of spans (indices) that overlap, each within `margin` of the next: largest
    first, among equals the one holding the lowest index."""
    order = np.argsort(lo, kind="stable")
    reach = np.maximum.accumulate(hi[order])
    cut = np.flatnonzero(lo[order][1:] > reach[:-1] + margin) + 1
    sets = [np.sort(k) for k in np.split(order, cut)]
    return sorted(sets, key=lambda k: (-len(k), int(k[0])))


def _step_rows(step: np.ndarray, steps: list[int]) -> list[np.ndarray]:
    """The rows of each of `steps`, in row order (one stable sort of the window's steps)."""
    order = np.argsort(step, kind="stable")
    at = step[order]
    lo = np.searchsorted(at, steps, side="left")
    hi = np.searchsorted(at, steps, side="right")
    return [order[a:b] for a, b in zip(lo.tolist(), hi.tolist())]


def _segments(head: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The indices head[i], head[i]+1, ... head[i]+count[i]-1 for every i, in order."""
    base = np.repeat(head - (np.cumsum(count) - count), count)
    return base + np.arange(len(base))


def _index(label: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(the rows by label 0..n-1, each label's in row order; each label's first place there;
    how many it has): labels outside 0..n-1 are in no label's rows."""
    order = np.argsort(label, kind="stable")
    head = np.searchsorted(label[order], np.arange(n), side="left")
    return order, head, np.searchsorted(label[order], np.arange(n), side="right") - head


def _place(key: np.ndarray, end: np.ndarray, rank: np.ndarray, sets: list[np.ndarray],
           inside: np.ndarray | None = None, duration: np.ndarray | None = None,
           tolerance: float = _TOL_FLOOR_S) -> list[Placed]:
    """Each set of ranks after the first, placed on the sets placed before it (Placed), from
    one step's sync rows (`_sync_keys`); `inside`: per set, its span of the step meets the
    first set's (placed only where its ends agree on an offset past their own scatter; none:
    no set). Round by round, the sets sharing a collective with those placed in the
    round before are placed at once, a set whose ends do not agree tried again when a later
    round places another set it shares one with. Each row is read a few times and
    consensus_offset runs about once per set (before: for every set left, after every set
    placed, sets² x rows: a step of 1,024 ranks on their own clocks 74 s); MAX_ROUNDS and
    MAX_ROWS_READ bound it where sets chain on."""
    # (here, not at import: the kineto package loads its reader, ~0.15 s the monitor needs not)
    from stragglers.trace.kineto.align import consensus_offset

    members = np.concatenate(sets)
    sort = np.argsort(members, kind="stable")
    at = np.minimum(np.searchsorted(members[sort], rank), len(members) - 1)
    of = np.repeat(np.arange(len(sets)), [len(k) for k in sets])[sort][at]
    of[members[sort][at] != rank] = -1   # (a rank of no set: neither placed nor placed against)
    by_set, set_head, set_count = _index(of, len(sets))
    key = key - (key.min() if len(key) else 0)   # (one step's keys: a run of the window's)
    by_key, key_head, key_count = _index(key, int(key.max()) + 1 if len(key) else 0)
    inside = np.zeros(len(sets), bool) if inside is None else inside
    state = np.zeros(len(sets), np.int8)     # 0 to place, 1 placed
    state[0] = 1
    offset = np.zeros(len(sets))
    last = np.full(len(sets), np.nan)          # the offset when last tried
    tried_on = np.zeros(len(sets), np.int64)  # rows matched when last tried (0: never tried)
    since = np.zeros(len(sets), np.int64)     # rows sharing a collective placed since then
    side = np.zeros(len(sets), np.int8)       # most ends after (1) or before (-1) when tried
    strays = np.zeros(len(sets), np.int64)    # rows apart from every peer's end when tried
    out: list[Placed] = []
    frontier, rounds, read, cut = np.array([0]), 0, 0, False
    while len(frontier):
        # the sets still to place that share a collective with those placed last round; one
        # that did not agree is tried again once it shares as many rows again (its matches
        # at least doubled: a few tries a set, where every round would read it every time)
        fresh = by_set[_segments(set_head[frontier], set_count[frontier])]
        shared = np.unique(key[fresh])
        near = of[by_key[_segments(key_head[shared], key_count[shared])]]
        near = near[near >= 0]
        since += np.bincount(near[state[near] == 0], minlength=len(sets))
        touched = np.flatnonzero((state == 0) & (since > 0) & (since >= tried_on))
        if not len(touched):
            break
        # each row of theirs against the first placed rows of its collective, in row order
        mine = by_set[_segments(set_head[touched], set_count[touched])]   # by set
        keys = np.unique(key[mine])
        rows = by_key[_segments(key_head[keys], key_count[keys])]         # by collective
        rounds, read = rounds + 1, read + len(fresh) + len(near) + len(mine) + len(rows)
        if rounds > MAX_ROUNDS or read > MAX_ROWS_READ * len(key):
            cut = True
            break
        theirs = rows[np.where(of[rows] >= 0, state[of[rows]], 0) == 1]
        first = np.searchsorted(key[theirs], key[mine], side="left")
        count = np.minimum(np.searchsorted(key[theirs], key[mine], side="right") - first,
                           _PEERS_PER_ROW)
        mine, first, count = mine[count > 0], first[count > 0], count[count > 0]
        row = np.repeat(mine, count)
        peer = theirs[_segments(first, count)]
        diffs = end[row] - (end[peer] - offset[of[peer]])
        tried = np.unique(of[mine])
        lo = np.searchsorted(of[row], tried, side="left")      # (rows by set: of[row] sorted)
        hi = np.searchsorted(of[row], tried, side="right")
        off = np.array([consensus_offset(diffs[a:b], tolerance)[0]
                        for a, b in zip(lo.tolist(), hi.tolist())])
        # how far its differences scatter (between their quartiles): an offset or a side
        # within it is a host's jitter, not a clock
        within = np.lexsort((diffs, of[row]))   # (by set, each set's differences ascending)
        size = hi - lo
        scatter = diffs[within][lo + -(-3 * (size - 1) // 4)] \
            - diffs[within][lo + (size - 1) // 4]   # (of two: their distance)
        wide = tolerance + np.repeat(scatter, size)
        # a set is placed where at least half of its matched rows agree with its offset
        heads = np.cumsum(count) - count   # (a row is after or before where all its peers are)
        ok = np.abs(diffs - np.repeat(off, hi - lo)) <= tolerance
        agree = np.bincount(of[mine], weights=np.logical_or.reduceat(ok, heads),
                            minlength=len(sets))[tried]
        tried_on[tried] = np.bincount(of[mine], minlength=len(sets))[tried]
        after, before = (np.bincount(of[mine], weights=np.logical_and.reduceat(far, heads),
                                     minlength=len(sets))[tried]
                         for far in (diffs > wide, diffs < -wide))
        side[tried] = np.where(2 * after > tried_on[tried], 1,
                               np.where(2 * before > tried_on[tried], -1, 0))
        since[touched] = 0
        good = 2 * agree >= tried_on[tried]
        # a set whose span is apart moves on half of its ends agreeing; one whose span meets
        # the others' (`inside`) on more than half, by more than the tolerance plus its ends'
        # own scatter, else it stays where it is (a host's jitter) and is placed there
        off[inside[tried] & ~((2 * agree > tried_on[tried])
                            & (np.abs(off) > tolerance + scatter))] = 0.0
        # ... unless, where it would be placed, too many of its ends lie apart from every
        # peer's beyond two ends' jitter (varying amounts: an offset would have put them
        # together): its step is not what happened, whoever waited
        apart = _stray(np.abs(diffs - np.repeat(off, size)), duration, row, peer,
                       tolerance)
        strays[tried] = np.bincount(of[mine], weights=np.logical_and.reduceat(apart, heads),
                                 minlength=len(sets))[tried]
        good &= _ODD_SHARE * strays[tried] <= tried_on[tried]
        last[tried] = off
        frontier = tried[good]
        state[frontier] = 1
        offset[frontier] = off[good]
        out += [Placed(sets[k], o, "", 0) for k, o in zip(frontier.tolist(),
                                                          off[good].tolist())]
    why = _FAR if cut else _OFF   # (bounds reached, or no set left meets a placed one)
    return out + [Placed(sets[k], None, why, int(side[k]),
                         _ODD.format(s="{s}", far=int(strays[k]), rows=int(tried_on[k]),
                                     gap=_JITTER * tolerance, tol=tolerance)
                         if _ODD_SHARE * strays[k] > tried_on[k] else "", float(last[k]))
                  for k in np.flatnonzero(state == 0).tolist()]


def _sync_keys(ops: dict[str, np.ndarray], rows: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(position in `rows`, key, end, rank) of the rows among `rows` whose end the peers of one
    collective share: collectives by (step, op type, seq_id, process group), a pipeline
    transfer by (step, direction, DP rank, the sending stage, seq_id) on both of its ends.
    Without a process group, the what-if engine's groups: a DP or blocking collective among
    its stage's ranks, the tied embedding's between the first and last stage of one DP rank,
    the layernorm's in the (untraced) tensor-parallel group of one place (ends of different
    groups' collectives lay tens of ms apart in one key on one clock)."""
    keep, fields = _sync_fields(ops, rows)
    at = rows[keep]
    return (np.flatnonzero(keep), _dense(fields),
            (ops["start_ts"][at] + ops["duration"][at]).astype(np.float64),
            ops["rank"][at].astype(np.int64))


def _rest_ids(ops: dict[str, np.ndarray], sync: np.ndarray) -> np.ndarray:
    """Per sync row (`sync`: _sync_keys' rows, as indices of `ops`), its collective but for the
    step, numbered: one collective of two steps has one number (_shifted's)."""
    _, fields = _sync_fields(ops, sync)
    return _dense(fields[:, 1:])


def _dense(fields: np.ndarray) -> np.ndarray:
    """Each row of `fields` numbered 0, 1, ... in the rows' lexicographic order, alike alike (a
    step's keys a run where the step is the first field; np.unique(axis=0) sorted the rows
    as bytes: 20x the time, 0.3 s for a window of 117k rows)."""
    order = np.lexsort(fields.T[::-1])
    new = np.r_[True, (fields[order][1:] != fields[order][:-1]).any(axis=1)]
    key = np.empty(len(fields), np.int64)
    key[order] = np.cumsum(new) - 1
    return key


def _sync_fields(ops: dict[str, np.ndarray], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(which of `rows` are sync rows, their key fields: step first) for _sync_keys."""
    code = ops["optype"][rows]
    keep = np.isin(code, _KEPT)   # (the rest never read: every window comes here)
    at = rows[keep]
    optype = code[keep].astype(np.int64)
    stage = ops["stage"][at].astype(np.int64)
    dp = ops["dp_rank"][at].astype(np.int64)
    seq = ops["seq_id"][at].astype(np.int64)
    pg = ops["pg"][at].astype(np.int64) if "pg" in ops else np.full(len(at), -1, np.int64)
    send = np.select([optype == c for c in _SEND], list(_SEND.values()), 0)
    recv = np.select([optype == c for c in _RECV], list(_RECV.values()), 0)
    coll = (send == 0) & (recv == 0)
    # a transfer's two rows share (direction, DP rank, sender's stage, seq); a collective's
    # rows (optype, seq, pg) on every member, or without pg (dp, stage) as its group has them
    direction = send + recv
    sender = np.where(recv != 0, stage - recv, stage)
    alone = pg < 0
    by_dp = ~coll | (alone & ((optype == _EMBEDDING) | (optype == _LAYERNORM)))
    by_stage = ~coll | (alone & (optype != _EMBEDDING))
    return keep, np.stack([ops["step"][at].astype(np.int64),
                           np.where(coll, optype, -10 - direction), np.where(by_dp, dp, -1),
                           np.where(~coll, sender, np.where(by_stage, stage, -1)), seq,
                           np.where(coll, pg, -1)], axis=1)


def _shifted(w: _Window, step: np.ndarray, rest: np.ndarray, offset: np.ndarray,
             flagged: list[int]) -> dict[int, tuple[int, int, int, int]]:
    """rank → (d, its collective ends that agree with the others' of their step d on, those
    matched there, those that agree at its own step numbers) for each rank of `flagged` (moved
    or left out in a step) whose ends, each of its steps numbered d = ±1 on (_SHIFTS), mostly
    agree within the tolerance with the other ranks' ends of the same collective there (the
    lower median of theirs, on the clock that placed them: `offset` per group) and more of
    them than at its own numbers: a recorder that counts from 1, or a resume, against its
    peers. Read on the rank's own clock: a rank numbered apart *and* on another clock is left
    to the step-by-step judgement (each of its steps moved or left out)."""
    ranks = np.array(flagged)
    mine = np.isin(w.rank, ranks)
    aligned = w.end - offset[w.node]
    ref = ~mine & np.isfinite(aligned)
    steps = np.unique(step)
    if not len(rest):
        return {}
    width = int(rest.max()) + 1
    code = np.searchsorted(steps, step) * width + rest
    order = np.lexsort((aligned[ref], code[ref]))
    c, e = code[ref][order], aligned[ref][order]
    head = np.flatnonzero(np.r_[True, c[1:] != c[:-1]]) if len(c) else np.zeros(0, np.int64)
    count = np.diff(np.r_[head, len(c)])
    if not len(head):
        return {}
    ref_code, ref_end = c[head], e[head + (count - 1) // 2]
    at = np.flatnonzero(mine)
    which = np.searchsorted(ranks, w.rank[at])
    matched, agree = {}, {}
    for d in (0, *_SHIFTS):
        to = step[at] + d
        t = np.minimum(np.searchsorted(steps, to), len(steps) - 1)
        i = np.minimum(np.searchsorted(ref_code, t * width + rest[at]), len(ref_code) - 1)
        hit = (steps[t] == to) & (ref_code[i] == t * width + rest[at])
        near = hit & (np.abs(w.end[at] - ref_end[i]) <= w.tols[at])
        matched[d] = np.bincount(which, weights=hit, minlength=len(ranks)).astype(np.int64)
        agree[d] = np.bincount(which, weights=near, minlength=len(ranks)).astype(np.int64)
    out = {}
    for k, r in enumerate(ranks.tolist()):
        d = max(_SHIFTS, key=lambda d: agree[d][k])
        if 2 * agree[d][k] > matched[d][k] and agree[d][k] > agree[0][k]:
            out[r] = (d, int(agree[d][k]), int(matched[d][k]), int(agree[0][k]))
    return out


def _early(w: _Window, meets: np.ndarray, offset: np.ndarray, role: np.ndarray,
           shifted: set[int]) -> dict[int, tuple[int, int, float]]:
    """rank → (its collectives that end before a peer of theirs began, its collectives with a
    peer, by how much at least) over the window for each rank where more than 1/_ODD_SHARE of
    them do (a clock stepped within one step, its later ops an hour on, makes its peers' ends
    of that step lie before its starts: one step of a window's): each sync row of a collective
    whose members all take part before any ends (`meets`), on the clock that placed or last
    tried its rank's set (`offset` per group), against the latest start of the collective's
    other rows, by more than two ends' jitter (_JITTER tolerances). A reduction ends only once
    every member is in it, on any clock: a rank whose durations are too short for its waits
    (another unit, 0 s) ends before its peers began wherever it came first, an honest rank
    never does, whichever of them the offsets were read against (halves of a job, one of them
    slipped, have no majority). A rank on the step's reference clock (`role` 2 per group; 1:
    another set placed, 0: a set left out) is judged against the placed sets' starts only, any
    other rank also against those of sets left out whose rank was placed in another step of
    the window: a set left out, its offset a guess and its starts perhaps not what happened
    (a rank 5e4 s off whose collectives' times are scattered by 20 ms, three rows of one
    collective), made honest ranks end before them; the half of a job whose durations slipped
    is placed in some steps (its waits read as an offset) and left out in others. `shifted`
    are not judged."""
    sel = np.flatnonzero(meets & ~np.isin(w.rank, list(shifted)))
    off = offset[w.node[sel]]
    sel, off = sel[np.isfinite(off)], off[np.isfinite(off)]
    if not len(sel):
        return {}
    begin, key, mine = w.start[sel] - off, w.key[sel], role[w.node[sel]]
    # the latest start of the other rows of its collective: of the placed sets', and of those
    # whose rank was placed in some step of the window (a rank left out of every step it was
    # looked at has no clock here that its offsets could be checked against)
    known = np.zeros(int(w.g_rank.max()) + 1, bool)
    known[w.g_rank[role > 0]] = True
    latest = _latest_other(key, np.where((mine > 0) | known[w.rank[sel]], begin, -np.inf))
    placed = _latest_other(key, np.where(mine > 0, begin, -np.inf))
    others = np.where(mine == 2, placed, latest)
    valid = np.isfinite(others)
    gap = _JITTER * w.tols[sel]
    early = valid & (w.end[sel] - off + gap < others)
    ranks, which = np.unique(w.rank[sel], return_inverse=True)
    rows = np.bincount(which, weights=valid).astype(np.int64)
    ends = np.bincount(which, weights=early).astype(np.int64)
    most = np.zeros(len(ranks))
    np.maximum.at(most, which, gap)
    return {int(ranks[k]): (int(ends[k]), int(rows[k]), float(most[k]))
            for k in np.flatnonzero(_ODD_SHARE * ends > rows).tolist()}


def _latest_other(key: np.ndarray, value: np.ndarray) -> np.ndarray:
    """Per row, the largest `value` among the other rows of its key (-inf: none)."""
    order = np.lexsort((value, key))
    k, v = key[order], value[order]
    head = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    count = np.diff(np.r_[head, len(k)])
    last = np.repeat(head + count - 1, count)
    second = np.where(np.repeat(count > 1, count), v[np.maximum(last - 1, 0)], -np.inf)
    out = np.empty(len(k))
    out[order] = np.where(np.arange(len(k)) == last, second, v[last])
    return out
