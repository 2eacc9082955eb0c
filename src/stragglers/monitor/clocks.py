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
every rank) and a host's jitter stay as they are.
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
    start = None
    moved: dict[tuple[int, int], float] = {}
    left_out: dict[tuple[int, int], str] = {}
    for s in np.unique(g_step).tolist():
        at = np.flatnonzero(g_step == s)
        margin = float(np.median(hi[at] - lo[at]))
        if len(at) < 2 or float(lo[at].max()) <= float(hi[at].min()) + margin:
            continue   # (every span meets every other: the common case, one comparison)
        sets = _apart(lo[at], hi[at], margin)
        if start is None:
            start = ops["start_ts"].astype(np.float64, copy=True)
        rows = np.flatnonzero(ops["step"] == s)
        got = _place(ops, rows, [g_rank[at][k].tolist() for k in sets], margin)
        for ranks, off in got.items():
            for r in ranks:
                if off is None:
                    left_out[(r, s)] = (
                        f"step {s}: the rank's span of the step lies apart from the other "
                        "ranks' by more than the step lasts (another clock) and shares no "
                        "collective whose ends agree with theirs; expected its ops within the "
                        "others' step on one clock: the step is left out of the window")
                else:
                    moved[(r, s)] = off
            if off is not None:
                start[rows[np.isin(ops["rank"][rows], ranks)]] -= off
    return StepClocks(start if moved else None, moved, dict(sorted(left_out.items())))


def _apart(lo: np.ndarray, hi: np.ndarray, margin: float) -> list[np.ndarray]:
    """The sets of spans (indices) that overlap, each within `margin` of the next: largest
    first, among equals the one holding the lowest index."""
    order = np.argsort(lo, kind="stable")
    reach = np.maximum.accumulate(hi[order])
    cut = np.flatnonzero(lo[order][1:] > reach[:-1] + margin) + 1
    sets = [np.sort(k) for k in np.split(order, cut)]
    return sorted(sets, key=lambda k: (-len(k), int(k[0])))


def _place(ops: dict[str, np.ndarray], rows: np.ndarray, sets: list[list[int]], margin: float
           ) -> dict[tuple[int, ...], float | None]:
    """Each set of ranks after the first → the offset that puts its collective ends on the
    placed ranks' (None: no shared collective agrees), one step's `rows`. A set is placed
    against every set placed before it, the set sharing most collectives with them first."""
    key, end, rank = _sync_keys(ops, rows)
    placed = {r: 0.0 for r in sets[0]}
    todo = [tuple(k) for k in sets[1:]]
    out: dict[tuple[int, ...], float | None] = {}
    while todo:
        tried = [(_offset(key, end, rank, placed, ranks), ranks) for ranks in todo]
        (off, shared), ranks = max(tried, key=lambda t: t[0][1])
        todo.remove(ranks)
        if off is None or shared == 0:
            out[ranks] = None   # (nothing placed will agree with it later: none is moved)
            continue
        out[ranks] = off
        placed.update({r: off for r in ranks})
    return out


def _offset(key: np.ndarray, end: np.ndarray, rank: np.ndarray, placed: dict[int, float],
            ranks: tuple[int, ...]) -> tuple[float | None, int]:
    """(the consensus offset of `ranks`' collective ends against the placed ranks' ends of the
    same collectives, or None where fewer than half of its matched rows agree with it; how many
    of its rows matched)."""
    # (here, not at import: the kineto package loads its reader, ~0.15 s the monitor needs not)
    from stragglers.trace.kineto.align import END_TOLERANCE_S, consensus_offset

    mine = np.flatnonzero(np.isin(rank, ranks))
    theirs = np.flatnonzero(np.isin(rank, list(placed)))
    if not len(mine) or not len(theirs):
        return None, 0
    theirs = theirs[np.argsort(key[theirs], kind="stable")]
    k = key[theirs]
    first = np.searchsorted(k, key[mine], side="left")
    last = np.minimum(np.searchsorted(k, key[mine], side="right"), first + _PEERS_PER_ROW)
    count = last - first
    matched = np.flatnonzero(count > 0)
    if not len(matched):
        return None, 0
    row = np.repeat(mine[matched], count[matched])
    peer = theirs[np.concatenate([np.arange(a, b) for a, b in zip(first[matched],
                                                                   last[matched])])]
    shift = np.array([placed[int(r)] for r in rank[peer]])
    diffs = end[row] - (end[peer] - shift)
    off, _ = consensus_offset(diffs)
    agree = len(np.unique(row[np.abs(diffs - off) <= END_TOLERANCE_S]))
    return (off if 2 * agree >= len(matched) else None), len(matched)


def _sync_keys(ops: dict[str, np.ndarray], rows: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(key, end, rank) of the rows among `rows` whose end the peers of one collective share:
    collectives by (op type, seq_id, process group where given), a pipeline transfer by
    (direction, DP rank, the sending stage, seq_id) on both of its ends."""
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
    fields = np.stack([np.where(coll, optype, -10 - direction), np.where(coll, -1, dp),
                       np.where(coll, -1, sender), seq, np.where(coll, pg, -1)], axis=1)[keep]
    _, key = np.unique(fields, axis=0, return_inverse=True)
    at = rows[keep]
    return (key.reshape(-1), (ops["start_ts"][at] + ops["duration"][at]).astype(np.float64),
            ops["rank"][at].astype(np.int64))
