"""A tiny spurious row of one op type at an honest rank (0.1 ms, after its optimizer, every
step) does not move a real straggler's S: it neither switches the dependency model's reading
of the pipeline (a weight-gradient row read as a per-action trace) nor leaves the honest
worker out of the ideal (its one unplaceable row's gap read as its step's). Red team round 13
note: S 1.60 → 1.98."""

from __future__ import annotations

import numpy as np
import pytest
from possible_traces import rank0_straggler

from stragglers.trace.model import OPTYPE_CODES, Trace
from stragglers.whatif import analyze
from stragglers.whatif.dependencies import recorded_per_action
from stragglers.whatif.grid import build_grid
from stragglers.whatif.metrics import IDEAL_LEFT_OUT

STEPS = 8


@pytest.fixture(scope="module")
def straggler() -> tuple[Trace, float]:
    """dp 2 × pp 2, rank 0 (dp 0, pp 0) computing 3× as long, run as a slow worker runs; its S."""
    return rank0_straggler(dp=2, steps=STEPS)


def _with_row(trace: Trace, rank: int, optype: str, mb: int, seq: int) -> Trace:
    """`trace` with a 0.1 ms `optype` row right after each optimizer of `rank`."""
    o = trace.ops
    at = np.flatnonzero((o["optype"] == OPTYPE_CODES["optimizer"]) & (o["rank"] == rank))
    add = {k: v[at].copy() for k, v in o.items()}
    add["optype"][:] = OPTYPE_CODES[optype]
    add["mb_id"][:] = mb
    add["seq_id"][:] = seq
    add["gmc"][:] = add["stage"]
    add["start_ts"] = add["start_ts"] + add["duration"] + 1e-6
    add["duration"] = np.full(len(at), 1e-4)
    merged = {k: np.concatenate([o[k], add[k]]) for k in o}
    order = np.lexsort((merged["start_ts"], merged["step"]))
    return Trace({k: v[order] for k, v in merged.items()}, trace.meta)


# rank 1 is (dp 1, pp 0), rank 3 (dp 1, pp 1): off the first DP rank, which the model is
# built from; rank 2 (dp 0, pp 1) on it
# A rare row's launch delay (its wait on the model's guessed place) still counts: leaving it out
# fixed these cases but broke the replay's exactness on recorded pipeline traces (the replay
# ended recorded ops early: tests/record/replaycheck.py), so it was withdrawn (session 51)
LAUNCH_DELAY = pytest.mark.xfail(strict=True, reason="a rare row's wait on its guessed place "
                                 "still reads as a launch delay (withdrawn: broke exact replay)")


@pytest.mark.parametrize("rank, optype, mb, seq", [
    pytest.param(3, "backward-weight-compute", 0, 0, marks=LAUNCH_DELAY),
    pytest.param(1, "backward-weight-compute", 0, 0, marks=LAUNCH_DELAY),
    pytest.param(3, "forward-compute", 4, 4, marks=LAUNCH_DELAY),
    pytest.param(1, "forward-compute", 4, 4, marks=LAUNCH_DELAY), (2, "forward-compute", 4, 4),
    pytest.param(1, "backward-compute", 4, 4, marks=LAUNCH_DELAY), (3, "optimizer", -1, 1)])
def test_a_tiny_row_at_an_honest_rank_does_not_move_s(straggler, rank, optype, mb, seq):
    trace, clean = straggler
    result = analyze(_with_row(trace, rank, optype, mb, seq))
    assert abs(result.slowdown / clean - 1) < 0.02, (clean, result.slowdown)
    assert not any(IDEAL_LEFT_OUT in w for w in result.warnings), result.warnings
    assert [f.cause for f in result.diagnosis][:1] == ["worker_fault"], result.diagnosis


def test_one_weight_gradient_row_does_not_make_a_per_action_trace(straggler):
    """The transfers' gmc name their own stage (not a per-action recorder's peer): one W row
    does not outvote them."""
    trace, _ = straggler
    grid = build_grid(_with_row(trace, 3, "backward-weight-compute", 0, 0))
    assert not recorded_per_action(grid)
