"""A stray pipeline transfer mid-step whose rank numbers its later transfers on after it (each
seq_id one more) is left out alone: the later ones are realigned with their other ends
(whatif/realign.py), not paired one microbatch off (session 51 note: S and the top cause
right, a spurious second finding in 2 of 5 cases: `communication` or `host_stall`)."""

from __future__ import annotations

import pytest
from possible_traces import rank0_straggler, renumbered

from stragglers.errors import InputError
from stragglers.trace.model import Trace
from stragglers.trace.runformat import write_run
from stragglers.whatif import analyze
from stragglers.whatif.grid import OPS_LEFT_OUT
from stragglers.whatif.partitioned import analyze_run

STEPS = 8


@pytest.fixture(scope="module")
def straggler() -> dict[int, tuple[Trace, float]]:
    """dp → (dp × pp 2 job, rank 0 (dp 0, pp 0) computing 3× as long; its S)."""
    return {dp: rank0_straggler(dp, STEPS) for dp in (2, 3)}


# dp 2: rank 1 (dp 1, pp 0), rank 3 (dp 1, pp 1), rank 2 (dp 0, pp 1); dp 3: rank 4 (dp 1, pp 1)
@pytest.mark.parametrize("dp, rank, optype", [
    (2, 1, "forward-send"), (2, 3, "forward-recv"), (2, 1, "backward-recv"),
    (2, 3, "backward-send"), (2, 2, "forward-recv"), (3, 4, "backward-send")])
def test_a_renumbering_stray_transfer_is_left_out_alone(straggler, dp, rank, optype):
    trace, clean = straggler[dp]
    result = analyze(renumbered(trace, rank, optype))
    assert abs(result.slowdown / clean - 1) < 0.02, (clean, result.slowdown)
    assert not result.left_out, result.left_out
    assert result.warnings[0].startswith(OPS_LEFT_OUT) and f"{optype} #4" in result.warnings[0]
    assert [f.cause for f in result.diagnosis] == ["worker_fault"], result.diagnosis


def test_a_renumbered_stray_pair_at_one_of_two_replicas_is_still_the_disagree_error(straggler):
    # both ends at DP rank 1: a stray pair, each end agreeing with the other, and with two
    # replicas nothing says which replica ran the schedule's transfers
    trace = renumbered(renumbered(straggler[2][0], 1, "forward-send"), 3, "forward-recv")
    with pytest.raises(InputError, match=r"disagree on forward-\w+ #4, forward-\w+ #4 \(some "
                       r"ran it, some not\).* each may be"):
        analyze(trace)


def test_a_run_directory_read_by_partitions_realigns_the_same(straggler, tmp_path):
    trace = renumbered(straggler[2][0], 3, "backward-send")
    write_run(tmp_path / "run", trace)
    whole = analyze(trace)
    for partitions in (1, 3):
        r = analyze_run(tmp_path / "run", partitions=partitions)[0]
        assert r.slowdown == whole.slowdown and r.warnings[0] == whole.warnings[0]
        assert [f.cause for f in r.diagnosis] == ["worker_fault"], r.diagnosis
