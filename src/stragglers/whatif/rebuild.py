"""Rebuild a collective lost at some workers from its group's ends (grid.leave_out_ops)."""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import BLOCKING_COLLECTIVES, DP_COLLECTIVES, OPTYPE_CODES

# Collectives whose members at the stage's DP ranks end together (dependencies.py groups them
# across DP ranks: the gradient collectives, and the blocking ones on the compute stream).
SYNC = [OPTYPE_CODES[x] for x in DP_COLLECTIVES + BLOCKING_COLLECTIVES]
# ... the embedding all-reduce: a DP rank's first and last stage end together; the clip:
# every worker of every stage (a layernorm all-reduce is within a worker's tensor-parallel
# group: its ends say nothing of another worker's, and it is never rebuilt).
EMBEDDING = OPTYPE_CODES["embedding-grads-all-reduce"]
CLIP = OPTYPE_CODES["optimizer-clip-main-grad"]
REBUILT = SYNC + [EMBEDDING, CLIP]

# Clock error allowed between workers when fitting a rebuilt op between a worker's own ops:
# this share of the step's span (the monitor aligns clocks on collective ends first).
CLOCK_SHARE = 0.01
# Seconds by which one rank's ops may seem to overlap in its own order (timer resolution).
SAME_CLOCK = 5e-5


def rebuild_lost(start: np.ndarray, duration: np.ndarray, row: np.ndarray, present: np.ndarray,
                 node_stage: np.ndarray, node_optype: np.ndarray, node_seq: np.ndarray,
                 lost: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Rebuild each `lost` collective ([N] bool) at the workers of its stage that lack it, in
    the `steps` ([T] bool) analysed, in place on the [N, D, T] arrays; [N] which were rebuilt.

    A collective's members end together, so the op a worker lost ends where its group's
    other members end (their median: the stage's other DP ranks; for the embedding
    all-reduce the DP rank's other end stage, for the clip every worker; REBUILT names the
    types); it began once the worker's own previous op ended (the op that
    precedes it on a peer that ran it): the time between is the worker's wait for the group,
    kept as the wait it was, not turned into a launch delay (a healthy worker waiting for a
    3x straggler in a collective its profiler lost was named a host stall) nor into compute.
    An op is rebuilt only where it fits every such worker's own ops in every step: its
    previous op ended before the group's end and its next op began after it (within clock
    error); where not (a peer's extra op rather than a lost one, or a collective run beside
    compute), it is not rebuilt and the caller leaves it out. The rebuilt cell borrows a
    peer's row for the columns read there (bytes, waits). (A lacking worker's process group
    is unknown: where a stage's DP ranks run the op in several groups, their ends' median
    stands for its group's, bounded by the same fit.)"""
    done = np.zeros(len(lost), bool)
    ts = np.flatnonzero(steps)
    if not len(ts) or not lost.any():
        return done
    # one step's [N, D] cells at a time: a copy of the grid would be the job's size
    for n in np.flatnonzero(lost & np.isin(node_optype, REBUILT)).tolist():
        same = (node_optype == node_optype[n]) & (node_seq == node_seq[n])
        same[n] = False          # (the same op at the other stages: a cross-stage group's)
        stage = node_stage == node_stage[n]
        others = stage.copy()
        others[n] = False
        cells = []
        for t in ts.tolist():
            at, held = present[:, :, t], present[n, :, t]
            lacking = np.flatnonzero(at[stage].any(axis=0) & ~held)   # (rows at the stage)
            if not len(lacking):
                continue
            if not held.any():   # (nobody ran it in this step: nothing to end with)
                break
            begin_t, end_t = start[:, :, t], start[:, :, t] + duration[:, :, t]
            eps = CLOCK_SHARE * float(end_t[at].max() - begin_t[at].min())
            holders = np.flatnonzero(held)
            h = holders[0]
            group_end = _group_end(int(node_optype[n]), n, lacking, same, end_t, at)
            if group_end is None:
                break
            mine = (others & at[:, h])[:, None] & at[:, lacking]                  # [N, L]
            # (the peer's own ops, on its one clock: its order within a rank's timer error)
            before = mine & ((end_t[:, h] <= begin_t[n, h] + SAME_CLOCK)
                             & (begin_t[:, h] < begin_t[n, h]))[:, None]
            after = mine & (begin_t[:, h] >= end_t[n, h] - SAME_CLOCK)[:, None]
            if not before.any(axis=0).all():
                break
            prev = np.argmax(np.where(before, end_t[:, h][:, None], -np.inf), axis=0)   # [L]
            ready = end_t[prev, lacking]
            nxt = np.where(after, begin_t[:, lacking], np.inf).min(axis=0)
            if (ready > group_end + eps).any() or (group_end > nxt + eps).any():
                break
            stop = np.minimum(group_end, nxt)
            begin = np.minimum(ready, stop)
            cells.append((lacking, t, begin, stop - begin, row[n, h, t]))
        else:
            for lacking, t, begin, dur, peer_row in cells:
                start[n, lacking, t], duration[n, lacking, t] = begin, dur
                row[n, lacking, t], present[n, lacking, t] = peer_row, True
            done[n] = True
    return done


