"""A GC pause after a worker's optimizer shares the slot of one before its step tail (a slot
counts forward and backward ops only): led the tail there, the optimizer it ran after replayed
behind it, later than recorded (a rare pause at one honest rank: sim_error 2.1%). It follows
the tail where it ran after it; the measured replay stays exact."""

from __future__ import annotations

import numpy as np
import pytest
from possible_traces import rank0_straggler
from test_spurious_rows_at_honest_ranks import STEPS, _with_row

from stragglers.trace.model import Trace
from stragglers.whatif import analyze_with_model
from stragglers.whatif._replay import replay


@pytest.fixture(scope="module")
def slow_rank0() -> tuple[Trace, float]:
    """dp 2 × pp 2, rank 0 (dp 0, pp 0) computing 3× as long; its S."""
    return rank0_straggler(dp=2, steps=STEPS)


def _replays_exactly(w) -> None:
    g = w.grid
    _, _, end = replay(w.plan, w.cost, w.step_start, w.launch_delay, keep_timeline=True)
    recorded = np.where(g.present, g.start + g.duration, 0.0)
    assert np.allclose(np.where(g.present, end, 0.0), recorded, rtol=0, atol=1e-9), \
        np.abs(np.where(g.present, end, 0.0) - recorded).max()


# rank 1 (dp 1, pp 0), rank 3 (dp 1, pp 1) off the first DP rank; rank 2 (dp 0, pp 1) on it;
# rank 0 the straggler itself
@pytest.mark.parametrize("ranks", [[1], [2], [3], [0], [0, 1, 2, 3]])
def test_a_pause_after_the_optimizer_replays_where_it_was_recorded(slow_rank0, ranks):
    trace, clean = slow_rank0
    for rank in ranks:
        trace = _with_row(trace, rank, "gc", -1, 0)
    result, w = analyze_with_model(trace)
    assert result.sim_error < 1e-12, result.sim_error
    _replays_exactly(w)
    assert abs(result.slowdown / clean - 1) < 0.02, (clean, result.slowdown)
    assert [f.cause for f in result.diagnosis][:1] == ["worker_fault"], result.diagnosis
