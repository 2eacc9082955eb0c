"""Clock offset between two sets of ranks that meet only in ring exchanges (ring attention).

A ring round's exchange on a rank is one grouped launch (send to the next rank, receive from
the one before): it starts when the rank posts it and ends a transfer time after the latest
post among the rank and its two neighbours. Its end is no instant the group shares (a rank two
hops from a slow one ends every round earlier, by the slow rank's lateness), so the ends'
consensus would take that lateness for a clock offset. Causality pins the offset instead:

- a rank's exchange cannot end before a neighbour posted (a bound on each side);
- a rank whose exchange ended well past its own post and its own side's neighbours' waited
  for a neighbour on the other side: that neighbour's post is its end less the transfer time
  (one reading of the offset per such wait).

Of those readings the offset is the one that explains the most exchanges (an exchange is
explained where it ends a transfer time after the latest post of its rank and neighbours): a
reading taken against a neighbour whose own clock is still wrong explains only its own.

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


class RingIndex:
    """Each ring exchange's holders and transfer time (its shortest exchange: the rank that
    posted last waited for nobody), and each rank's spans; built once, read many times."""

    def __init__(self, spans: dict[int, dict[tuple, Span]],
                 peers: dict[int, dict[str, tuple[int, int]]]) -> None:
        self.spans, self.peers = spans, peers
        self.holders: dict[tuple, list[int]] = {}
        for r in sorted(spans):
            for k in spans[r]:
                if k and k[0] == RING_SYNC:
                    self.holders.setdefault(k, []).append(r)
        self.transfer = {k: min(spans[r][k][1] - spans[r][k][0] for r in rs)
                         for k, rs in self.holders.items()}


@dataclass
class RingReading:
    """What the ring exchanges say of offset D (the new side's clock minus the aligned one's)."""

    waits: list[float] = field(default_factory=list)   # one D per wait across the sides
    low: float = -np.inf                                 # causality: D ≥ low
    high: float = np.inf                                 # and D ≤ high
    rounds: int = 0                                      # ring rounds both sides share
    transfer_s: list[float] = field(default_factory=list)
    # exchanges across the sides with every neighbour placed, to score an offset D by:
    # new side's (end - transfer, latest own-side post, latest aligned-side post)
    mine: list[tuple[float, float, float, float]] = field(default_factory=list)
    # aligned side's (end - transfer, latest aligned-side post, latest new-side post)
    theirs: list[tuple[float, float, float, float]] = field(default_factory=list)

    def explained(self, d: np.ndarray) -> np.ndarray:
        """How many of the exchanges offset `d` (each candidate) explains: each ends within
        its round's tolerance after the latest post of its rank and neighbours."""
        out = np.zeros(len(d), dtype=np.int64)
        for rows, sign in ((self.mine, 1.0), (self.theirs, -1.0)):
            if rows:
                p, q, o, tol = (np.array(c)[:, None] for c in zip(*rows))
                out += (np.abs(p - np.maximum(q, o + sign * d[None, :])) <= tol).sum(axis=0)
        return out


def read_ring(aligned: dict[int, float], new: dict[int, float], index: RingIndex
              ) -> RingReading:
    """Read offset D of the ranks `new` (their offsets within their own set) against the ranks
    `aligned` (their final offsets) from the ring exchanges the two sets share."""
    spans, peers = index.spans, index.peers
    side = {**{r: (0, off) for r, off in aligned.items()},
            **{r: (1, off) for r, off in new.items()}}
    out = RingReading()
    keys = {k for r in new for k in spans.get(r, {}) if k in index.holders}
    for k in sorted(keys, key=repr):
        holders = [r for r in index.holders[k] if r in side]
        if len({side[r][0] for r in holders}) < 2:
            continue
        out.rounds += 1
        t = index.transfer[k]
        out.transfer_s.append(t)
        margin = max(t, MIN_WAIT_S)
        for x in holders:
            nbrs = peers.get(x, {}).get(k[1])
            if nbrs is None:
                continue
            known = [n for n in nbrs if n in side and k in spans.get(n, {})]
            mine, off = side[x]
            post = {n: spans[n][k][0] - side[n][1] for n in (x, *known)}
            end = spans[x][k][1] - off
            other = [post[n] for n in known if side[n][0] != mine]
            if not other:
                continue
            if mine == 0:     # true end ≥ the other side's post: D ≥ post - end
                out.low = max(out.low, max(other) - end)
            else:             # true end (end - D) ≥ the aligned side's post: D ≤ end - post
                out.high = min(out.high, end - max(other))
            if len(known) < len(nbrs):
                continue      # whom it waited for is unknown: a bound only
            own = max(post[n] for n in (x, *known) if side[n][0] == mine)
            (out.theirs if mine == 0 else out.mine).append((end - t, own, max(other), margin))
            if end - t - own > margin:       # it waited for a neighbour of the other side
                out.waits.append(max(other) - (end - t) if mine == 0
                                 else end - t - max(other))
    return out
