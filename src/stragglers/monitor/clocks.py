"""Rank clocks of a window, step by step: a rank on another clock for a step is aligned on
its collectives' ends (trace/kineto/align.consensus_offset), or its step is left out.

Within one step the ranks meet at collectives, so on one clock every rank's span of the step
(its first start to its latest end) overlaps the others' (transitively: pipeline stages through
their neighbours). A rank whose span lies apart from the rest by more than the step's own span
is on another clock for that step: a host's clock stepped by NTP or by hand, a constant offset,
a wild jump. The what-if engine reads the gap as waiting (one rank an hour behind made a
healthy job's windows S 1.19 and fired `straggling`), so each such rank (or set of ranks that
overlap each other) is moved by the consensus of its collective ends against those of the
ranks already placed; where none is shared, or they do not agree, its step is left out. Spans
that overlap are never moved: per-step clocks (NDTimeline times each sampled step from ~0 s on
every rank) and a host's jitter stay as they are. The cost is about linear in the window's
rows (a step of 1,024 ranks each on its own clock took 74 s placing one set at a time): sets
are placed round by round, all that meet the last round's at once, and a chain of clocks too
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
_SEND = {OPTYPE_CODES["forward-send"]: 1, OPTYPE_CODES["backward-send"]: -1}
_RECV = {OPTYPE_CODES["forward-recv"]: 1, OPTYPE_CODES["backward-recv"]: -1}
assert set(_SEND) | set(_RECV) == {OPTYPE_CODES[o] for o in P2P_OPTYPES}
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
_OFF = ("step {s}: the rank's span of the step lies apart from the other ranks' by more than "
        "the step lasts (another clock) and shares no collective whose ends agree with theirs; "
        "expected its ops within the others' step on one clock: the step is left out of the "
        "window")
_FAR = ("step {s}: the rank's span of the step lies apart from the other ranks' by more than "
        "the step lasts (another clock) and was not placed within the bounds on aligning the "
        "step's sets of ranks on their shared collectives ({rounds} rounds, {read} reads of "
        "each row); expected a chain of at most {rounds} clocks to the largest set of ranks on "
        "one clock: the step is left out of the window")


class StepClocks(NamedTuple):
    """align_step_clocks' answer."""

    start_ts: np.ndarray | None              # the aligned starts (None: nothing moved)
    moved: dict[tuple[int, int], float]      # (rank, step) → seconds subtracted from its starts
    left_out: dict[tuple[int, int], str]     # (rank, step) → why its step is left out


def align_step_clocks(ops: dict[str, np.ndarray],
                      spans: tuple[dict[str, np.ndarray], OpSpans] | None = None) -> StepClocks:
    """Per step, the ranks whose span of it lies apart from the largest set of overlapping
    ranks (the one holding the lowest rank among equals) by more than the step's median span,
    moved onto that set's clock by their collective ends (module docstring). `spans`: the
    columns whose first rows are `ops`'s, and their op_spans (windows.step_op_spans: rows
    past `ops`'s, the step after, are not judged)."""
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
    apart: list[tuple[int, list[np.ndarray]]] = []
    for at in np.split(by_step, np.flatnonzero(np.diff(g_step[by_step])) + 1):
        if len(at) < 2:
            continue
        margin = float(np.median(hi[at] - lo[at]))
        if float(lo[at].max()) <= float(hi[at].min()) + margin:
            continue   # (every span meets every other: the common case, one comparison)
        apart.append((int(g_step[at[0]]),
                      [g_rank[at][k] for k in _apart(lo[at], hi[at], margin)]))
    if not apart:
        return StepClocks(None, {}, {})
    # the rows of those steps, step by step in row order, and their sync keys: once a window
    rows = _step_rows(ops["step"], [s for s, _ in apart])
    bounds = np.cumsum([0] + [len(r) for r in rows])
    kept, key, s_end, s_rank = _sync_keys(ops, np.concatenate(rows))
    cut = np.searchsorted(kept, bounds)
    start = ops["start_ts"].astype(np.float64, copy=True)
    moved: dict[tuple[int, int], float] = {}
    left_out: dict[tuple[int, int], str] = {}
    for j, (s, sets) in enumerate(apart):
        part = slice(cut[j], cut[j + 1])
        placed: list[tuple[np.ndarray, float]] = []
        for ranks, off, why in _place(key[part], s_end[part], s_rank[part], sets):
            if off is None:
                left_out.update({(r, s): why.format(s=s, rounds=MAX_ROUNDS, read=MAX_ROWS_READ)
                                 for r in ranks.tolist()})
            else:
                moved.update({(r, s): off for r in ranks.tolist()})
                placed.append((ranks, off))
        if placed:   # (each row's rank looked up once among the moved ranks)
            by = np.concatenate([r for r, _ in placed])
            off_of = np.concatenate([np.full(len(r), o) for r, o in placed])
            order = np.argsort(by)
            by, off_of = by[order], off_of[order]
            rank = ops["rank"][rows[j]]
            i = np.minimum(np.searchsorted(by, rank), len(by) - 1)
            hit = by[i] == rank
            start[rows[j][hit]] -= off_of[i[hit]]
    return StepClocks(start if moved else None, moved, dict(sorted(left_out.items())))


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


