"""A host stall is judged against the step time, so short stalls on short steps are named too."""

from __future__ import annotations

from stragglers.trace.synth import generate
from stragglers.whatif import analyze

from possible_traces import slowed


def test_a_stall_of_a_tenth_of_the_step_among_eight_workers_is_named():
    trace = generate(dp=8, pp=1, microbatches=8, steps=8, seed=4, sync="ddp",
                     host_stall={"dp": 5, "stage": 0, "seconds": 0.05})
    assert trace.meta.extra["ground_truth"][0]["impact"] > 1.08
    top = analyze(trace).diagnosis[0]
    assert top.cause == "host_stall", top
    assert top.where.dp == [5] and top.where.pp == [0]


def test_the_worst_worker_is_listed_first():
    trace = generate(dp=8, pp=1, microbatches=8, steps=8, seed=2, sync="ddp",
                     slow_worker=(6, 0, 2.0))
    # a milder second one (rank 1: dp 1 of a pp 1 job), the job run again with it
    trace = slowed(trace, {1: [1.5] * 8}, ("forward-compute", "backward-compute"))
    top = analyze(trace).diagnosis[0]
    assert top.cause == "worker_fault", top
    assert [w.dp for w in top.where.workers] == [6, 1], top.where
