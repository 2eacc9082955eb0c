"""One microbatch of a step far longer than a worker's others is no slow worker.

diagnosis_combinations --wide --no-seq-lens seed 1 job 6 (dp 64 × pp 1, generated as it
generates it): GC pauses inside compute, and on rank 14 one microbatch's forward and backward
both paused in steps 1 and 6. The pause test reads a microbatch lengthened on both its ops as
long sequences (they scale both), so those pauses stayed, and rank 14 was named worker_fault
×1.06 "in steps 1, 6". A slow device stretches every microbatch it computes: judged with each
step's longest microbatch at its median one, rank 14 is as fast as its peers.
"""

from __future__ import annotations

import pytest

from stragglers.trace.synth import generate
from stragglers.whatif import analyze

JOB = dict(dp=64, pp=1, vpp=1, microbatches=8, steps=8, seed=1006, noise=0.05, sync="ddp",
           seq_imbalance={"dist": "uniform"},
           gc_in_compute=(0.6087111075732264, 0.2382575519255445))


def _found(**extra) -> dict:
    trace = generate(**JOB, **extra)
    for column in ("attn_cost", "tokens"):      # as NDTimeline and profiler traces come
        trace.ops.pop(column, None)
    return {f.cause: f for f in analyze(trace).diagnosis}


@pytest.mark.slow
def test_a_microbatch_paused_on_both_its_ops_names_no_worker():
    found = _found()
    assert "worker_fault" not in found, found["worker_fault"].evidence
    assert "gc" in found


@pytest.mark.slow
def test_a_slow_worker_among_the_same_pauses_is_still_named():
    found = _found(slow_worker=(14, 0, 1.3))
    assert [(w.dp, w.pp) for w in found["worker_fault"].where.workers] == [(14, 0)]
