"""A collective some workers of a stage ran and others not (a profiler that lost its rows, one
no peer ran) is rebuilt at the workers that lack it, from its group's ends, or left out at
every worker of the stage: every worker analysed (red team round 12: leaving the odd worker's
replica out hid the 3x straggler beside it; a lone stage of two workers was an error)."""

from __future__ import annotations

import sys

import numpy as np

from conftest import REPO
from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.rebuild import rebuild_lost

sys.path.insert(0, str(REPO / "tests" / "whatif"))
from test_whatif_odd_op_sets import with_extra, without  # noqa: E402


def lone(slow=(0, 0, 3.0), seed: int = 0):
    """dp 2 × pp 1, rank 0 3x slow (None: healthy)."""
    return generate(dp=2, pp=1, microbatches=4, steps=8, seed=seed, slow_worker=slow)


def causes(r) -> list[tuple]:
    return [(f.cause, [(w.dp, w.pp) for w in f.where.workers]) for f in r.diagnosis]


def test_the_wait_in_a_lost_collective_stays_a_wait_not_a_host_stall():
    # rank 1 (healthy) waits ~0.48 s a step for the straggler in grads-reduce-scatter, whose
    # rows it lost. Left out at both workers, that wait was the gap before its optimizer, a
    # launch delay: `host_stall` named the healthy rank 1 beside the worker fault (x2.7).
    # Rebuilt there, the job reads as the whole trace reads it
    for rank in (0, 1):
        r = analyze(without(lone(), rank, "grads-reduce-scatter"), steps="all")
        whole = analyze(lone(), steps="all")
        assert r.left_out == [] and r.slowdown > 1.15
        assert abs(r.slowdown - whole.slowdown) < 1e-3, (r.slowdown, whole.slowdown)
        assert causes(r) == causes(whole) == [("worker_fault", [(0, 0)])], causes(r)


def test_a_healthy_job_missing_a_collective_reads_healthy():
    # no false straggler: a healthy job whose one rank lost a collective, or ran one more
    for seed in range(3):
        for trace in (without(lone(None, seed), 1, "grads-reduce-scatter"),
                      with_extra(lone(None, seed), 1, "all-reduce"),
                      without(generate(dp=2, pp=2, microbatches=4, steps=8, seed=seed), 2,
                              "grads-reduce-scatter")):
            r = analyze(trace, steps="all")
            assert r.left_out == [] and r.slowdown < 1.1 and r.straggling is False, (
                seed, r.slowdown, r.warnings)
            assert causes(r) == [("none", [])], causes(r)


def test_an_op_that_does_not_fit_the_workers_own_ops_is_not_rebuilt():
    # one stage of two workers, one op (node 1) at worker 0 only, between its ops 0 and 2;
    # worker 1's op 2 starts before worker 0's op 1 ends: no all-reduce they shared (an
    # extra, or one run beside compute), so it is not rebuilt (the caller leaves it out)
    start = np.array([[[0.0], [0.0]], [[1.0], [np.nan]], [[2.0], [1.2]]])
    duration = np.array([[[1.0], [1.0]], [[0.5], [0.0]], [[1.0], [1.0]]])
    present = ~np.isnan(start)
    row = np.where(present, 0, -1)
    stage = np.zeros(3, np.int32)
    lost = np.array([False, True, False])
    code = np.full(3, OPTYPE_CODES["all-reduce"], np.int8)
    got = rebuild_lost(start.copy(), duration.copy(), row.copy(), present.copy(), stage, code,
                       np.arange(3), lost, np.ones(1, bool))
    assert not got.any()
    # ... where it fits (worker 1's op 2 starts after it), it is rebuilt: begun when worker
    # 1's op 0 ended, ending with worker 0's
    start[2, 1, 0] = 1.6
    s, d, p = start.copy(), duration.copy(), present.copy()
    assert rebuild_lost(s, d, row.copy(), p, stage, code, np.arange(3), lost,
                        np.ones(1, bool)).tolist() == \
        [False, True, False]
    assert p[1, 1, 0] and (s[1, 1, 0], d[1, 1, 0]) == (1.0, 0.5)


def test_a_cross_stage_collective_lost_is_rebuilt_from_its_own_group():
    # 2 x 2, rank 0 3x slow: a worker lost its embedding all-reduce (a DP rank's first and last
    # stage end it together) or its clip (every worker): left out at both stages, the wait of
    # the straggler's pipeline peer in it became a launch delay and `host_stall` named that
    # healthy worker; rebuilt from the group's ends, the job reads as the whole trace
    whole = analyze(generate(dp=2, pp=2, microbatches=4, steps=6, seed=0,
                             slow_worker=(0, 0, 3.0)), steps="all")
    for optype in ("embedding-grads-all-reduce", "optimizer-clip-main-grad"):
        for rank in (0, 2):
            r = analyze(without(generate(dp=2, pp=2, microbatches=4, steps=6, seed=0,
                                         slow_worker=(0, 0, 3.0)), rank, optype), steps="all")
            assert "Rebuilt" in r.warnings[0] and "Left out" not in r.warnings[0], r.warnings
            assert abs(r.slowdown - whole.slowdown) < 1e-3
            assert causes(r) == causes(whole) == [("worker_fault", [(0, 0)])], causes(r)
