"""Generator injections: host stalls, GC pauses inside compute, per-stage work."""

import numpy as np
import pytest

from stragglers.errors import InputError
from stragglers.trace.model import OPTYPE_CODES as C
from stragglers.trace.synth import generate

SHAPE = dict(dp=2, pp=2, microbatches=4, steps=5)


def first_start(trace, dp, stage):
    ops = trace.ops
    sel = (ops["dp_rank"] == dp) & (ops["stage"] == stage)
    return np.array([ops["start_ts"][sel & (ops["step"] == s)].min() for s in range(5)])


def test_host_stall_delays_that_workers_step_start_only():
    base = generate(seed=1, **SHAPE)
    stalled = generate(seed=1, **SHAPE, host_stall={"dp": 1, "stage": 0, "seconds": 0.3,
                                                    "steps": [2, 3]})
    late = first_start(stalled, 1, 0) - first_start(stalled, 0, 0)
    assert np.all(late[[2, 3]] > 0.29) and np.all(np.abs(late[[0, 1, 4]]) < 0.01)
    truth = stalled.meta.extra["ground_truth"]
    assert truth[0]["cause"] == "host_stall"
    assert truth[0]["where"] == {"dp": [1], "pp": [0], "steps": [2, 3]}
    assert truth[0]["impact"] > 1.05
    assert len(base) == len(stalled)


def test_pauses_in_compute_add_time_without_gc_rows():
    base = generate(seed=2, **SHAPE)
    paused = generate(seed=2, **SHAPE, gc_in_compute=(0.5, 0.2))
    assert not np.any(paused.ops["optype"] == C["gc"])
    fb = np.isin(paused.ops["optype"], (C["forward-compute"], C["backward-compute"]))
    extra = paused.ops["duration"][fb] - base.ops["duration"][fb]
    truth = paused.meta.extra["ground_truth"][0]
    assert truth["cause"] == "gc" and truth["params"]["in_compute"]
    assert int((extra > 0.1).sum()) == truth["params"]["pauses"] > 0
    # everything else drew the same noise: ops without a pause are unchanged
    assert np.allclose(extra[extra < 0.1], 0, atol=1e-12)


def test_stage_scale_multiplies_each_stages_work():
    base = generate(seed=3, **SHAPE)
    scaled = generate(seed=3, **SHAPE, stage_scale=[1.0, 2.0])
    assert scaled.meta.extra["ground_truth"] == []
    ops = base.ops
    fwd = ops["optype"] == C["forward-compute"]
    for stage, factor in ((0, 1.0), (1, 2.0)):
        sel = fwd & (ops["stage"] == stage)
        np.testing.assert_allclose(scaled.ops["duration"][sel], factor * ops["duration"][sel])


@pytest.mark.parametrize("kwargs,field", [
    (dict(host_stall={"dp": 5, "stage": 0, "seconds": 1}), "host_stall dp"),
    (dict(host_stall={"dp": 0, "stage": 0, "seconds": -1}), "host_stall seconds"),
    (dict(host_stall={"dp": 0, "stage": 0, "seconds": 1, "when": 1}), "host_stall"),
    (dict(gc_in_compute=(1,)), "gc_in_compute"),
    (dict(stage_scale=[1.0]), "stage_scale"),
])
def test_bad_injection_parameters_name_the_field(kwargs, field):
    with pytest.raises(InputError) as err:
        generate(seed=0, **SHAPE, **kwargs)
    assert err.value.field == field
