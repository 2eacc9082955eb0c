"""A two-rank data-parallel job with one rank's durations written /1000 (a units slip): no
majority says which rank is right, but the collectives they share make the slipped rank's
step as long as its peer's, which its recorded computes cannot explain: it is left out of the
ideal (metrics.unexplained), not its honest peer read ×2 slow."""

from __future__ import annotations

import numpy as np
import pytest

from stragglers.trace.model import Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.metrics import IDEAL_LEFT_OUT


def _slipped(trace: Trace, rank: int) -> Trace:
    ops = {k: v.copy() for k, v in trace.ops.items()}
    ops["duration"] = np.where(ops["rank"] == rank, ops["duration"] / 1000, ops["duration"])
    return Trace(ops, trace.meta)


# the delays every worker has (host time between steps, launches, noise) made the slipped
# rank's gaps cost the job 7-29% replayed alone: read as waited on, S 2.0 and worker_fault
@pytest.mark.parametrize("rank, job", [(1, dict(step_gap=0.02)), (0, dict(launch_delay=1e-3)),
                                       (1, dict(noise=0.1, sync="ddp"))])
def test_a_units_slip_at_one_of_two_ranks_is_no_straggler(rank, job):
    trace = generate(dp=2, pp=1, microbatches=1, steps=10, seed=0, **job)
    result = analyze(_slipped(trace, rank))
    assert result.slowdown < 1.1 and not result.straggling, result.slowdown
    # (the slipped rank's all-reduce rows /1000 too: its honest peer's may read as a minor
    # communication cause, labelled below the threshold)
    assert all(f.cause == "none" or f.below_threshold for f in result.diagnosis), \
        result.diagnosis
    assert "worker_fault" not in [f.cause for f in result.diagnosis], result.diagnosis
    said = [w for w in result.warnings if IDEAL_LEFT_OUT in w]
    assert len(said) == 1 and said[0].startswith(f"computes of worker (dp {rank}, pp 0)"), \
        result.warnings


def test_a_real_host_stall_at_one_of_two_ranks_is_still_found():
    """The contrast: a 0.2 s stall at rank 1 (its computes as long as its peer's, its gaps
    waited on: 2.6× the step) keeps every worker in the ideal and is named."""
    result = analyze(generate(dp=2, pp=1, microbatches=1, steps=10, seed=0, step_gap=0.02,
                              host_stall={"dp": 1, "stage": 0, "seconds": 0.2}))
    assert not any(IDEAL_LEFT_OUT in w for w in result.warnings), result.warnings
    assert [f.cause for f in result.diagnosis] == ["host_stall"], result.diagnosis
