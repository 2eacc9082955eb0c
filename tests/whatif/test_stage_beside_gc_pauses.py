"""A heavy stage beside GC pauses inside compute: the stages' shares are measured without the
pauses found (dp 1 × pp 2 × vpp 2, benchmarks/diagnosis_combinations.py --wide --no-seq-lens
seed 28 job 70, generated as it generates it: pauses ×1.5 spread the shares step by step
until a stage ×1.7 heavy was no candidate)."""

from stragglers.trace.synth import generate
from stragglers.whatif import analyze

JOB = dict(dp=1, pp=2, vpp=2, seed=1070, noise=0.05, sync="ddp", microbatches=8, steps=8,
           gc_in_compute=(0.7762645224116136, 0.2680069250058541))


def test_heavy_stage_beside_pauses_is_named():
    found = analyze(generate(**JOB, heavy_last_stage=1.7268247000710115)).diagnosis
    assert {f.cause for f in found} == {"gc", "stage_imbalance"}, found
    assert next(f for f in found if f.cause == "stage_imbalance").where.pp == [1]


def test_pauses_alone_make_no_stage_heavy():
    assert {f.cause for f in analyze(generate(**JOB)).diagnosis} == {"gc"}
