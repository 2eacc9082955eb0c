"""A worker whose stated computes cannot be its work (its step mostly launch delay that nobody
waits on) is left out of the ideal (metrics.unexplained): red team round 13, finding 1."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import REPO
from stragglers.trace.model import OPTYPE_CODES, Trace
from stragglers.trace.runformat import read_run, write_run
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.partitioned import analyze_run

sys.path.insert(0, str(REPO / "tests" / "whatif"))
from same_results import assert_same  # noqa: E402

COMPUTE = [OPTYPE_CODES[o] for o in ("forward-compute", "backward-compute", "optimizer")]
JOB = dict(dp=2, pp=2, microbatches=4, steps=8, seed=0)
LEFT = "computes of worker (dp 1, pp 1) left out of the ideal"


def _left(result) -> list[str]:
    return [w for w in result.warnings if "left out of the ideal" in w]


def _rank3_computes(trace: Trace, scale: float) -> Trace:
    """Rank 3's (dp 1, pp 1) compute durations × scale, its starts and everything else kept."""
    ops = {k: v.copy() for k, v in trace.ops.items()}
    hit = (ops["rank"] == 3) & np.isin(ops["optype"], COMPUTE)
    ops["duration"] = np.where(hit, ops["duration"] * scale, ops["duration"])
    return Trace(ops, trace.meta)


@pytest.mark.parametrize("scale", [0.0, 1 / 3])
def test_a_rank_whose_computes_are_timed_short_sets_no_ideal(scale):
    """Rank 3 of a healthy job writes its computes at 0 (or a third): at face value S 1.32
    (1.20), its honest stage peer rank 2 read slow against it. Its step is mostly launch
    delay (124%, 83%) that costs the job 0.3% replayed: left out of the ideal, S is the
    healthy job's (1.005) and the warning names it."""
    result = analyze(_rank3_computes(generate(**JOB), scale))
    assert result.slowdown < 1.02 and result.straggling is False, result.slowdown
    assert len(_left(result)) == 1 and _left(result)[0].startswith(LEFT), result.warnings


def test_a_real_host_stall_and_a_healthy_job_keep_every_worker_in_the_ideal():
    """The contrast: a real 0.2 s host stall at the same worker (its delays 80% of the step,
    waited on: ×1.56 launch slowdown) and the healthy job leave every compute in the ideal,
    and the stall is still found."""
    stall = analyze(generate(**JOB, host_stall={"dp": 1, "stage": 1, "seconds": 0.2}))
    assert not _left(stall) and stall.launch_slowdown > 1.5, stall.warnings
    assert [f.cause for f in stall.diagnosis] == ["host_stall"], stall.diagnosis
    healthy = analyze(generate(**JOB))
    assert not _left(healthy) and healthy.slowdown < 1.02, healthy.warnings


def test_a_run_directory_leaves_the_same_worker_out(tmp_path):
    """Read in step partitions, the run leaves out the same worker with the same numbers."""
    trace = _rank3_computes(generate(**JOB), 0.0)
    whole = analyze(read_run(write_run(tmp_path / "run", trace)))
    assert _left(whole), whole.warnings
    for partitions in (1, 3):
        assert_same(whole, analyze_run(tmp_path / "run", partitions=partitions)[0])


def _named(result) -> list[tuple[str, int, int]]:
    """(cause, dp, pp) of every worker a finding names."""
    return [(f.cause, w.dp, w.pp) for f in result.diagnosis for w in f.where.workers]


@pytest.mark.parametrize("scale", [0.0, 1 / 3])
def test_no_cause_reads_the_left_out_computes(scale):
    """The diagnosis reads the left-out worker's computes as its stage peers': its honest
    peer rank 2 is no worker fault (×2.5e11 its zeros), its gaps no host stall (×2.04),
    stage 1 no light stage (0% of the work: stage_imbalance); the job is healthy."""
    result = analyze(_rank3_computes(generate(**JOB), scale))
    assert [f.cause for f in result.diagnosis] == ["none"], _named(result)


WIDE = dict(dp=4, pp=2, microbatches=4, steps=8, seed=0)   # rank 3: (dp 3, pp 0)


def test_the_other_workers_causes_are_still_found_beside_a_left_out_worker():
    """Beside a worker left out (rank 3 at 0 s) a real slow worker (dp 0, pp 1, ×1.5) is
    found alone (its zeros made every microbatch of its DP rank's other stage read
    load-free, and that honest worker ×2.7e10 slow), and a real host stall (dp 2, pp 1)
    is found without naming the left-out worker for its gaps."""
    slow = analyze(_rank3_computes(generate(**WIDE, slow_worker=(0, 1, 1.5)), 0.0))
    assert any(w.startswith("computes of worker (dp 3, pp 0)") for w in slow.warnings)
    assert _named(slow) == [("worker_fault", 0, 1)], (_named(slow), slow.diagnosis)
    stall = analyze(_rank3_computes(
        generate(**WIDE, host_stall={"dp": 2, "stage": 1, "seconds": 0.2}), 0.0))
    assert _named(stall) == [("host_stall", 2, 1)], _named(stall)


def test_a_run_directory_diagnoses_the_same_beside_a_left_out_worker(tmp_path):
    """Read in step partitions, the diagnosis beside a left-out worker is the same."""
    trace = _rank3_computes(generate(**WIDE, slow_worker=(0, 1, 1.5)), 0.0)
    whole = analyze(read_run(write_run(tmp_path / "run", trace)))
    assert _named(whole) == [("worker_fault", 0, 1)], _named(whole)
    for partitions in (1, 3):
        assert_same(whole, analyze_run(tmp_path / "run", partitions=partitions)[0])
