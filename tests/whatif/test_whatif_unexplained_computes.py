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
