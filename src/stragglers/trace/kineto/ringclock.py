"""Clock offset between two sets of ranks that meet only in ring exchanges (ring attention).

A ring round's exchange on a rank is one grouped launch (send to the next rank, receive from
the one before): it starts when the rank posts it and ends a transfer time after the latest
post among the rank and its two neighbours. Its end is no instant the group shares (a rank two
hops from a slow one ends every round earlier, by the slow rank's lateness), so the ends'
consensus would take that lateness for a clock offset. Causality pins the offset instead:

- a rank's exchange cannot end before a neighbour posted (a bound on each side);
- a rank whose exchange ended well past its own post and its own side's neighbours' waited
  for a neighbour on the other side: that neighbour's post is its end less the transfer time
  (one reading of the offset per such wait; their consensus is the offset).

The transfer time of a round is its shortest exchange: the rank that posted last waited for
nobody. Durations need no clock, so this reads who waited without knowing the offset.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stragglers.trace.kineto.ops import RING_SYNC

Span = tuple[float, float]
# A wait shorter than this (or than the round's transfer time) says nothing: transfer times
# vary by about that much between the ranks of one round.
MIN_WAIT_S = 20e-6


@dataclass
class RingReading:
    """What the ring exchanges say of offset D (the new side's clock minus the aligned one's)."""

    waits: list[float] = field(default_factory=list)   # one D per wait across the sides
    low: float = -np.inf                                 # causality: D ≥ low
    high: float = np.inf                                 # and D ≤ high
    rounds: int = 0                                      # ring rounds both sides share
    transfer_s: list[float] = field(default_factory=list)


def read_ring(aligned: dict[int, float], new: dict[int, float],
              spans: dict[int, dict[tuple, Span]],
              peers: dict[int, dict[str, tuple[int, int]]]) -> RingReading:
    """Read offset D of the ranks `new` (their offsets within their own set) against the ranks
    `aligned` (their final offsets) from the ring exchanges the two sets share."""
    side = {**{r: (0, off) for r, off in aligned.items()},
            **{r: (1, off) for r, off in new.items()}}
    out = RingReading()
    keys = {k for r in new for k in spans.get(r, {}) if k and k[0] == RING_SYNC}
    for k in sorted(keys, key=repr):
        holders = [r for r in side if k in spans.get(r, {})]
        if len({side[r][0] for r in holders}) < 2:
            continue
        out.rounds += 1
        # the round's transfer time: its shortest exchange (the last poster waited for no one)
        t = min(spans[r][k][1] - spans[r][k][0] for r in spans if k in spans[r])
        out.transfer_s.append(t)
        margin = max(t, MIN_WAIT_S)
        for x in holders:
            nbrs = peers.get(x, {}).get(k[1])
            if nbrs is None or any(n not in side or k not in spans.get(n, {}) for n in nbrs):
                continue
            mine, off = side[x]
            post = {n: spans[n][k][0] - side[n][1] for n in (x, *nbrs)}
            end = spans[x][k][1] - off
            own = max(post[n] for n in (x, *nbrs) if side[n][0] == mine)
            other = [post[n] for n in nbrs if side[n][0] != mine]
            if not other:
                continue
            waited = end - t - own > margin      # for a neighbour of the other side
            if mine == 0:     # true end ≥ the other side's post: D ≥ post - end
                out.low = max(out.low, max(other) - end)
                if waited:
                    out.waits.append(max(other) - (end - t))
            else:             # true end (end - D) ≥ the aligned side's post: D ≤ end - post
                out.high = min(out.high, end - max(other))
                if waited:
                    out.waits.append(end - t - max(other))
    return out

