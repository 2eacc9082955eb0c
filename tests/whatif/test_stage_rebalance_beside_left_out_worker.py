"""The stage-imbalance fix is priced without a worker left out of the ideal (its computes
timed shorter than its work, metrics.IDEAL_LEFT_OUT): the work moved and the devices' speeds
are read at its stage peers' (causes/stage.rebalanced_costs), not from its stated costs."""

from __future__ import annotations

import numpy as np
import pytest

from stragglers.trace.model import OPTYPE_CODES, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.metrics import IDEAL_LEFT_OUT

COMPUTE = [OPTYPE_CODES[o] for o in ("forward-compute", "backward-compute", "optimizer")]
JOB = dict(dp=2, pp=2, microbatches=4, steps=8, seed=0, heavy_last_stage=2.0)


def _timed_short(trace: Trace, rank: int, scale: float) -> Trace:
    """`rank`'s compute durations × scale, its starts and everything else kept."""
    ops = {k: v.copy() for k, v in trace.ops.items()}
    hit = (ops["rank"] == rank) & np.isin(ops["optype"], COMPUTE)
    ops["duration"] = np.where(hit, ops["duration"] * scale, ops["duration"])
    return Trace(ops, trace.meta)


def _stage_fix(result) -> float:
    found = [f for f in result.diagnosis if f.cause == "stage_imbalance"]
    assert len(found) == 1, result.diagnosis
    return found[0].speedup_if_fixed


# ranks 2 and 3: the two workers of the heavy stage 1 (the givers of the work moved)
@pytest.mark.parametrize("rank", [2, 3])
def test_a_left_out_worker_does_not_price_the_stage_fix(rank):
    """Heavy last stage ×2 (fix ×1.19); one of its workers writes its computes at a third:
    left out of the ideal, yet read as stated its stage's typical speed was its own, its
    honest DP peer ×3 slow, taking a third of the work moved: ×1.25 predicted. Read at its
    peers', the fix is the healthy job's."""
    clean = _stage_fix(analyze(generate(**JOB)))
    result = analyze(_timed_short(generate(**JOB), rank, 1 / 3))
    assert any(IDEAL_LEFT_OUT in w for w in result.warnings), result.warnings
    assert abs(_stage_fix(result) / clean - 1) < 0.01, (clean, _stage_fix(result))
