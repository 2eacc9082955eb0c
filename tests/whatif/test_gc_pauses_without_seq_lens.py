"""GC pauses inside compute on a trace without Σs² (no attn_cost/tokens columns) whose
microbatches differ in length: the microbatches' shared factor is not taken for noise
(benchmarks/diagnosis_combinations.py --wide --no-seq-lens seed 9 job 28 and seed 10 job 114,
generated as it generates them)."""

import pytest

from stragglers.trace.synth import generate, ground_truth
from stragglers.whatif import analyze

JOBS = [
    (dict(dp=4, pp=1, seed=1028, noise=0.05), (0.26051909087951874, 0.2504400429119587)),
    (dict(dp=2, pp=2, seed=1114, noise=0.05), (0.7314131374719814, 0.08969129890794149)),
]


def _without_seq_lens(job: dict, **causes):
    trace = generate(**job, microbatches=8, steps=8, sync="ddp",
                     seq_imbalance={"dist": "lognormal"}, **causes)
    for column in ("attn_cost", "tokens"):
        trace.ops.pop(column)
    return trace


@pytest.mark.parametrize("job,gc", JOBS)
def test_pauses_among_uneven_microbatches_are_gc(job, gc):
    # the spread of microbatch lengths set the pause bar at x18.5 (job 28): 1 of about 10
    # pauses stood out and the job read as unexplained, or as nothing
    trace = _without_seq_lens(job, gc_in_compute=gc)
    truth = {t.cause: t.impact for t in ground_truth(trace)}
    found = {f.cause: f for f in analyze(trace).diagnosis}
    assert "gc" in found, found
    assert abs(found["gc"].speedup_if_fixed / truth["gc"] - 1) < 0.03, (found, truth)


@pytest.mark.parametrize("job,gc", JOBS)
def test_uneven_microbatches_alone_are_no_gc(job, gc):
    # the same jobs without pauses: a microbatch's length is shared by its ops, no pause
    found = [f.cause for f in analyze(_without_seq_lens(job)).diagnosis]
    assert "gc" not in found, found
