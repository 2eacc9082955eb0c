"""Synthetic jobs with injected causes: each is diagnosed at the right place; noise alone is not."""

import numpy as np
import pytest

from stragglers.trace.synth import generate
from stragglers.whatif import analyze, analyze_with_model

SHAPE = dict(dp=4, pp=4, microbatches=8, steps=6)


def first_cause(result):
    return result.diagnosis[0]


def test_noise_only_is_not_straggling():
    for seed in (0, 1, 2):
        r = analyze(generate(seed=seed, noise=0.02, **SHAPE))
        assert r.slowdown <= 1.02, r.slowdown
        assert [d.cause for d in r.diagnosis] == ["none"]


@pytest.mark.parametrize("vpp,sync,pp", [(1, "zero", 4), (2, "zero", 4), (1, "ddp", 2), (1, "ddp", 1)])
def test_replay_with_launch_delays_reproduces_base(vpp, sync, pp):
    trace = generate(dp=3, pp=pp, vpp=vpp, microbatches=8, steps=4, sync=sync, seed=3,
                     slow_worker=(1, pp - 1, 1.3), launch_delay=2e-4)
    _, w = analyze_with_model(trace)
    np.testing.assert_allclose(w.t_replay, w.t_base, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kwargs,cause,where", [
    (dict(slow_worker=(1, 2, 1.6)), "worker_fault", {"dp": [1], "pp": [2]}),
    (dict(slow_worker=(3, 0, 2.0)), "worker_fault", {"dp": [3], "pp": [0]}),
    (dict(heavy_last_stage=1.4), "stage_imbalance", {"pp": [3]}),
    (dict(seq_imbalance={"dist": "lognormal"}), "sequence_imbalance", None),
    (dict(gc=(0.3, 0.3)), "gc", None),
    (dict(slow_link={"kind": "p2p", "dp": 1, "stage_from": 1, "stage_to": 2, "factor": 100}),
     "communication", {"dp": [1], "pp": [1, 2]}),
])
def test_injected_cause_is_diagnosed_at_its_place(kwargs, cause, where):
    trace = generate(seed=1, **SHAPE, **kwargs)
    r = analyze(trace)
    assert r.slowdown >= 1.1
    top = first_cause(r)
    assert top.cause == cause, r.diagnosis
    if where:
        assert {k: getattr(top.where, k) for k in where} == where
    assert top.speedup_if_fixed > 1.05
    truth = trace.meta.extra["ground_truth"][0]
    assert truth["cause"] == cause


def test_gc_pauses_are_located():
    trace = generate(seed=4, **SHAPE, gc=(0.1, 0.4))
    r = analyze(trace)
    gc = next(d for d in r.diagnosis if d.cause == "gc")
    ops = trace.ops
    pauses = (trace.optype_names() == "gc") & (ops["duration"] > 0.1)
    expected = sorted({(int(d), int(p)) for d, p in zip(ops["dp_rank"][pauses], ops["stage"][pauses])})
    assert sorted((w.dp, w.pp) for w in gc.where.workers) == expected
    assert set(gc.where.steps) == {int(s) for s in ops["step"][pauses]}


def test_pipeline_only_job_with_one_dp_rank():
    r = analyze(generate(dp=1, pp=4, microbatches=8, steps=4, seed=1, heavy_last_stage=1.5))
    assert list(r.by_dp_rank) == [0]
    assert r.diagnosis[0].cause == "stage_imbalance"
    assert r.diagnosis[0].where.pp == [3]
