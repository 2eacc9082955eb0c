"""Rebuild a collective lost at some workers from its group's ends (grid.leave_out_ops)."""

from __future__ import annotations

import numpy as np

# Clock error allowed between workers when fitting a rebuilt op between a worker's own ops:
# this share of the step's span (the monitor aligns clocks on collective ends first).
CLOCK_SHARE = 0.01
# Seconds by which one rank's ops may seem to overlap in its own order (timer resolution).
SAME_CLOCK = 5e-5


def rebuild_lost(start: np.ndarray, duration: np.ndarray, row: np.ndarray, present: np.ndarray,
                 node_stage: np.ndarray, lost: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Rebuild each `lost` collective ([N] bool) at the workers of its stage that lack it, in
    the `steps` ([T] bool) analysed, in place on the [N, D, T] arrays; [N] which were rebuilt.

    A blocking collective's members end together, so the op a worker lost ends where its
    peers' end (their median); it began once the worker's own previous op ended (the op that
    precedes it on a peer that ran it): the time between is the worker's wait for the group,
    kept as the wait it was, not turned into a launch delay (a healthy worker waiting for a
    3x straggler in a collective its profiler lost was named a host stall) nor into compute.
    An op is rebuilt only where it fits every such worker's own ops in every step: its
    previous op ended before the group's end and its next op began after it (within clock
    error); where not (a peer's extra op rather than a lost one, or a collective run beside
    compute), it is not rebuilt and the caller leaves it out. The rebuilt cell borrows a
    peer's row for the columns read there (bytes, waits)."""
    done = np.zeros(len(lost), bool)
    ts = np.flatnonzero(steps)
    if not len(ts) or not lost.any():
        return done
    # one step's [N, D] cells at a time: a copy of the grid would be the job's size
    for n in np.flatnonzero(lost).tolist():
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
            group_end = float(np.median(end_t[n, holders]))
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
    end = start + duration
    tol: dict[int, float] = {}   # step → the clock error allowed there (a step's cells only:
    #                              a copy of the grid would be the job's size)

    def allowed(t: int) -> float:
        if t not in tol:
            cell = present[:, :, t]
            tol[t] = CLOCK_SHARE * float(end[:, :, t][cell].max() - start[:, :, t][cell].min())
        return tol[t]

    for n in np.flatnonzero(lost).tolist():
        others = node_stage == node_stage[n]
        voters = present[others][:, :, ts].any(axis=0)             # [D, T'] rows at the stage
        others[n] = False
        held = present[n][:, ts]
        if not held.any(axis=0).all():   # (a step where no worker ran it: nothing to end with)
            continue
        cells = []
        for k, t in enumerate(ts.tolist()):
            eps = allowed(t)
            lacking = np.flatnonzero(voters[:, k] & ~held[:, k])
            if not len(lacking):
                continue
            holders = np.flatnonzero(held[:, k])
            h = holders[0]
            group_end = float(np.median(end[n, holders, t]))
            mine = others[:, None] & present[:, h, t][:, None] & present[:, lacking, t]  # [N, L]
            # (the peer's own ops, on its one clock: its order within a rank's timer error)
            before = mine & ((end[:, h, t] <= start[n, h, t] + SAME_CLOCK)
                             & (start[:, h, t] < start[n, h, t]))[:, None]
            after = mine & (start[:, h, t] >= end[n, h, t] - SAME_CLOCK)[:, None]
            if not before.any(axis=0).all():
                break
            prev = np.argmax(np.where(before, end[:, h, t][:, None], -np.inf), axis=0)   # [L]
            ready = end[prev, lacking, t]
            nxt = np.where(after, start[:, lacking, t], np.inf).min(axis=0)
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
