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
    end = start + duration
    with np.errstate(invalid="ignore"):
        span = (np.nanmax(np.where(present, end, np.nan)[:, :, ts], axis=(0, 1))
                - np.nanmin(np.where(present, start, np.nan)[:, :, ts], axis=(0, 1)))
    tol = CLOCK_SHARE * np.nan_to_num(span)
    for n in np.flatnonzero(lost).tolist():
        others = node_stage == node_stage[n]
        voters = present[others][:, :, ts].any(axis=0)             # [D, T'] rows at the stage
        others[n] = False
        held = present[n][:, ts]
        if not held.any(axis=0).all():   # (a step where no worker ran it: nothing to end with)
            continue
        cells = []
        for k, t in enumerate(ts.tolist()):
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
            if (ready > group_end + tol[k]).any() or (group_end > nxt + tol[k]).any():
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
