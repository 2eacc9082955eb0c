"""GC pauses inside compute where one op is paused in half its steps: its median over steps
sits halfway to the pauses, so it is measured against what its peers make usual (dp 16 × pp 2,
benchmarks/diagnosis_combinations.py --wide seed 21 job 179, generated as it generates it: an
op on dp 11 pp 1 paused ×3.2 in 4 of 8 steps kept its pauses, which named its worker a
worker_fault ×1.044, and its clean steps made a partner op read as a pause)."""

from stragglers.trace.synth import generate, ground_truth
from stragglers.whatif import analyze

JOB = dict(dp=16, pp=2, seed=1179, noise=0.05, sync="ddp", microbatches=8, steps=8,
           gc_in_compute=(0.9094425911769497, 0.12652765316678533),
           heavy_last_stage=1.3886010422125021)


def test_pauses_of_an_op_paused_in_half_its_steps_are_found():
    trace = generate(**JOB)
    truth = {t.cause: t.impact for t in ground_truth(trace)}
    found = {f.cause: f for f in analyze(trace).diagnosis}
    assert set(found) == {"gc", "stage_imbalance"}, found
    # every pause taken out: the prediction is the true gain, not 6% under it
    assert abs(found["gc"].speedup_if_fixed / truth["gc"] - 1) < 0.02, \
        (found["gc"].speedup_if_fixed, truth["gc"])
