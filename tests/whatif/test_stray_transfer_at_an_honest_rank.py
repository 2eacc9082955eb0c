"""A stray pipeline transfer row (0.1 ms, after the optimizer, every step, with a seq_id no
peer ran and no other end) at an honest rank beside a real straggler is left out at every
worker with a warning naming it; the honest worker stays in the ideal and S stays the job's
(S 1.60 → 1.208 or 1.001 before: its replica was left out as an odd worker). A transfer the
profiler lost at one rank (its other end ran it) still leaves that replica out."""

from __future__ import annotations

import numpy as np
import pytest
from possible_traces import rank0_straggler
from test_spurious_rows_at_honest_ranks import STEPS, _with_row

from stragglers.trace.model import OPTYPE_CODES, Trace
from stragglers.trace.runformat import write_run
from stragglers.whatif import analyze
from stragglers.whatif.grid import OPS_LEFT_OUT
from stragglers.whatif.metrics import IDEAL_LEFT_OUT
from stragglers.whatif.partitioned import analyze_run


@pytest.fixture(scope="module")
def slow_rank0() -> tuple[Trace, float]:
    """dp 2 × pp 2, rank 0 (dp 0, pp 0) computing 3× as long; its S."""
    return rank0_straggler(dp=2, steps=STEPS)


# rank 1 (dp 1, pp 0) and 3 (dp 1, pp 1) beside the straggler's peers; rank 2 (dp 0, pp 1)
# on the straggler's DP replica; seq 4 is no microbatch of the schedule (0-3); a forward-send
# at the last stage and a backward-send at the first have no stage to go to
@pytest.mark.parametrize("rank, optype", [
    (1, "forward-send"), (3, "forward-recv"), (1, "backward-recv"), (3, "backward-send"),
    (2, "forward-recv"), (2, "backward-send"), (2, "forward-send"), (1, "backward-send")])
def test_a_stray_transfer_at_an_honest_rank_is_left_out_alone(slow_rank0, rank, optype):
    trace, clean = slow_rank0
    result = analyze(_with_row(trace, rank, optype, 4, 4))
    assert abs(result.slowdown / clean - 1) < 0.02, (clean, result.slowdown)
    assert not result.left_out, result.left_out
    assert not any(IDEAL_LEFT_OUT in w for w in result.warnings), result.warnings
    assert result.warnings[0].startswith(OPS_LEFT_OUT) and f"{optype} #4" in result.warnings[0]
    assert [f.cause for f in result.diagnosis][:1] == ["worker_fault"], result.diagnosis


@pytest.fixture(scope="module")
def three_replicas() -> tuple[Trace, float]:
    """dp 3 × pp 2 (ranks 0-2 at stage 0, 3-5 at stage 1), rank 0 computing 3× as long; its S."""
    return rank0_straggler(dp=3, steps=STEPS)


@pytest.mark.parametrize("rows", [
    [(1, "forward-send")], [(5, "backward-send")],
    # a stray pair, both ends at DP rank 1: a majority at each stage lacks it
    [(1, "forward-send"), (4, "forward-recv")], [(2, "backward-recv"), (5, "backward-send")]])
def test_stray_transfers_among_three_replicas_are_left_out_alone(three_replicas, rows):
    trace, clean = three_replicas
    for rank, optype in rows:
        trace = _with_row(trace, rank, optype, 4, 4)
    result = analyze(trace)
    assert abs(result.slowdown / clean - 1) < 0.02, (clean, result.slowdown)
    assert not result.left_out, result.left_out
    assert result.warnings[0].startswith(OPS_LEFT_OUT), result.warnings[0]


@pytest.mark.parametrize("job, rank, optype", [
    ("slow_rank0", 1, "forward-send"), ("slow_rank0", 3, "backward-send"),
    ("three_replicas", 4, "forward-recv")])
def test_a_transfer_lost_at_one_rank_still_leaves_its_replica_out(request, job, rank, optype):
    """`rank`'s `optype` #2 dropped in every step (its other end ran it): it is odd."""
    trace, _ = request.getfixturevalue(job)
    o = trace.ops
    lost = (o["rank"] == rank) & (o["optype"] == OPTYPE_CODES[optype]) & (o["seq_id"] == 2)
    result = analyze(trace.select(~lost))
    odd = [(w.dp, w.pp) for w in result.left_out if w.reason != "replica"]
    assert odd == [(int(o["dp_rank"][lost][0]), int(o["stage"][lost][0]))], result.left_out
    assert not result.warnings[0].startswith(OPS_LEFT_OUT), result.warnings[0]
    assert np.isfinite(result.slowdown)


def test_a_run_directory_read_by_partitions_leaves_the_stray_out_the_same(slow_rank0, tmp_path):
    trace = _with_row(slow_rank0[0], 1, "forward-send", 4, 4)
    write_run(tmp_path / "run", trace)
    whole = analyze(trace)
    for partitions in (1, 3):
        r = analyze_run(tmp_path / "run", partitions=partitions)[0]
        assert not r.left_out and r.slowdown == whole.slowdown
        assert r.warnings[0] == whole.warnings[0]
