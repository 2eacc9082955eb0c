"""StragglAR schedules at scale (red team round 8 #8): the greedy synthesis is unchanged but
cheaper, and pricing phase 2 for thousands of ranks builds no schedule."""

from __future__ import annotations

import pytest

from stragglers.collectives.cost_model import PAPER_LINK, break_even_delay, stragglar_phase2_time
from stragglers.collectives.schedule import (PRICED_SYNTHESIS_MAX_N, Transfer, _exchange,
                                             _greedy_schedule, lower_bound_rounds, phase2_rounds,
                                             synthesize)


def _old_greedy_schedule(n: int, max_rounds: int, chunk_order: str = "fewest", sender_pref: bool = False
                     ) -> list[list[Transfer]] | None:
    """The greedy before round 8 #8 (~n⁴ list scans), kept to check the new one builds the same: the straggler exchange, then chunk by chunk each free
    holder sends to a free rank that lacks it; None if it needs more than `max_rounds`.

    chunk_order "fewest": chunks with the fewest holders first (they must double to make their
    deadline); "oldest": lowest missing chunk first before S is free, highest after. Receivers
    that meet S soonest pick first. sender_pref: holders of the fewest unfinished chunks send first.
    """
    s = n - 1
    held: list[set[int]] = [set() for _ in range(n)]
    holders_of = [0] * (n - 1)
    unfinished = set(range(n - 1))
    rounds: list[list[Transfer]] = []
    t = 0
    while unfinished:
        if t >= max_rounds:
            return None
        rnd: list[Transfer] = []
        sent, got = set(), set()
        if t <= n - 2:
            rnd += _exchange(t, s)
            sent |= {t, s}
            got |= {t, s}
        if chunk_order == "fewest":
            order = sorted(unfinished, key=lambda c: (holders_of[c], c))
        else:
            order = sorted(unfinished, reverse=t >= n - 1)
        recv_order = sorted((r for r in range(n) if r not in got), key=lambda r: (r <= t or r == s, r))
        for c in order:
            holders = [a for a in range(n) if c in held[a] and a not in sent]
            if not holders:
                continue
            if sender_pref:
                holders.sort(key=lambda a: (len(held[a] & unfinished), a))
            takers = [b for b in recv_order if b not in got and c not in held[b]]
            for a, b in zip(holders, takers):
                rnd.append(Transfer(a, b, c))
                sent.add(a)
                got.add(b)
        for tr in rnd:
            if tr.exchange:
                if tr.src == tr.chunk:
                    held[tr.src].add(tr.chunk)
                    held[s].add(tr.chunk)
                    holders_of[tr.chunk] += 2
            else:
                held[tr.dst].add(tr.chunk)
                holders_of[tr.chunk] += 1
        unfinished = {c for c in unfinished if holders_of[c] < n}
        rounds.append(rnd)
        t += 1
    return rounds


@pytest.mark.parametrize("order", ["fewest", "oldest"])
@pytest.mark.parametrize("pref", [False, True])
def test_the_greedy_builds_the_same_schedules_as_before_for_n_up_to_64(order, pref):
    """Per chunk sets of holders instead of scans of every rank: the same rounds, transfer for
    transfer, for every n = 2..64 and every variant (and the same None past max_rounds)."""
    for n in range(2, 65):
        assert _greedy_schedule(n, 4 * n + 8, order, pref) == \
            _old_greedy_schedule(n, 4 * n + 8, order, pref), n
        short = lower_bound_rounds(n) - 1
        assert _greedy_schedule(n, short, order, pref) is None
        assert _old_greedy_schedule(n, short, order, pref) is None


@pytest.mark.parametrize("n", [1000, 4095, 4096, 20000])
def test_pricing_thousands_of_ranks_builds_no_schedule(n):
    """advise prices phase 2 from its round count: a power of two's is the construction's
    n-2+log2(n), above PRICED_SYNTHESIS_MAX_N the lower bound with a note; neither synthesises
    (before: synthesize(n), ~n⁴ for 1,000, 8.4 M Transfers for 4,096)."""
    synthesize.cache_clear()
    rounds, note = phase2_rounds(n)
    assert rounds == lower_bound_rounds(n)
    assert (note == "") == (n & (n - 1) == 0)
    if note:
        assert "lower bound" in note and str(PRICED_SYNTHESIS_MAX_N) in note
    assert stragglar_phase2_time(n, 1e6, PAPER_LINK) == pytest.approx(
        rounds * (PAPER_LINK.alpha + 1e6 / (n - 1) * PAPER_LINK.beta))
    break_even_delay(n, 1e6, PAPER_LINK)
    assert synthesize.cache_info().misses == 0


@pytest.mark.parametrize("n", [8, 10, 63, 130])
def test_pricing_below_the_cap_uses_the_synthesised_schedule(n):
    """Up to the cap the priced rounds are the real schedule's (above the bound where it is)."""
    assert phase2_rounds(n) == (synthesize(n).num_rounds, "")
