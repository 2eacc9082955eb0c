"""advise() on synthetic jobs with one known cause ranks the remedy that fixes it first."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from stragglers.advice import advise, load_calibration
from stragglers.advice.context import DP_COLLECTIVE, AdviceContext
from stragglers.advice.plan import MIN_GAIN
from stragglers.advice.remedies.tolerate import GradientCoding
from stragglers.errors import InputError
from stragglers.trace.synth import generate
from stragglers.whatif import analyze, analyze_with_model

# A big all-reduce (the synth default is 6 ms), so that hiding part of it matters.
BIG_ALLREDUCE = {"kind": "collective", "optype": "grads-all-reduce", "stage": None, "factor": 20}


def names(plan):
    return [r.name for r in plan.remedies]


def test_deterministic_slow_worker_gets_dd_and_nd_is_refused():
    trace = generate(dp=4, pp=1, microbatches=2, steps=12, sync="ddp", seed=0,
                     slow_worker=(3, 0, 2.0))
    plan = advise(trace, remaining_steps=100_000,
                  devices={0: "h100", 1: "h100", 2: "h100", 3: "a100"})
    assert plan.remedies[0].name == "antdt-dd"
    dd = plan.remedies[0]
    # speeds 1, 1, 1, 1/2: the slow rank gets half the others' batch
    assert dd.details.new_batch_sizes[3] * 2 == pytest.approx(dd.details.new_batch_sizes[0], abs=2)
    # compute 120 ms at speed 1 → T* = 4/3.5 × 120 ms; the rest of the step (~37 ms) unchanged
    assert 1.45 < dd.predicted_speedup < 1.75
    nd = plan.get("antdt-nd")
    assert not nd.applies and "deterministic" in nd.why_not
    assert not plan.get("stragglar").applies


def test_persistent_slow_worker_with_many_steps_left_is_restarted():
    trace = generate(dp=4, pp=1, microbatches=2, steps=12, sync="ddp", seed=1,
                     slow_worker=(2, 0, 2.0))
    plan = advise(trace, remaining_steps=100_000, restart_cost_s=10.0)
    assert names(plan)[:2] == ["antdt-nd", "antdt-dd"]
    nd = plan.remedies[0]
    assert nd.details.worker == [2, 0] and nd.details.gain_s > 10.0
    # few steps left: the same restart does not pay
    short = advise(trace, remaining_steps=20, restart_cost_s=10.0)
    assert not short.get("antdt-nd").applies and "gains only" in short.get("antdt-nd").why_not
    assert short.remedies[0].name == "antdt-dd"
    unknown = advise(trace)
    assert not unknown.get("antdt-nd").applies and "remaining steps" in unknown.get("antdt-nd").why_not


def test_late_host_with_a_big_allreduce_gets_stragglar():
    # rank 7's data loader is 100 ms late every step; its compute is normal, so re-splitting
    # batches by compute speed buys nothing, restarting finds no slow compute, and a code
    # (2× the 120 ms compute to drop it) costs more than the stall
    trace = generate(dp=8, pp=1, microbatches=2, steps=10, sync="ddp", seed=0,
                     slow_link=BIG_ALLREDUCE, host_stall={"dp": 7, "stage": 0, "seconds": 0.1})
    plan = advise(trace, remaining_steps=100_000)
    best = plan.remedies[0]
    assert best.name == "stragglar", [(r.name, r.predicted_speedup, r.why_not) for r in plan.remedies]
    assert best.exact and best.runtime_switchable
    bucket = best.details.buckets[0]
    assert bucket.straggler_dp_rank == 7 and bucket.median_lead_s > 0.08
    # n = 8, phase 1 hidden: the all-reduce becomes phase 2 only, 9/7 vs Ring's 7/4 of s·β
    assert bucket.phase2_s / bucket.library_transfer_s == pytest.approx(9 / 7 / (7 / 4), rel=1e-6)
    assert not plan.get("antdt-nd").applies
    assert not plan.get("antdt-dd").applies
    assert all(not r.applies or r.predicted_speedup < best.predicted_speedup
               for r in plan.remedies[1:])
    # a longer stall than the compute: dropping the late worker with a code would win, but the
    # aggregator's exchange (2(n − s) model-sized messages through one link) is priced too, and
    # with this 120 ms all-reduce it costs more than the stall: StragglAR stays first
    long = generate(dp=8, pp=1, microbatches=2, steps=10, sync="ddp", seed=0,
                    slow_link=BIG_ALLREDUCE, host_stall={"dp": 7, "stage": 0, "seconds": 0.4})
    plan = advise(long)
    assert plan.remedies[0].name == "stragglar"
    assert not plan.get("gradient-coding-s1").applies
    assert "exchange" in plan.get("gradient-coding-s1").why_not


def test_a_code_drops_a_long_stall_and_pays_the_aggregator_exchange():
    # the same stall with the default (6 ms) all-reduce: the code wins; its step is the replay
    # with 2× compute, the stalled worker dropped and the all-reduce × (n − s)·n/(n − 1)
    trace = generate(dp=8, pp=1, microbatches=2, steps=10, sync="ddp", seed=0,
                     host_stall={"dp": 7, "stage": 0, "seconds": 0.4})
    plan = advise(trace)
    code = plan.remedies[0]
    assert code.name == "gradient-coding-s1" and code.exact
    result, w = analyze_with_model(trace)
    ctx = AdviceContext(trace, result, w)
    ring = sum(float(np.nanmedian(w.cost[m])) for m in ctx.nodes_of(DP_COLLECTIVE))
    assert ring > 0
    assert code.details.exchange_s == pytest.approx(ring * 7 * 8 / 7, rel=1e-9)
    # without the exchange (the all-reduce kept as measured) the same code would predict more
    free = GradientCoding(1)
    priced = free.predict(ctx).predicted_speedup
    assert priced == pytest.approx(code.predicted_speedup, rel=1e-9)
    ctx.w.cost[ctx.nodes_of(DP_COLLECTIVE)] = 0.0  # an all-reduce that cost nothing
    assert GradientCoding(1).predict(AdviceContext(trace, result, ctx.w)).predicted_speedup > priced


def test_calibration_changes_the_phase_shares(tmp_path):
    trace = generate(dp=8, pp=1, microbatches=2, steps=6, sync="ddp", seed=0,
                     slow_link=BIG_ALLREDUCE, host_stall={"dp": 7, "stage": 0, "seconds": 0.15})
    trace.ops["bytes"] = (trace.ops["optype"] >= 0).astype("int64") * (64 << 20)
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps({"alpha": 0.002, "beta": 1e-9}))
    link = load_calibration(cal)
    with_alpha = advise(trace, link=link).get("stragglar")
    without = advise(trace).get("stragglar")
    assert "calibrated" in with_alpha.method and "bandwidth-bound" in without.method
    # a large α weighs on phase 2's n−2+log2 n rounds less than on Ring's 2(n−1): cheaper phase 2
    assert with_alpha.details.buckets[0].phase2_s < without.details.buckets[0].phase2_s


def test_gc_pauses_get_planned_gc():
    trace = generate(dp=4, pp=1, microbatches=4, steps=12, sync="ddp", seed=0, gc=(0.5, 0.08))
    plan = advise(trace, remaining_steps=100_000)
    assert plan.remedies[0].name == "planned-gc", [(r.name, r.predicted_speedup) for r in plan.remedies]
    gc = plan.remedies[0]
    assert f"PlannedGC(every={gc.details.every})" in gc.switch_on and gc.details.every == 2
    assert not plan.get("stragglar").applies   # the late rank changes from step to step


def test_rare_gc_pauses_keep_planned_gc_clear_of_noise():
    # full collections in a few steps only: a resample with fewer of them also plans fewer
    # collections (the planned price follows the automatic ones), so the interval stays above
    # ×1.02 instead of counting the pause-free resamples against a fixed planned price
    trace = generate(dp=4, pp=1, microbatches=2, steps=20, sync="ddp", seed=0, gc=(0.05, 0.5))
    gc = advise(trace, remaining_steps=100).get("planned-gc")
    assert gc.applies, gc.why_not
    assert 1.02 <= gc.interval[0] <= gc.predicted_speedup <= gc.interval[1]


def test_stage_imbalance_gets_stage_split_and_no_collective_remedy():
    trace = generate(dp=4, pp=2, microbatches=8, steps=8, sync="ddp", seed=0,
                     heavy_last_stage=1.6)
    plan = advise(trace, remaining_steps=100_000)
    assert plan.remedies[0].name == "stage-split"
    stragglar = plan.get("stragglar")
    assert not stragglar.applies and "stage" in stragglar.why_not
    assert not plan.get("antdt-dd").applies
    assert not plan.get("gradient-coding-s1").applies and "pipelined" in plan.get("gradient-coding-s1").why_not


def test_zero_sync_job_is_not_offered_stragglar():
    trace = generate(dp=4, pp=2, microbatches=4, steps=6, sync="zero", seed=0,
                     slow_worker=(1, 1, 2.0))
    why = advise(trace).get("stragglar").why_not
    assert "reduce-scatter" in why


def test_plan_round_trips_as_strict_json():
    trace = generate(dp=4, pp=1, microbatches=2, steps=6, sync="ddp", seed=0, slow_worker=(3, 0, 2.0))
    plan = advise(trace, max_s=3)
    raw = json.loads(plan.to_json())
    assert [r["name"] for r in raw["remedies"]] == names(plan)
    assert {"gradient-coding-s1", "gradient-coding-s2", "gradient-coding-s3"} <= set(names(plan))
    assert all(set(r) >= {"applies", "why_not", "predicted_step_s", "predicted_speedup", "method",
                          "cost", "switch_on"} for r in raw["remedies"])


def test_bad_input_is_one_clear_error(tmp_path):
    trace = generate(dp=2, pp=1, microbatches=2, steps=4, sync="ddp", seed=0)
    with pytest.raises(InputError, match="trace"):
        advise(analyze(trace))
    with pytest.raises(InputError, match="remaining"):
        advise(trace, remainig_steps=3)
    with pytest.raises(InputError, match="remedies"):
        advise(trace, remedies=["no-such-remedy"])
    for knob, value in (("restart_cost_s", float("inf")), ("restart_cost_s", float("nan")),
                        ("remaining_steps", -1), ("remaining_steps", 2.5), ("max_s", 0),
                        ("threshold", 2.0), ("global_batch", True), ("gc_sync_pause_s", -1.0)):
        with pytest.raises(InputError) as err:
            advise(trace, **{knob: value})
        assert err.value.field == knob, (knob, value)
    bad = tmp_path / "cal.json"
    bad.write_text(json.dumps({"alpha": -1, "beta": 1e-9}))
    with pytest.raises(InputError, match="alpha"):
        load_calibration(bad)
    with pytest.raises(InputError, match="no such"):
        load_calibration(tmp_path / "missing.json")


def test_advise_runs_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "from stragglers.advice import advise\n"
            "from stragglers.trace.synth import generate\n"
            "p = advise(generate(dp=4, pp=1, microbatches=2, steps=4, sync='ddp', seed=0, "
            "slow_worker=(3, 0, 2.0)))\n"
            "print(p.remedies[0].name)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "antdt-dd"


def test_advised_gradient_code_is_exact_for_every_survivor_set():
    import itertools

    from stragglers.coding import make_code

    trace = generate(dp=4, pp=1, microbatches=2, steps=6, sync="ddp", seed=0, slow_worker=(3, 0, 2.0))
    for advice in advise(trace, max_s=2).remedies:
        if not advice.name.startswith("gradient-coding"):
            continue
        s = advice.details.s
        code = make_code(advice.details.scheme, 4, s)
        assert code.exact
        for survivors in itertools.combinations(range(4), 4 - s):
            assert code.decode(survivors).residual < 1e-9


def test_measured_compute_curves_price_dd_with_the_fixed_part():
    trace = generate(dp=4, pp=1, microbatches=2, steps=12, sync="ddp", seed=0,
                     slow_worker=(3, 0, 2.0))
    linear = advise(trace, remedies=["antdt-dd"], global_batch=64).get("antdt-dd")
    # per-rank compute 120 ms at 16 samples (240 ms on rank 3), half of it a fixed part that
    # does not shrink with the batch: rank 3 is t(b) = 0.12 + 0.0075·b, the others 0.06 + 0.00375·b
    curves = [(0.06, 0.00375)] * 3 + [(0.12, 0.0075)]
    fixed = advise(trace, remedies=["antdt-dd"], global_batch=64,
                   compute_curves=curves).get("antdt-dd")
    # b_i = (T − a_i)/c_i, Σ b_i = 64: T = (64 + 3·16 + 16) / (3/0.00375 + 1/0.0075) = 0.1371 s,
    # so 20.57 samples on each fast rank and 2.29 on rank 3 (its fixed 120 ms alone is 0.88 T);
    # the curves are anchored on each rank's measured compute, so the trace's 2% jitter decides
    # which fast rank rounds down
    new = fixed.details.new_batch_sizes
    assert sorted(new[:3]) == [20, 21, 21] and new[3] == 2
    assert linear.details.new_batch_sizes == [18, 19, 18, 9]   # 64·(1, 1, 1, ½)/3.5
    assert "calibration" in fixed.method and "∝ batch" in linear.method
    # every rank's compute now ends at T = 137 ms instead of rank 3's 240 ms; the rest of the
    # step is unchanged
    plan = advise(trace, remedies=["antdt-dd"], global_batch=64, compute_curves=curves)
    assert plan.baseline_step_s - fixed.predicted_step_s == pytest.approx(0.240 - 0.137, abs=0.01)
    with pytest.raises(InputError, match="compute_curves"):
        advise(trace, remedies=["antdt-dd"], compute_curves=[(0.0, 1.0)] * 3)
    with pytest.raises(InputError, match=r"compute_curves\[1\]"):
        advise(trace, remedies=["antdt-dd"], compute_curves=[(0.0, 1.0), (0.0, -1.0)] * 2)


def test_a_measured_synchronous_collection_prices_planned_gc():
    from dataclasses import replace

    from stragglers.trace.model import Trace

    trace = generate(dp=4, pp=1, microbatches=4, steps=12, sync="ddp", seed=0, gc=(0.5, 0.08))
    recorded = advise(trace, remedies=["planned-gc"]).get("planned-gc")
    # every rank collecting at once takes 4× a recorded pause: the gain shrinks
    slow = advise(trace, remedies=["planned-gc"], gc_sync_pause_s=4 * 0.08).get("planned-gc")
    assert slow.details.planned_pause_s == pytest.approx(0.32)
    assert "measured in this job" in slow.method
    assert slow.predicted_speedup < recorded.predicted_speedup
    # the same number from the run's metadata (what train_advised.py --calibrate writes)
    extra = {**trace.meta.extra, "calibration": {"gc_sync_pause_s": 0.32}}
    meta_trace = Trace(trace.ops, replace(trace.meta, extra=extra), trace.source)
    from_meta = advise(meta_trace, remedies=["planned-gc"]).get("planned-gc")
    assert from_meta.predicted_speedup == pytest.approx(slow.predicted_speedup)
    with pytest.raises(InputError, match="gc_sync_pause_s"):
        advise(trace, remedies=["planned-gc"], gc_sync_pause_s=-1.0)


def test_a_gain_inside_the_jobs_step_noise_is_not_advised():
    # a 15% slower rank under 30% op jitter: the replay predicts a DD gain of ×1.045, but the
    # steps resampled put it anywhere from ×1.01 to ×1.08, so it is not offered; the same
    # cause, large against the jitter, is offered with its interval
    noisy = generate(dp=4, pp=1, microbatches=2, steps=8, sync="ddp", seed=0, noise=0.3,
                     slow_worker=(3, 0, 1.15))
    dd = advise(noisy, remaining_steps=20).get("antdt-dd")
    assert dd.predicted_speedup >= MIN_GAIN and not dd.applies
    assert dd.interval[0] < MIN_GAIN < dd.interval[1] and "interval" in dd.why_not
    clear = generate(dp=4, pp=1, microbatches=2, steps=12, sync="ddp", seed=0,
                     slow_worker=(3, 0, 2.0))
    dd = advise(clear, remaining_steps=20).get("antdt-dd")
    assert dd.applies and MIN_GAIN <= dd.interval[0] <= dd.predicted_speedup <= dd.interval[1]
    assert json.loads(advise(clear).to_json())["remedies"][0]["interval"] == dd.interval


def test_calibrated_curves_take_their_level_from_the_jobs_own_steps():
    # ranks that compute alike in every recorded step, and a calibration (one short measurement
    # per batch size, on shared cores) that put rank 0 30% faster: the speeds are the job's own,
    # the calibration only shapes the curve, so no batch moves and DD does not apply
    trace = generate(dp=4, pp=1, microbatches=2, steps=12, sync="ddp", seed=0)
    curves = [(0.03, 0.0045 / 1.3)] + [(0.03, 0.0045)] * 3
    dd = advise(trace, remedies=["antdt-dd"], global_batch=64, compute_curves=curves).get("antdt-dd")
    assert not dd.applies and dd.predicted_speedup < 1.02, dd
    assert max(dd.details.new_batch_sizes) - min(dd.details.new_batch_sizes) <= 1