def _place(key: np.ndarray, end: np.ndarray, rank: np.ndarray, sets: list[np.ndarray]
           ) -> list[tuple[np.ndarray, float | None, str]]:
    """Each set of ranks after the first → (its ranks; the offset that puts its collective
    ends on those of the sets placed before it, or None; why not), from one step's sync rows
    (`_sync_keys`). Round by round, the sets sharing a collective with those placed in the
    round before are placed at once, a set whose ends do not agree tried again when a later
    round places another set it shares one with. Each row is read a few times and
    consensus_offset runs about once per set (before: for every set left, after every set
    placed, sets² x rows: a step of 1,024 ranks on their own clocks 74 s); MAX_ROUNDS and
    MAX_ROWS_READ bound it where sets chain on."""
    # (here, not at import: the kineto package loads its reader, ~0.15 s the monitor needs not)
    from stragglers.trace.kineto.align import END_TOLERANCE_S, consensus_offset

    members = np.concatenate(sets)
    sort = np.argsort(members, kind="stable")
    at = np.minimum(np.searchsorted(members[sort], rank), len(members) - 1)
    of = np.repeat(np.arange(len(sets)), [len(k) for k in sets])[sort][at]
    of[members[sort][at] != rank] = -1   # (a rank of no set: neither placed nor placed against)
    by_set, set_head, set_count = _index(of, len(sets))
    key = key - (key.min() if len(key) else 0)   # (one step's keys: a run of the window's)
    by_key, key_head, key_count = _index(key, int(key.max()) + 1 if len(key) else 0)
    state = np.zeros(len(sets), np.int8)     # 0 to place, 1 placed
    state[0] = 1
    offset = np.zeros(len(sets))
    tried_on = np.zeros(len(sets), np.int64)  # rows matched when last tried (0: never tried)
    since = np.zeros(len(sets), np.int64)     # rows sharing a collective placed since then
    out: list[tuple[np.ndarray, float | None, str]] = []
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
        off = np.array([consensus_offset(diffs[a:b])[0] for a, b in zip(lo.tolist(),
                                                                          hi.tolist())])
        # a set is placed where at least half of its matched rows agree with its offset
        ok = np.abs(diffs - np.repeat(off, hi - lo)) <= END_TOLERANCE_S
        agree = np.bincount(of[mine], weights=np.logical_or.reduceat(ok, np.cumsum(count)
                                                                      - count),
                            minlength=len(sets))[tried]
        tried_on[tried] = np.bincount(of[mine], minlength=len(sets))[tried]
        since[touched] = 0
        good = 2 * agree >= tried_on[tried]
        frontier = tried[good]
        state[frontier] = 1
        offset[frontier] = off[good]
        out += [(sets[k], o, "") for k, o in zip(frontier.tolist(), off[good].tolist())]
    why = _FAR if cut else _OFF   # (bounds reached, or no set left meets a placed one)
    return out + [(sets[k], None, why) for k in np.flatnonzero(state == 0).tolist()]


def _sync_keys(ops: dict[str, np.ndarray], rows: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(position in `rows`, key, end, rank) of the rows among `rows` whose end the peers of one
    collective share: collectives by (step, op type, seq_id, process group where given), a
    pipeline transfer by (step, direction, DP rank, the sending stage, seq_id) on both of its
    ends."""
    optype = ops["optype"][rows].astype(np.int64)
    stage = ops["stage"][rows].astype(np.int64)
    dp = ops["dp_rank"][rows].astype(np.int64)
    seq = ops["seq_id"][rows].astype(np.int64)
    pg = ops["pg"][rows].astype(np.int64) if "pg" in ops else np.full(len(rows), -1, np.int64)
    send = np.select([optype == c for c in _SEND], list(_SEND.values()), 0)
    recv = np.select([optype == c for c in _RECV], list(_RECV.values()), 0)
    coll = np.isin(optype, _SYNC)
    keep = coll | (send != 0) | (recv != 0)
    # a transfer's two rows share (direction, DP rank, sender's stage, seq); a collective's
    # rows (optype, seq, pg) on every member
    direction = send + recv
    sender = np.where(recv != 0, stage - recv, stage)
    fields = np.stack([ops["step"][rows].astype(np.int64),
                       np.where(coll, optype, -10 - direction), np.where(coll, -1, dp),
                       np.where(coll, -1, sender), seq, np.where(coll, pg, -1)], axis=1)[keep]
    _, key = np.unique(fields, axis=0, return_inverse=True)
    at = rows[keep]
    return (np.flatnonzero(keep), key.reshape(-1),
            (ops["start_ts"][at] + ops["duration"][at]).astype(np.float64),
            ops["rank"][at].astype(np.int64))
