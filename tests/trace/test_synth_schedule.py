"""Shapes and counts of the synthetic schedules (pp 1/2/4, vpp 1/2/3, several microbatch counts)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from stragglers.errors import InputError
from stragglers.trace.model import OPTYPES
from stragglers.trace.synth import generate
from stragglers.trace.synth._generate import upper_bound_ops
from stragglers.trace.synth.schedule import build_step_graph, compute_order


def expected_counts(stage: int, pp: int, vpp: int, mbs: int, sync: str) -> Counter:
    """Ops per worker per step, from first principles."""
    n = mbs * vpp
    c = Counter({"forward-compute": n, "backward-compute": n, "optimizer": 1})
    if pp > 1:
        c["forward-recv"] = n - (mbs if stage == 0 else 0)
        c["forward-send"] = n - (mbs if stage == pp - 1 else 0)
        c["backward-recv"] = n - (mbs if stage == pp - 1 else 0)
        c["backward-send"] = n - (mbs if stage == 0 else 0)
        c["layernorm-grads-all-reduce"] = 1
        c["optimizer-clip-main-grad"] = 1
        if stage in (0, pp - 1):
            c["embedding-grads-all-reduce"] = 1
    if sync == "zero":
        c["params-all-gather"] = vpp
        c["grads-reduce-scatter"] = 1
    else:
        c["grads-all-reduce"] = 1
    return +c


@pytest.mark.parametrize("dp,pp,vpp,mbs,sync", [
    (2, 1, 1, 4, "zero"), (3, 1, 1, 3, "ddp"), (2, 2, 1, 2, "zero"), (2, 2, 1, 5, "ddp"),
    (2, 4, 1, 4, "zero"), (1, 4, 1, 9, "ddp"), (2, 2, 2, 4, "zero"), (2, 4, 2, 8, "ddp"),
    (1, 4, 3, 4, "zero"),
])
def test_synth_counts_per_worker_and_step(dp, pp, vpp, mbs, sync):
    steps = 3
    trace = generate(dp=dp, pp=pp, vpp=vpp, microbatches=mbs, steps=steps, sync=sync, seed=2)
    o = trace.ops
    names = trace.optype_names()
    total = 0
    for d in range(dp):
        for s in range(pp):
            want = expected_counts(s, pp, vpp, mbs, sync)
            for step in range(steps):
                m = (o["dp_rank"] == d) & (o["stage"] == s) & (o["step"] == step)
                assert Counter(names[m].tolist()) == want, (d, s, step)
                assert np.all(o["rank"][m] == s * dp + d)  # Megatron order, pp outermost
                total += sum(want.values())
    assert len(trace) == total
    assert trace.meta.dp_size == dp and trace.meta.pp_size == pp and trace.meta.vpp_size == vpp
    assert trace.meta.world_size == dp * pp
    assert trace.meta.extra["ground_truth"] == []
    # forward/backward carry microbatch and chunk; everything else has mb -1 and gmc -1
    fb = np.isin(o["optype"], [OPTYPES.index("forward-compute"), OPTYPES.index("backward-compute")])
    assert np.all(o["mb_id"][~fb] == -1) and np.all(o["gmc"][~fb] == -1)
    assert np.all((o["mb_id"][fb] >= 0) & (o["mb_id"][fb] < mbs))
    assert np.all(o["gmc"][fb] == o["mc"][fb] * pp + o["stage"][fb])
    assert np.all((o["mc"] >= 0) & (o["mc"] < vpp))
    assert np.all(o["duration"] > 0) and np.all(np.isfinite(o["start_ts"]))


@pytest.mark.parametrize("pp,vpp,mbs", [(1, 1, 3), (2, 1, 1), (4, 1, 8), (4, 1, 2), (2, 2, 4),
                                        (4, 2, 4), (4, 2, 8), (3, 3, 6)])
def test_synth_compute_order_is_1f1b(pp, vpp, mbs):
    for stage in range(pp):
        order = compute_order(stage, pp, vpp, mbs)
        fwd = [(c, m) for k, c, m in order if k == "F"]
        bwd = [(c, m) for k, c, m in order if k == "B"]
        every = sorted((c, m) for c in range(vpp) for m in range(mbs))
        assert sorted(fwd) == every and sorted(bwd) == every
        for item in every:  # a microbatch-chunk runs forward before backward
            assert order.index(("F", *item)) < order.index(("B", *item))
        warmup = next(i for i, (k, _, _) in enumerate(order) if k == "B")
        if vpp == 1:
            assert warmup == min(pp - stage - 1, mbs) + (1 if mbs > pp - stage - 1 else 0)
            # steady state alternates F, B
            steady = order[warmup - 1: warmup - 1 + 2 * (mbs - min(pp - stage - 1, mbs))]
            assert [k for k, _, _ in steady] == ["F", "B"] * (len(steady) // 2)
        elif mbs != pp:
            assert warmup == min((pp - stage - 1) * 2 + (vpp - 1) * pp, mbs * vpp) + 1
        # the forward order over (chunk, mb) is the same on every stage (p2p pairs line up)
        assert fwd == [(c, m) for k, c, m in compute_order(0, pp, vpp, mbs) if k == "F"]


def test_synth_seq_id_is_start_order_and_steps_are_numbered():
    trace = generate(dp=2, pp=2, microbatches=4, steps=4, gc=(1.0, 0.01), seed=5)
    o = trace.ops
    assert sorted(set(o["step"].tolist())) == [0, 1, 2, 3]
    key = (o["rank"].astype(np.int64) * 100 + o["step"]) * 100 + o["optype"]
    for k in np.unique(key):
        idx = np.flatnonzero(key == k)
        idx = idx[np.argsort(o["start_ts"][idx])]
        assert o["seq_id"][idx].tolist() == list(range(len(idx)))


@pytest.mark.parametrize("kwargs,field", [
    (dict(dp=0), "dp"), (dict(pp=1.5), "pp"), (dict(steps=-1), "steps"), (dict(sync="fsdp"), "sync"),
    (dict(pp=1, vpp=2), "vpp"), (dict(pp=4, vpp=2, microbatches=6), "microbatches"),
    (dict(noise=-0.1), "noise"), (dict(slow_worker=(2, 0, 2.0)), "slow_worker"),
    (dict(slow_worker=(0, 0)), "slow_worker"), (dict(slow_worker=(0, 0, 0)), "slow_worker factor"),
    (dict(heavy_last_stage=-1), "heavy_last_stage"), (dict(gc=(1.0,)), "gc"),
    (dict(gc=(0.5, float("nan"))), "gc length"),
    # finite sizes whose times overflow (or leave any clock): refused, never written
    (dict(noise=300.0), None), (dict(slow_worker=(0, 1, 1e308)), None),
    (dict(gc=(1.0, 1e300)), None),
    (dict(seq_imbalance={"dist": "zipf"}), "seq_imbalance.dist"),
    (dict(seq_imbalance={"lengths": 3}), "seq_imbalance"),
    (dict(slow_link={"kind": "p2p", "dp": 0, "stage_from": 0, "stage_to": 2, "factor": 2}),
     "slow_link"),
    (dict(slow_link={"kind": "collective", "optype": "grads-all-reduce", "factor": 2}),
     "slow_link optype"),
    (dict(slow_link={"kind": "collective", "optype": "forward-send", "factor": 2}),
     "slow_link optype"),
    (dict(slow_link={"kind": "wire"}), "slow_link"),
    (dict(dp=4096, steps=100_000), "steps"),  # too big to hold: refused before allocating
    # a schedule too big to build (10^10 workers): refused before building it (it filled memory)
    (dict(dp=100_000, pp=100_000), "steps"), (dict(pp=10_000_000, steps=1), "steps"),
])
def test_synth_bad_parameters_are_input_errors(kwargs, field):
    with pytest.raises(InputError) as err:
        generate(**{"dp": 2, "pp": 4, "steps": 2, **kwargs})
    assert err.value.field == field


def test_synth_odd_parameters_warn():
    with pytest.warns(UserWarning, match="capped"):
        trace = generate(dp=1, pp=2, microbatches=2, steps=2, gc=(5.0, 0.01))
    assert (trace.optype_names() == "gc").sum() == 2 * 2 * 2  # every forward paused
    with pytest.warns(UserWarning, match="only stage"):
        generate(dp=2, pp=1, steps=2, heavy_last_stage=1.5)


@pytest.mark.parametrize("pp,vpp,mb", [(1, 1, 1), (2, 1, 4), (8, 1, 32), (4, 2, 8), (8, 4, 16),
                                       (16, 1, 1), (3, 1, 7)])
def test_the_size_bound_checked_before_building_holds(pp, vpp, mb):
    for sync in ("zero", "ddp"):
        for gc_slots in (False, True):
            nodes = len(build_step_graph(pp, vpp, mb, sync, gc_slots=gc_slots).nodes)
            assert nodes <= upper_bound_ops(pp, vpp, mb), (sync, gc_slots, nodes)
