"""StragglAR phase-2 schedules for n that is not a power of two: a maximum-weight matching
per round, searched with a small beam (docs/stragglar.md §2).

Each round is a maximum-weight bipartite matching (senders × receivers, scipy's
`linear_sum_assignment`) in which a sender offers a receiver the chunk it lacks that is most
urgent; several weightings (fewest holders first, oldest-first before the straggler is free and
newest-first after, a deadline slack, and randomised ties) give several candidate rounds. A
beam keeps the `width` partial schedules with the earliest provable finishing round (each rank
receives at most one chunk per round; a chunk's holders at most double per round), then the
most chunks delivered. The result is verified by `schedule.verify` like every other schedule.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.optimize import linear_sum_assignment

Round = list[tuple[int, int, int, bool]]  # (src, dst, chunk, exchange)


def _lower_bound(n: int) -> int:
    return n - 2 + math.ceil(math.log2(n))


def _weights(n: int, held: np.ndarray, t: int, target: int, kind: int) -> np.ndarray:
    """Per-chunk urgency for round t under weighting `kind` (0 for chunks nobody can send)."""
    holders = held.sum(axis=0).astype(float)
    idx = np.arange(n - 1)
    if kind == 0:  # fewest holders first: they must double to make their deadline
        f = 1.0 / np.maximum(holders, 1)
    elif kind == 1:
        f = np.exp(-holders / 2)
    elif kind == 2:  # lowest missing chunk before S is free, highest after (the paper's rule)
        f = 1.0 / np.maximum(holders, 1) + 0.05 * (-idx if t < n - 1 else idx) / n
    else:  # deadline slack against the target round count
        need = np.ceil(np.log2(n / np.maximum(holders, 1)))
        f = 1.0 / (1.0 + np.maximum(target - t - need, 0)) + 0.01 / np.maximum(holders, 1)
    return np.where(holders >= n, 0.0, np.where(holders > 0, f, 0.0))


def _round(n: int, held: np.ndarray, t: int, target: int, kind: int,
           rng: np.random.Generator | None) -> tuple[Round, np.ndarray]:
    """One round: the straggler exchange (t <= n-2), then a maximum-weight matching."""
    s = n - 1
    rnd: Round = []
    busy: list[int] = []
    if t <= n - 2:
        rnd += [(t, s, t, True), (s, t, t, True)]
        busy = [t, s]
    urgency = _weights(n, held, t, target, kind)
    if rng is not None:  # randomised ties: a different, equally greedy matching
        urgency = urgency * (1 + 0.3 * rng.random(urgency.shape))
    order = np.argsort(-urgency, kind="stable")
    order = order[urgency[order] > 0]
    if order.size == 0:
        after = held.copy()
        if t <= n - 2:
            after[t, t] = after[s, t] = True
        return rnd, after
    # for each (sender a, receiver b): the most urgent chunk a holds and b lacks (bool ops)
    P = held[:, order]
    useful = P[:, None, :] & ~P[None, :, :]
    first = useful.argmax(axis=2)
    ok = np.take_along_axis(useful, first[:, :, None], axis=2)[:, :, 0]
    ok[busy, :] = False
    ok[:, busy] = False
    np.fill_diagonal(ok, False)
    # a constant per transfer first (as many transfers as possible), urgency second; a rank
    # that meets S next round cannot forward what it gets, so it is a worse receiver
    total = np.where(ok, 10.0 + urgency[order][first], 0.0)
    if t + 1 <= n - 2:
        total[:, t + 1] -= 0.5 * ok[:, t + 1]
    if rng is not None:  # and a random order among equal matchings
        perm = rng.permutation(n)
        rows, cols = linear_sum_assignment(total[perm][:, perm], maximize=True)
        rows, cols = perm[rows], perm[cols]
    else:
        rows, cols = linear_sum_assignment(total, maximize=True)
    after = held.copy()
    for a, b in zip(rows.tolist(), cols.tolist()):
        if ok[a, b]:
            c = int(order[first[a, b]])
            rnd.append((a, b, c, False))
            after[b, c] = True
    if t <= n - 2:
        after[t, t] = after[s, t] = True
    return rnd, after


def finish_bound(n: int, held: np.ndarray, t: int) -> int:
    """A lower bound on the last round of any completion of this state (after round t).

    Each ready rank receives one chunk per round: its missing chunks arrive no earlier than
    round t+1 (finished ones) or c+1 (chunk c, finished at round c), and it cannot receive in
    its own exchange round. Each finished chunk's holders at most double per round.
    """
    m = n - 1
    ranks = np.arange(m)
    arrival = np.where(np.arange(m)[None, :] <= t, t + 1, np.arange(m)[None, :] + 1)
    arrival = np.broadcast_to(arrival, (m, m)).astype(float).copy()
    missing = ~held[:m, :]
    missing[ranks, ranks] = False  # its own chunk comes from the exchange
    arrival[~missing] = np.inf
    arrival.sort(axis=1)
    count = missing.sum(axis=1)
    j = np.arange(m)[None, :]
    # single-server queue with unit service: finish = max_j (a_(j) + (count − 1 − j))
    finish = np.where(np.isfinite(arrival), arrival + (count[:, None] - 1 - j), -np.inf).max(axis=1)
    finish = np.where(count > 0, finish, t)
    finish = finish + ((ranks > t) & (ranks <= np.minimum(finish, n - 2)))  # busy round
    worst = int(finish.max()) if m else t
    holders = held.sum(axis=0)
    for c in np.flatnonzero((np.arange(m) <= t) & (holders < n)):
        able = holders[c] - (1 if (t + 1 <= n - 2 and held[n - 1, c]) else 0)
        worst = max(worst, t + int(math.ceil(math.log2(n / max(able, 1)))))
    return worst


def matching_schedule(n: int, width: int = 16, candidates: int = 8, seed: int = 0,
                      max_rounds: int | None = None) -> list[Round] | None:
    """The shortest schedule the beam finds for n ranks (None past `max_rounds`)."""
    rng = np.random.default_rng(seed)
    target = _lower_bound(n)
    max_rounds = max_rounds or 3 * n + 8
    beam: list[tuple[np.ndarray, list[Round]]] = [(np.zeros((n, n - 1), dtype=bool), [])]
    for t in range(max_rounds):
        # (finish bound, -delivered, order, state, rounds): the beam keeps the lowest
        scored: list[tuple[int, float, int, np.ndarray, list[Round]]] = []
        seen: set[bytes] = set()  # one copy of each state per level, whatever its parent
        for held, rounds in beam:
            for k in range(candidates):
                rnd, after = _round(n, held, t, target, k % 4, rng if k >= 4 else None)
                key = after.tobytes()
                if key in seen:
                    continue
                seen.add(key)
                if after.all():
                    return rounds + [rnd]
                # then most chunks delivered, then holders spread over more chunks
                spread = float(np.log2(np.maximum(after.sum(axis=0), 1)).sum())
                scored.append((finish_bound(n, after, t), -(after.sum() + 0.01 * spread),
                               len(scored), after, rounds + [rnd]))
        scored.sort(key=lambda x: x[:3])
        if not scored or scored[0][0] >= max_rounds:
            # no state can finish by round max_rounds - 1 (its bound is a lower bound on its
            # last round): the levels left would only prove it (the beam's one exit)
            return None
        beam = [(after, rounds) for *_, after, rounds in scored[:width]]
    return None
