"""Clock offset between two sets of ranks that meet only in ring exchanges (ring attention).

A ring round's exchange on a rank is one grouped launch (send to the next rank, receive from
the one before): it starts when the rank posts it; each of its two links transfers once both
its ends posted, and the exchange ends with the later link. Its end is no instant the group
shares (a rank two hops from a slow one ends every round earlier, by the slow rank's
lateness), so the ends' consensus would take that lateness for a clock offset. Causality pins
the offset instead:

- a rank's exchange cannot end before a neighbour posted (a bound on each side);
- a rank whose exchange ended well past what its own side's posts explain waited for a
  neighbour on the other side: that neighbour's post is its end less their link's transfer
  time (one reading of the offset per such wait).

Of those readings the offset is the one that explains the most exchanges: a reading taken
against a neighbour whose own clock is still wrong explains only its own.

A link's transfer time is the shortest exchange of either of its ends over the job: none is
shorter than its links' transfers, and one whose rank posted last waited for nobody (so a slow
link is no wait). Durations need no clock, so this reads who waited without the offset.
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
        # a link's transfer time: no exchange of either end is shorter than the link's
        # transfer, and one that posted last is no longer (a slow link is no wait)
        self.link: dict[tuple[str, int, int], float] = {}
        for k, rs in self.holders.items():
            for a in rs:
                for b in peers.get(a, {}).get(k[1], ()):
                    if b in spans and k in spans[b]:
                        short = min(spans[a][k][1] - spans[a][k][0],
                                    spans[b][k][1] - spans[b][k][0])
                        key = (k[1], min(a, b), max(a, b))
                        self.link[key] = min(self.link.get(key, short), short)

    def link_time(self, k: tuple, a: int, b: int) -> float:
        """The transfer time between ring neighbours a and b (the round's, where unknown)."""
        return self.link.get((k[1], min(a, b), max(a, b)), self.transfer[k])


@dataclass
class RingReading:
    """What the ring exchanges say of offset D (the new side's clock minus the aligned one's)."""

    waits: list[float] = field(default_factory=list)   # one D per wait across the sides
    low: float = -np.inf                                 # causality: D ≥ low
    high: float = np.inf                                 # and D ≤ high
    rounds: int = 0                                      # ring rounds both sides share
    transfer_s: list[float] = field(default_factory=list)
    # exchanges across the sides with every neighbour placed, to score an offset D by: each
    # (end, own post, tolerance, sign, and per neighbour: post, link time, 1 if across else 0);
    # sign: how D moves the other side's posts on this rank's clock
    scored: list[tuple[float, ...]] = field(default_factory=list)

    def explained(self, d: np.ndarray) -> np.ndarray:
        """How many of the exchanges offset `d` (each candidate) explains: each ends within
        its round's tolerance after its later link's transfer (a link's transfer starts when
        both its ends posted)."""
        if not self.scored:
            return np.zeros(len(d), dtype=np.int64)
        end, own, tol, sign, p1, t1, x1, p2, t2, x2 = (np.array(c)[:, None]
                                                       for c in zip(*self.scored))
        shift = sign * d[None, :]
        model = np.maximum(np.maximum(own, p1 + x1 * shift) + t1,
                           np.maximum(own, p2 + x2 * shift) + t2)
        return (np.abs(end - model) <= tol).sum(axis=0)


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
            if len(known) < len(nbrs) or len(known) != 2:
                continue      # whom it waited for is unknown: a bound only
            links = {n: index.link_time(k, x, n) for n in known}
            # the latest its own side explains (a link across transfers at least after its post)
            base = max(max(post[x], post[n]) + links[n] if side[n][0] == mine
                       else post[x] + links[n] for n in known)
            sign = -1.0 if mine == 0 else 1.0
            out.scored.append((end, post[x], margin, sign,
                               *(v for n in known
                                 for v in (post[n], links[n], float(side[n][0] != mine)))))
            if end - base > margin:          # it waited for a neighbour of the other side
                for n in known:              # the one whose post ends its link's transfer
                    if side[n][0] != mine:
                        out.waits.append(post[n] - (end - links[n]) if mine == 0
                                         else end - links[n] - post[n])
    return out
