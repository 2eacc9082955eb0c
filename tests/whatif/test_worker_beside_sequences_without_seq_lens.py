"""A slow worker beside sequence imbalance on a trace without Σs² (no attn_cost/tokens): a DP
rank's load, the same on all its stages, is taken out before the worker is compared with its
peers (benchmarks/diagnosis_combinations.py --wide --no-seq-lens seed 22 job 133 and seed 26
job 62, seed 29 job 28, generated as it generates them: the slow worker stood 3.9-5.8 robust
deviations out among workers whose ratios the ranks' loads spread, under outlier_z, and went
unnamed; of two DP ranks, a rank ×1.21 everywhere beside its peer hid one ×2.1)."""

import pytest

from stragglers.trace.synth import generate
from stragglers.whatif import analyze

JOBS = [
    (dict(dp=4, pp=4, seed=1133, noise=0.02, sync="zero"), (3, 3, 1.9458053369527475)),
    (dict(dp=4, pp=4, seed=1062, noise=0.05, sync="ddp"), (3, 2, 1.7205509778072514)),
    # two DP ranks: the rank's load over the run from the median over three other stages
    (dict(dp=2, pp=4, seed=1028, noise=0.02, sync="zero"), (0, 2, 2.109389940604489)),
    # two DP ranks, two stages: no load taken out (a slow worker would move the rank's)
    (dict(dp=2, pp=2, seed=1015, noise=0.05, sync="ddp"), (1, 1, 2.2218268813488806)),
    (dict(dp=2, pp=2, seed=1088, noise=0.02, sync="ddp"), (0, 1, 2.013402468569074)),
]


def _without_seq_lens(job: dict, **causes):
    trace = generate(**job, microbatches=8, steps=8, seq_imbalance={"dist": "lognormal"},
                     **causes)
    for column in ("attn_cost", "tokens"):
        trace.ops.pop(column, None)
    return trace


@pytest.mark.parametrize("job,slow", JOBS)
def test_slow_worker_beside_sequences_is_named_where_it_sits(job, slow):
    found = analyze(_without_seq_lens(job, slow_worker=slow)).diagnosis
    assert {f.cause for f in found} == {"sequence_imbalance", "worker_fault"}, found
    fault = next(f for f in found if f.cause == "worker_fault")
    assert [(x.dp, x.pp) for x in fault.where.workers] == [slow[:2]]


@pytest.mark.parametrize("job,slow", JOBS)
def test_sequences_alone_name_no_worker(job, slow):
    # the same jobs without the slow worker: the ranks' loads are no slow worker
    found = {f.cause for f in analyze(_without_seq_lens(job)).diagnosis}
    assert found == {"sequence_imbalance"}, found
