"""Pipeline transfers renumbered after a stray one: each worker-step's rows realigned with the
transfers its other end ran, so the stray takes the seq_id the schedule lacks."""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import OPTYPE_CODES

# a transfer type's other end: (its type, the stage it goes to or comes from relative to its own)
PARTNER = {OPTYPE_CODES["forward-send"]: (OPTYPE_CODES["forward-recv"], 1),
           OPTYPE_CODES["forward-recv"]: (OPTYPE_CODES["forward-send"], -1),
           OPTYPE_CODES["backward-send"]: (OPTYPE_CODES["backward-recv"], -1),
           OPTYPE_CODES["backward-recv"]: (OPTYPE_CODES["backward-send"], 1)}
_TYPES = np.array(sorted(PARTNER), dtype=np.int64)
_MAX_EXTRA = 4   # extra rows a worker-step may hold to be realigned (more: another schedule)


def realigned_seq(ops, seq: np.ndarray, d_idx: np.ndarray, t_idx: np.ndarray, d: int, t: int,
                  interleaved: bool) -> np.ndarray | None:
    """seq with the transfers of each worker-step that holds more of one type than most of its
    stage's replica-steps (an extra row) renumbered, where its other end (the partner stage's
    worker of the same DP rank and step) holds the usual count: the rows that pair best with
    the other end's, by end time, take the worker's first seq_ids, the rest the last ones.
    None where nothing was renumbered.

    A profiler numbers each type's rows in order, so a stray transfer mid-step shifts every
    later seq_id by one; by seq_id the later transfers then paired one microbatch off with
    their other ends (and the last one, numbered past the schedule, was left out as the stray),
    which read as slow transfers and host stalls beside a real straggler.
    """
    rows = np.flatnonzero(np.isin(ops["optype"], _TYPES))
    if not len(rows):
        return None
    pp = int(ops["stage"].max()) + 1
    kind = np.searchsorted(_TYPES, ops["optype"][rows].astype(np.int64))
    group = ((d_idx[rows].astype(np.int64) * pp + ops["stage"][rows]) * t + t_idx[rows]) * 4 + kind
    counts = np.bincount(group, minlength=d * pp * t * 4).reshape(d, pp, t, 4)
    usual = np.zeros((pp, 4), np.int64)         # most replica-steps' count per stage and type
    for s in range(pp):
        for k in range(4):
            held = counts[:, s, :, k].ravel()
            usual[s, k] = int(np.argmax(np.bincount(held))) if held.any() else 0
    odd = np.argwhere((counts > usual[None, :, None, :])
                      & (counts <= usual[None, :, None, :] + _MAX_EXTRA))
    if not len(odd):
        return None
    by_group = np.lexsort((seq[rows], group))
    order = rows[by_group]                          # each group's rows by seq_id
    bounds = np.searchsorted(group[by_group], np.arange(d * pp * t * 4 + 1))
    end = ops["start_ts"].astype(np.float64) + ops["duration"]
    out = seq.copy()
    changed = False
    for a, s, step, k in odd.tolist():
        other, delta = PARTNER[int(_TYPES[k])]
        to = s + delta
        if interleaved:
            to %= pp
        if not 0 <= to < pp:
            continue
        k2 = int(np.searchsorted(_TYPES, other))
        m = int(usual[s, k])
        if counts[a, to, step, k2] != m or usual[to, k2] != m or m == 0:
            continue
        g, g2 = ((a * pp + s) * t + step) * 4 + k, ((a * pp + to) * t + step) * 4 + k2
        mine, theirs = order[bounds[g]:bounds[g + 1]], order[bounds[g2]:bounds[g2 + 1]]
        keep = _best_kept(end[mine], end[theirs])
        new = np.sort(seq[mine])
        out[mine[keep]] = new[:m]
        out[mine[~keep]] = new[m:]
        changed = changed or bool(np.any(out[mine] != seq[mine]))
    return out if changed else None


def _best_kept(mine: np.ndarray, theirs: np.ndarray) -> np.ndarray:
    """bool [len(mine)]: the rows kept, in order, whose ends pair best with `theirs` (fewer):
    extra rows dropped one at a time, each the drop that leaves the pairs' end gaps (less their
    median: the two ranks' clocks may differ) smallest in sum."""
    keep = np.ones(len(mine), bool)
    while keep.sum() > len(theirs):
        at = np.flatnonzero(keep)
        costs = []
        for i in range(len(at)):
            gap = mine[np.delete(at, i)[:len(theirs)]] - theirs
            costs.append(float(np.abs(gap - np.median(gap)).sum()))
        keep[at[int(np.argmin(costs))]] = False
    return keep
