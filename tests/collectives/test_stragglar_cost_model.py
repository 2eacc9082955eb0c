"""The α–β model reproduces the table of docs/stragglar.md §3 and behaves at the edges."""

import math

import pytest

from stragglers.collectives.cost_model import (PAPER_LINK, LinkModel, algorithm_time, break_even_delay,
                                               halving_doubling_time, ring_time, speedup_over_ring,
                                               stragglar_phase2_time, stragglar_time, tree_time)
from stragglers.errors import InputError

GIB = 2**30


@pytest.mark.parametrize("n,expected", [(4, 1.127), (8, 1.363), (16, 1.565), (32, 1.718), (64, 1.826),
                                        (128, 1.897), (256, 1.941)])
def test_spec_table_to_three_decimals(n, expected):
    assert round(speedup_over_ring(n, GIB, PAPER_LINK), 3) == expected


def test_worst_case_no_delay_is_about_22_percent_slower_at_n8():
    ratio = stragglar_time(8, GIB, PAPER_LINK, 0.0) / ring_time(8, GIB, PAPER_LINK)
    assert 1.21 < ratio < 1.23


def test_terms_match_the_table_formulas():
    link = LinkModel(alpha=1.0, beta=0.0)  # only the α term
    assert ring_time(8, 0, link) == 14
    assert halving_doubling_time(8, 0, link) == 6
    assert stragglar_phase2_time(8, 0, link) == 9
    assert stragglar_time(8, 0, link, 0.0) == 6 + 9  # (n-2) + (n-2+log2 n) = 2(n-2)+log2 n
    link = LinkModel(alpha=0.0, beta=1.0)  # only the sβ term
    assert math.isclose(ring_time(8, 7, link), 2 * 7 / 8 * 7)
    assert math.isclose(stragglar_phase2_time(8, 7, link), 9)
    assert math.isclose(tree_time(8, 1, link), 6)


def test_delay_hides_phase_one_and_break_even_is_consistent():
    size = GIB
    d = break_even_delay(8, size, PAPER_LINK)
    assert 0 < d < 2e-3
    assert stragglar_time(8, size, PAPER_LINK, d * 1.01) < ring_time(8, size, PAPER_LINK, d * 1.01)
    assert stragglar_time(8, size, PAPER_LINK, d * 0.99) > ring_time(8, size, PAPER_LINK, d * 0.99)
    # the spec's approximate threshold is in the same place
    approx = (3 - 2) * PAPER_LINK.alpha + 3 / 8 * size * PAPER_LINK.beta
    assert abs(d - approx) / approx < 0.1


def test_non_power_of_two_and_bad_input():
    assert halving_doubling_time(6, GIB, PAPER_LINK) > halving_doubling_time(4, GIB, PAPER_LINK)
    assert algorithm_time("stragglar", 6, GIB, PAPER_LINK, 1e-3) > 0
    with pytest.raises(InputError, match="algorithm"):
        algorithm_time("butterfly", 8, GIB, PAPER_LINK)
    with pytest.raises(InputError, match="delay"):
        ring_time(8, GIB, PAPER_LINK, -1.0)
    with pytest.raises(InputError, match="n"):
        ring_time(1, GIB, PAPER_LINK)
