"""A heavy stage beside a slow worker on it: rebalancing moves the slow worker's layers onto a
healthy device, where they run at its speed, so both causes are named.

The rebalanced costs carried the moved work at the giver's own time: a slow worker's layers
kept its slowness on its DP rank's light stage, which became the straggler once the slow worker
was fixed too, and the heavy stage (×1.8, the slow worker ×2.4 on it) was dropped as explained
by the worker fault (×0.95 once it was fixed; diagnosis_combinations seed 32 jobs 308, 448).
"""

from __future__ import annotations

import pytest

from stragglers.trace.synth import generate
from stragglers.whatif import analyze


def _found(**kwargs) -> dict[str, object]:
    trace = generate(pp=2, microbatches=8, steps=8, seed=7, noise=0.02, **kwargs)
    return {f.cause: f for f in analyze(trace).diagnosis}


@pytest.mark.parametrize("dp", [2, 8])
def test_a_heavy_stage_holding_a_slow_worker_is_named_beside_it(dp):
    found = _found(dp=dp, heavy_last_stage=1.8, slow_worker=(1, 1, 2.4))
    assert set(found) == {"worker_fault", "stage_imbalance"}, found
    assert [(w.dp, w.pp) for w in found["worker_fault"].where.workers] == [(1, 1)]
    assert found["stage_imbalance"].where.pp == [1]


def test_a_slow_worker_on_a_balanced_pipeline_is_no_stage_imbalance():
    found = _found(dp=8, slow_worker=(1, 1, 2.4))
    assert set(found) == {"worker_fault"}, found
