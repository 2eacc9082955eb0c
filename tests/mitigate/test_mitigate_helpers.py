"""balance_sequences and suggest_stage_split (property tests), PlannedGC with real collections."""

from __future__ import annotations

import gc
import itertools
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stragglers.errors import InputError
from stragglers.mitigate import PlannedGC, balance_sequences, split_costs, suggest_stage_split

costs_st = st.lists(st.floats(0.0, 100.0, allow_nan=False), min_size=1, max_size=9)


def brute_force_bottleneck(costs, p, head, emb):
    best = float("inf")
    n = len(costs)
    for cuts in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *cuts, n)
        split = [bounds[i + 1] - bounds[i] for i in range(p)]
        best = min(best, max(split_costs(costs, split, emb, head)))
    return best


@settings(max_examples=150, deadline=None)
@given(costs=costs_st, p=st.integers(1, 4), head=st.floats(0, 200), emb=st.floats(0, 50))
def test_stage_split_is_optimal_and_complete(costs, p, head, emb):
    if len(costs) < p:
        with pytest.raises(InputError):
            suggest_stage_split(costs, p, head_cost=head, embedding_cost=emb)
        return
    split = suggest_stage_split(costs, p, head_cost=head, embedding_cost=emb)
    assert len(split.layers_per_stage) == p
    assert sum(split.layers_per_stage) == len(costs)
    assert min(split.layers_per_stage) >= 1
    assert split.stage_costs == pytest.approx(split_costs(costs, split.layers_per_stage, emb, head))
    assert split.bottleneck == pytest.approx(brute_force_bottleneck(costs, p, head, emb))


def test_stage_split_moves_layers_off_a_heavy_head():
    # 6 equal blocks on 2 stages, the head costs two blocks: the last stage gets fewer blocks
    split = suggest_stage_split([1.0] * 6, 2, head_cost=2.0)
    assert split.layers_per_stage == [4, 2]
    assert split.bottleneck == 4.0


@settings(max_examples=150, deadline=None)
@given(lens=st.lists(st.integers(1, 512), min_size=1, max_size=60),
       dp=st.integers(1, 4), mb=st.integers(1, 4))
def test_balance_sequences_assigns_each_once_within_greedy_bound(lens, dp, mb):
    plan = balance_sequences(lens, dp, mb)
    got = sorted(i for row in plan.bins for b in row for i in b)
    assert got == list(range(len(lens)))
    assert len(plan.bins) == dp and all(len(row) == mb for row in plan.bins)
    costs = [c for row in plan.cost for c in row]
    assert sum(costs) == pytest.approx(sum(s * s for s in lens))
    # greedy list scheduling: the fullest bin exceeds the mean by at most one item
    assert max(costs) <= sum(costs) / len(costs) + max(s * s for s in lens) + 1e-6


@settings(max_examples=100, deadline=None)
@given(lens=st.lists(st.integers(1, 64), min_size=1, max_size=40), dp=st.integers(1, 3))
def test_balance_sequences_respects_token_budget_or_says_so(lens, dp):
    budget = 128
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = balance_sequences(lens, dp, 2, max_tokens=budget)
    over = [t for row in plan.tokens for t in row if t > budget]
    assert bool(over) == bool(plan.notes) == bool(caught)
    if sum(lens) > dp * 2 * budget:
        assert over, "an impossible budget must be reported, not silently met"


def test_balance_sequences_beats_in_order_packing():
    lens = [512] + [16] * 32 + [256, 256] + [32] * 16  # one long sequence, many short ones
    plan = balance_sequences(lens, 2, 2)
    in_order = [sum(s * s for s in lens[i::4]) for i in range(4)]
    assert max(c for row in plan.cost for c in row) <= max(in_order)
    assert plan.imbalance < max(in_order) / (sum(in_order) / 4)


def test_balance_sequences_rejects_bad_input():
    with pytest.raises(InputError, match="seq_lens"):
        balance_sequences([3, 0], 1, 1)
    with pytest.raises(InputError, match="dp_size"):
        balance_sequences([3], 0, 1)
    with pytest.raises(InputError, match="max_tokens"):
        balance_sequences([300], 1, 1, max_tokens=100)
    for bad in (2.7, float("nan"), "a"):   # truncated, or a bare ValueError from int()
        with pytest.raises(InputError, match="integer lengths"):
            balance_sequences([3, bad], 1, 1)
    assert balance_sequences(np.array([3, 5]), 1, 2).tokens == [[5, 3]]   # numpy ints are fine


def make_cycles(n: int) -> None:
    for _ in range(n):
        a: list = []
        a.append([a])


@pytest.mark.slow
def test_planned_gc_collects_only_on_its_steps():
    pauses: list[int] = []

    def on_gc(phase, info):
        if phase == "stop":
            pauses.append(info["generation"])

    was_enabled = gc.isenabled()
    gc.callbacks.append(on_gc)
    try:
        with PlannedGC(every=3) as planned:
            assert not gc.isenabled()
            collected_at = []
            for step in range(9):
                before = len(pauses)
                make_cycles(5000)  # plenty to trigger automatic collections, were they on
                if planned.step(step):
                    collected_at.append(step)
                    assert len(pauses) == before + 1 and pauses[-1] == 2
                else:
                    assert len(pauses) == before, "no automatic collection while planned"
            assert collected_at == [2, 5, 8] and planned.collections == 3
        assert gc.isenabled() == was_enabled
    finally:
        gc.callbacks.remove(on_gc)


def test_planned_gc_rejects_bad_period():
    from stragglers.errors import StragglersError

    with pytest.raises(StragglersError, match="every"):
        PlannedGC(every=0)
