"""The dependency model reads each stage's op order from a replica-step that most of the
stage's replica-steps agree with, not from the first DP replica whatever it holds: a first
replica whose rank numbers two microbatches the other way round (its seq_ids lie) made
cyclic dependencies, or read a 3x straggler's S 1.60 as 1.47 (session 51 note: the model is
built from the first DP replica's rows)."""

from __future__ import annotations

import pytest
from possible_traces import lying, rank0_straggler

from stragglers.trace.model import Trace
from stragglers.whatif import analyze
from stragglers.whatif.dependencies import reference_cells
from stragglers.whatif.grid import build_grid

STEPS = 8


@pytest.fixture(scope="module")
def slow_backward() -> dict[int, tuple[Trace, float]]:
    """dp → (dp × pp 2 job, rank 0 (dp 0, pp 0) computing its backward 3× as long; its S)."""
    return {dp: rank0_straggler(dp, STEPS, ("backward-compute",)) for dp in (2, 3)}


@pytest.mark.parametrize("optype, order", [
    ("forward-compute", "swap"), ("forward-compute", "reverse"), ("backward-compute", "swap")])
def test_a_first_replica_numbering_its_microbatches_otherwise_does_not_define_the_model(
        slow_backward, optype, order):
    trace, clean = slow_backward[3]
    result = analyze(lying(trace, 0, optype, order))
    assert abs(result.slowdown / clean - 1) < 0.02, (clean, result.slowdown)
    # (the lying rank's rows out of the model's order read as its host's stall too, as they
    # do at any replica: every finding names it, its compute among them)
    assert ("worker_fault", [0]) in [(f.cause, f.where.ranks) for f in result.diagnosis]
    assert {r for f in result.diagnosis for r in f.where.ranks} == {0}, result.diagnosis


def test_the_reference_is_a_replica_step_most_agree_with(slow_backward):
    trace, _ = slow_backward[3]
    assert reference_cells(build_grid(trace))[0].tolist() == [0, 0]   # honest: the first
    d_ref, _ = reference_cells(build_grid(lying(trace, 0, "forward-compute", "swap")))
    assert d_ref[0] != 0 and d_ref[1] == 0      # stage 0's from another replica, stage 1's kept


def test_with_two_replicas_nothing_says_which_is_right_and_the_first_stays(slow_backward):
    trace, _ = slow_backward[2]
    d_ref, _ = reference_cells(build_grid(lying(trace, 0, "forward-compute", "swap")))
    assert d_ref.tolist() == [0, 0]
