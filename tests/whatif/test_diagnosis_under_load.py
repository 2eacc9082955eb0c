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


def test_clean_tensor_parallel_runs_on_one_cpu_beside_load_are_none():
    # dp 2 × tp 2, every rank on one CPU that other work shared: the all-reduces were late on
    # every rank at once in 2-4 of 9 steps, their threads waiting for that CPU, and the job was
    # called STRAGGLING with `cpu_contention` of the whole job (×1.05) although its S (1.28,
    # 1.32) was below what its own jitter gives (noise floor 1.32, 1.40): a time at no place
    # -2: its rank 1 computed ×1.19 its peers' median (lower end ×1.067), behind them in 7 of 9
    # steps: a steady slow worker among 2-4 needs to be behind in every step (a plain 5% margin,
    # or a sign test at 5%, would name this clean rank)
    for run in ("tp-clean-one-cpu-under-load-0", "tp-clean-one-cpu-under-load-1",
                "tp-clean-one-cpu-under-load-2"):
        result = analyze(load_trace(RECORDED / run))
        assert [f.cause for f in result.diagnosis] == ["none"], (run, result.diagnosis)
        assert result.straggling is False
