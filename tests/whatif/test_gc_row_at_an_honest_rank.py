"""A spurious GC pause row right after the optimizer at an honest rank (every step, a slot
most replica-steps lack, placed by the model after the last backward) does not move a real
straggler's S nor leave that honest worker out of the ideal (S 1.60 → 1.44 before)."""

from __future__ import annotations

import pytest
from possible_traces import rank0_straggler
from test_spurious_rows_at_honest_ranks import STEPS, _with_row

from stragglers.trace.model import Trace
from stragglers.whatif import analyze
from stragglers.whatif.metrics import IDEAL_LEFT_OUT


@pytest.fixture(scope="module")
def slow_rank0() -> tuple[Trace, float]:
    """dp 2 × pp 2, rank 0 (dp 0, pp 0) computing 3× as long; its S."""
    return rank0_straggler(dp=2, steps=STEPS)


# rank 1 (dp 1, pp 0) and rank 3 (dp 1, pp 1) are off the first DP rank the model is built
# from; rank 2 (dp 0, pp 1) on it
@pytest.mark.parametrize("rank", [1, 2, 3])
def test_a_gc_row_after_an_honest_optimizer_does_not_move_s(slow_rank0, rank):
    trace, clean = slow_rank0
    result = analyze(_with_row(trace, rank, "gc", -1, 0))
    assert abs(result.slowdown / clean - 1) < 0.02, (clean, result.slowdown)
    assert not any(IDEAL_LEFT_OUT in w for w in result.warnings), result.warnings
    causes = [f.cause for f in result.diagnosis]
    assert causes[:1] == ["worker_fault"], result.diagnosis
    # nor is the honest worker named stalled for its row's wait on its guessed place
    assert "host_stall" not in causes, result.diagnosis