def _group_end(code: int, n: int, lacking: np.ndarray, same: np.ndarray, end_t: np.ndarray,
               at: np.ndarray) -> np.ndarray | None:
    """[L] where the lost op's group ended for each lacking worker in one step (end_t, at:
    [N, D] ends and presence); None where no member of its group ran it there."""
    if code == EMBEDDING:    # (the same DP rank's end at the other end stage)
        ends = np.where(at[same][:, lacking], end_t[same][:, lacking], np.nan)
        if not np.isfinite(ends).any(axis=0).all():
            return None
        return np.nanmedian(ends, axis=0)
    ends = end_t[n][at[n]]
    if code == CLIP:         # (every worker of every stage)
        ends = np.concatenate([ends, end_t[same][at[same]]])
    return np.full(len(lacking), float(np.median(ends))) if len(ends) else None


def rebuild_in_parts(parts: list[tuple], node_stage: np.ndarray, node_optype: np.ndarray,
                     node_seq: np.ndarray, lost: np.ndarray) -> np.ndarray:
    """rebuild_lost over a job held in step partitions, each (start, duration, row, present,
    steps) as rebuild_lost takes them (set in place); [N] which were rebuilt, as rebuild_lost
    of the partitions joined would tell (whatif/partitioned.py reads a run so).

    A step's rebuild reads that step alone, but an op rebuilt is seen by the ops after it:
    op by op in rebuild_lost's order, each kept only where every partition rebuilt it, its
    cells set back where not (else a later op, in a partition that had rebuilt it, fitted
    between cells the whole job never had)."""
    done = np.zeros(len(lost), bool)
    parts = [p for p in parts if p[4].any()]   # (a partition with no step analysed: no say)
    for n in np.flatnonzero(lost & np.isin(node_optype, REBUILT)).tolist():
        one = np.zeros(len(lost), bool)
        one[n] = True
        before = [tuple(a[n].copy() for a in part[:4]) for part in parts]
        if all(rebuild_lost(part[0], part[1], part[2], part[3], node_stage, node_optype,
                            node_seq, one, part[4])[n]
               for part in parts):
            done[n] = True
            continue
        for part, cells in zip(parts, before):
            for a, old in zip(part[:4], cells):
                a[n] = old
    return done


def with_group(rebuilt: np.ndarray, kept: np.ndarray, node_optype: np.ndarray,
               node_seq: np.ndarray) -> np.ndarray:
    """`rebuilt` ([N]) and the ops of a cross-stage group (the embedding all-reduce, the clip)
    rebuilt at one stage that are not `kept` at its other stages (left out for its sake only:
    the group's op is kept whole)."""
    cross = rebuilt & np.isin(node_optype, (EMBEDDING, CLIP))
    partner = np.zeros_like(rebuilt)
    for n in np.flatnonzero(cross).tolist():
        partner |= (node_optype == node_optype[n]) & (node_seq == node_seq[n])
    return rebuilt | (partner & ~kept)
