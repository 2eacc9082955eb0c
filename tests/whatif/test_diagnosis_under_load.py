"""Runs of the examples recorded beside CPU hogs (tests/data/recorded) are diagnosed as their
injection: the machine's load stretches ops at random, which neither the prediction nor the
gate may take for the cause."""

from __future__ import annotations

from pathlib import Path

from stragglers.trace.load import load_trace
from stragglers.whatif import analyze

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded"


def test_a_heavy_stage_beside_cpu_hogs_is_named_and_rebalancing_predicts_no_slower_steps():
    # stage 1 computes ~8× stage 0; the fix used to scale stage 0's ops ×4, load spikes and
    # all: two of 15 steps came out twice as slow after the fix, its interval fell to 0.97 and
    # the verdict was `unexplained` at S = 1.52
    result = analyze(load_trace(RECORDED / "pp2-heavy-stage-beside-hogs"))
    found = next((f for f in result.diagnosis if f.cause == "stage_imbalance"), None)
    assert found is not None and found.where.pp == [1], result.diagnosis
    assert found.interval is not None and found.interval.low > 1.2, found


def test_a_hot_expert_beside_cpu_hogs_is_named_at_its_rank():
    # the compute after each dispatch follows the rows (correlation ≥ 0.88): the pattern test
    # establishes the cause; the gain, ×1.07 over ten noisy steps, has an interval from 1.017
    result = analyze(load_trace(RECORDED / "moe-hot-expert-beside-hogs"))
    found = next((f for f in result.diagnosis if f.cause == "expert_imbalance"), None)
    assert found is not None and found.where.ranks == [2] and found.upper_bound, result.diagnosis
    assert found.speedup_if_fixed is not None and found.speedup_if_fixed >= 1.03
