"""A cause hidden behind others counts once they are fixed; a candidate whose own fix slows
the job is no such other: counted, it made a healthy worker critical and the fix that undid
the harm look like a gain (`diagnosis._after_others`)."""

from __future__ import annotations

import numpy as np

from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.causes import DETECTORS, Candidate, Context
from stragglers.whatif.causes.base import BUSY


def _scaled(ctx: Context, factor: float) -> np.ndarray:
    """The job's costs with worker (dp 1, pp 0)'s busy compute × factor."""
    g = ctx.w.grid
    cost = ctx.w.cost.copy()
    cost[np.isin(g.node_optype, BUSY) & (g.node_stage == 0), 1, :] *= factor
    return cost


def _harm_and_cure(ctx: Context) -> list[Candidate]:
    # "slow_group": a re-split that would make worker (1, 0) half again as slow (its own fix
    # slows the job); "worker_fault": the same worker 1.3× faster, nothing alone (it is no
    # straggler) but ×1.3 once the harm is "fixed" first
    where = ctx.where_workers([(1, 0)])
    return [Candidate("slow_group", where, "harm", cost=_scaled(ctx, 1.5), upper_bound=True),
            Candidate("worker_fault", where, "cure", cost=_scaled(ctx, 1 / 1.3))]


def test_a_fix_that_slows_the_job_lends_no_gain_to_another(monkeypatch):
    trace = generate(dp=4, pp=2, vpp=1, microbatches=4, steps=8, seed=3, noise=0.01,
                     sync="zero")
    assert [f.cause for f in analyze(trace).diagnosis] == ["none"]
    monkeypatch.setitem(DETECTORS, "harm_and_cure", _harm_and_cure)
    assert [f.cause for f in analyze(trace).diagnosis] == ["none"]
