"""The controller's arithmetic: batch split (docs/adaptive.md §4), rounding, accumulation, restart gain."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stragglers.adapt.policies import (loss_scale, micro_batches, optimal_step_time,
                                       restart_gain, round_preserving_sum, split_batch)
from stragglers.errors import InputError


def test_split_is_proportional_to_throughput_without_overhead():
    assert split_batch(120, [1, 1, 1, 1]) == [30, 30, 30, 30]
    assert split_batch(100, [3, 1]) == [75, 25]
    sizes = split_batch(128, [1, 1, 1, 1 / 3])
    assert sum(sizes) == 128
    assert sizes[3] == pytest.approx(128 / 10, abs=1)


def test_split_with_overheads_equalises_step_times():
    v, c = [100.0, 50.0, 25.0], [0.1, 0.05, 0.0]
    sizes = split_batch(300, v, c)
    t_star = optimal_step_time(300, v, c)
    assert sum(sizes) == 300
    for b, vi, ci in zip(sizes, v, c):
        assert b / vi + ci == pytest.approx(t_star, abs=1.0 / vi)


def test_worker_whose_overhead_exceeds_the_step_gets_nothing():
    sizes = split_batch(10, [100.0, 100.0], [0.0, 1.0])
    assert sizes == [10, 0]


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 5000), st.lists(st.floats(0.01, 1000), min_size=1, max_size=16))
def test_split_always_keeps_the_global_batch(total, speeds):
    sizes = split_batch(total, speeds)
    assert sum(sizes) == total and min(sizes) >= 0
    # Rounded for the smallest step time: the worst step is within one sample of the ideal's.
    t_ideal = total / sum(speeds)
    assert max(b / s for b, s in zip(sizes, speeds)) <= t_ideal + 1 / min(speeds) + 1e-9


def test_rounding_minimises_the_step_time():
    # Largest remainder would give [19, 19, 19, 7]: 7 / 0.33 = 21.2 > 20.
    assert split_batch(64, [1, 1, 1, 0.33]) == [20, 19, 19, 6]


@given(st.lists(st.floats(0, 100), min_size=1, max_size=10))
def test_rounding_preserves_the_sum(values):
    total = round(sum(values))
    out = round_preserving_sum(values, total)
    assert sum(out) == total


def test_micro_batches_respect_the_memory_cap():
    assert micro_batches(14, 4) == [4, 4, 3, 3]
    assert micro_batches(3, 4) == [3]
    assert micro_batches(0, 4) == []
    assert micro_batches(9, None) == [9]
    for b in range(1, 60):
        parts = micro_batches(b, 7)
        assert sum(parts) == b and max(parts) <= 7 and len(parts) == -(-b // 7)


def test_restart_gain_and_loss_scale():
    assert restart_gain(0.3, 0.1, 100) == pytest.approx(20.0)
    assert restart_gain(0.1, 0.3, 100) == 0.0
    assert loss_scale(4, 16, 128) == 0.5


def test_bad_inputs_are_reported():
    with pytest.raises(InputError, match="throughputs"):
        split_batch(10, [])
    with pytest.raises(InputError, match="throughputs"):
        split_batch(10, [0, 0])
    with pytest.raises(InputError, match="memory_cap"):
        micro_batches(10, 0)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 24), st.lists(st.floats(0.1, 10), min_size=2, max_size=3))
def test_rounded_split_is_optimal_against_brute_force(total, speeds):
    import itertools

    best = min(max(b / s for b, s in zip(split, speeds))
               for split in itertools.product(range(total + 1), repeat=len(speeds))
               if sum(split) == total)
    ours = max(b / s for b, s in zip(split_batch(total, speeds), speeds))
    assert ours == pytest.approx(best)
