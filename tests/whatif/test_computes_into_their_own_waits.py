"""A compute stated longer into time its own worker spent waiting on an op launched after it
(a receive or collective the model orders after it, its next step's first op) is cut there
(timing.clip_to_own_timeline): the worker was waiting, not computing."""

from __future__ import annotations

import numpy as np
import pytest
from possible_traces import slowed

from stragglers.trace.model import OPTYPE_CODES, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze

COMPUTE = [OPTYPE_CODES[o] for o in ("forward-compute", "backward-compute", "optimizer")]
STEPS = 8


def _longer(trace: Trace, rank: int, optypes: list[int]) -> Trace:
    """`rank`'s rows of `optypes` stated ×3, starts kept."""
    ops = {k: v.copy() for k, v in trace.ops.items()}
    hit = (ops["rank"] == rank) & np.isin(ops["optype"], optypes)
    ops["duration"] = np.where(hit, ops["duration"] * 3, ops["duration"])
    return Trace(ops, trace.meta)


def test_computes_three_times_long_read_as_the_healthy_job():
    """Rank 3 (dp 1, pp 1) of a healthy job (S 1.007) states every compute ×3: cut at its next
    compute and sends only, its optimizer ran on into the next step's wait for its first
    receive, S 1.05. Cut there too, S is the healthy job's but for the last step (which no
    next step bounds)."""
    healthy = generate(dp=2, pp=2, microbatches=4, steps=STEPS, seed=0)
    result = analyze(_longer(healthy, 3, COMPUTE))
    assert result.slowdown < 1.02, result.slowdown
    assert [f.cause for f in result.diagnosis] == ["none"], result.diagnosis
    assert any("running into their rank's next step" in w for w in result.warnings), \
        result.warnings


@pytest.mark.parametrize("rank", [1, 2])     # (dp 1, pp 0) and (dp 0, pp 1)
def test_a_backward_stated_into_its_ranks_receive_wait_does_not_hide_the_straggler(rank):
    """Rank 0 computes ×2 (S 1.334); an honest rank states its backwards ×3, each into the
    time it then waited on the receive (or gradient collective) it launched after it: read
    up to the next compute, the honest rank took the straggler's wait as its own work and S
    read 1.236 (rank 1), 1.109 and a stage imbalance (rank 2)."""
    trace = slowed(generate(dp=2, pp=2, microbatches=4, steps=STEPS, seed=0),
                   {0: [2.0] * STEPS})
    clean = analyze(trace).slowdown
    result = analyze(_longer(trace, rank, [OPTYPE_CODES["backward-compute"]]))
    assert abs(result.slowdown / clean - 1) < 0.01, (clean, result.slowdown)
    named = [(f.cause, f.where.ranks) for f in result.diagnosis
             if f.cause in ("worker_fault", "stage_imbalance")]
    assert named == [("worker_fault", [0])], result.diagnosis
