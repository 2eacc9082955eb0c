"""GC pauses inside compute where two of a few pauses fall on one microbatch's forward and
backward: that microbatch's shared factor stands out among all microbatches' as a pause does
among ops, so the two are no sequences binding them (dp 1 × pp 1,
benchmarks/diagnosis_combinations.py --wide seed 9 job 162, generated as it generates it:
2 of its 3 pauses counted as microbatch-bound, the pattern read as sequence imbalance and
GC ×1.10 was missed)."""

from stragglers.trace.synth import generate, ground_truth
from stragglers.whatif import analyze

JOB = dict(dp=1, pp=1, seed=1162, noise=0.05, sync="ddp", microbatches=8, steps=8,
           host_stall={"dp": 0, "stage": 0, "seconds": 0.12376762062361263})


def test_pauses_sharing_a_microbatch_are_found():
    trace = generate(**JOB, gc_in_compute=(0.3828066816141042, 0.12713736692599614))
    truth = {t.cause: t.impact for t in ground_truth(trace)}
    found = {f.cause: f for f in analyze(trace).diagnosis}
    assert set(found) == {"gc"}, found
    assert abs(found["gc"].speedup_if_fixed / truth["gc"] - 1) < 0.02


def test_sequences_alone_are_still_sequences():
    # the same job with uneven microbatches and no pauses: every microbatch's factor differs,
    # none stands out, and the pattern is the sequences'
    trace = generate(**JOB, seq_imbalance={"dist": "lognormal"})
    assert "gc" not in {f.cause for f in analyze(trace).diagnosis}
