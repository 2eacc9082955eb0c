"""Injected causes change the right ops by the right amount, and the ground truth says so."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from stragglers.errors import InputError
from stragglers.trace.commands import register
from stragglers.trace.model import OPTYPES
from stragglers.trace.runformat import read_run, write_run
from stragglers.trace.synth import CauseWhere, generate, ground_truth

F, B = OPTYPES.index("forward-compute"), OPTYPES.index("backward-compute")


def mean_duration(trace, optype: int, **where) -> float:
    o = trace.ops
    m = o["optype"] == optype
    for k, v in where.items():
        m &= o[k] == v
    assert m.any()
    return float(o["duration"][m].mean())


def p2p_transfers(trace, d: int, sender: int, receiver: int, direction: str) -> np.ndarray:
    """end - latest start of each send/recv pair from sender to receiver stage on dp rank d."""
    o = trace.ops
    out = []
    for step in np.unique(o["step"]):
        base = (o["dp_rank"] == d) & (o["step"] == step)
        sends = np.flatnonzero(base & (o["stage"] == sender)
                               & (o["optype"] == OPTYPES.index(f"{direction}-send")))
        recvs = np.flatnonzero(base & (o["stage"] == receiver)
                               & (o["optype"] == OPTYPES.index(f"{direction}-recv")))
        sends, recvs = sends[np.argsort(o["seq_id"][sends])], recvs[np.argsort(o["seq_id"][recvs])]
        latest = np.maximum(o["start_ts"][sends], o["start_ts"][recvs])
        out.append(o["start_ts"][sends] + o["duration"][sends] - latest)
    return np.concatenate(out)


def group_transfers(trace, name: str, stage: int) -> np.ndarray:
    o = trace.ops
    m = (o["optype"] == OPTYPES.index(name)) & (o["stage"] == stage)
    out = []
    for step in np.unique(o["step"][m]):
        idx = np.flatnonzero(m & (o["step"] == step))
        out.append(o["start_ts"][idx] + o["duration"][idx] - o["start_ts"][idx].max())
    return np.concatenate(out)


def test_synth_slow_worker_and_heavy_last_stage():
    trace = generate(dp=3, pp=4, microbatches=8, steps=4, seed=11, slow_worker=(2, 1, 3.0),
                     heavy_last_stage=1.5)
    slow = mean_duration(trace, F, dp_rank=2, stage=1)
    peer = mean_duration(trace, F, dp_rank=0, stage=1)
    assert slow / peer == pytest.approx(3.0, rel=0.03)
    assert mean_duration(trace, B, dp_rank=2, stage=1) / mean_duration(trace, B, dp_rank=1, stage=1) \
        == pytest.approx(3.0, rel=0.03)
    assert mean_duration(trace, F, stage=3) / mean_duration(trace, F, stage=2) == \
        pytest.approx(1.5, rel=0.03)
    assert mean_duration(trace, F, stage=0) == pytest.approx(0.020, rel=0.03)
    assert mean_duration(trace, B, stage=0) == pytest.approx(0.040, rel=0.03)
    truth = trace.meta.extra["ground_truth"]
    impacts = [t.pop("impact") for t in truth]
    assert truth == [
        {"cause": "worker_fault", "where": {"dp": [2], "pp": [1]}, "params": {"factor": 3.0}},
        {"cause": "stage_imbalance", "where": {"pp": [3]}, "params": {"factor": 1.5}},
    ]
    assert impacts[0] > 1.3 and impacts[1] > 1.0  # each given the other cause
    gen = trace.meta.extra["generator"]
    assert gen["slow_worker"] == [2, 1, 3.0] and gen["seed"] == 11 and gen["dp"] == 3


def test_synth_sequence_imbalance_follows_sum_of_squares():
    trace = generate(dp=2, pp=2, microbatches=8, steps=5, seed=4,
                     seq_imbalance={"dist": "lognormal", "max_len": 8192, "tokens_per_mb": 8192})
    o = trace.ops
    fb = np.isin(o["optype"], [F, B])
    assert np.all(np.isfinite(o["attn_cost"][fb])) and np.all(np.isnan(o["attn_cost"][~fb]))
    assert np.all(o["tokens"][fb] == 8192) and np.all(o["tokens"][~fb] == -1)
    assert np.all(o["attn_cost"][fb] <= 8192.0 ** 2) and np.all(o["attn_cost"][fb] >= 8192 * 64)
    fwd = o["optype"] == F
    # duration = a + b·Σs² (times noise): the fit is near perfect and a, b have the spec's ratio
    b_fit, a_fit = np.polyfit(o["attn_cost"][fwd], o["duration"][fwd], 1)
    assert np.corrcoef(o["attn_cost"][fwd], o["duration"][fwd])[0, 1] > 0.97
    assert b_fit / a_fit == pytest.approx((0.76e-3 / 1e6) / (0.0194 / 2), rel=0.1)
    assert o["duration"][fwd].mean() == pytest.approx(0.020, rel=0.05)
    # one microbatch has the same sequences on every stage
    for stage_key in [(0, 0, 3)]:
        d, step, mb = stage_key
        m = fwd & (o["dp_rank"] == d) & (o["step"] == step) & (o["mb_id"] == mb)
        assert len(set(o["attn_cost"][m].tolist())) == 1 and m.sum() == 2
    truth = trace.meta.extra["ground_truth"]
    assert [t["cause"] for t in truth] == ["sequence_imbalance"]
    assert truth[0]["params"]["max_len"] == 8192 and truth[0]["params"]["cost_cv"] > 0.2


def test_synth_gc_pauses_precede_forwards_on_random_workers():
    rate, length = 0.5, 0.1
    dp, pp, steps = 4, 2, 20
    trace = generate(dp=dp, pp=pp, microbatches=4, steps=steps, seed=9, gc=(rate, length))
    o = trace.ops
    gc = np.flatnonzero(o["optype"] == OPTYPES.index("gc"))
    expected = rate * dp * pp * steps
    assert abs(len(gc) - expected) < 4 * np.sqrt(expected)
    assert np.median(o["duration"][gc]) == pytest.approx(length, rel=0.05)
    assert len(set(o["rank"][gc].tolist())) > 1 and len(set(o["step"][gc].tolist())) > 5
    compute = np.isin(o["optype"], [F, B, OPTYPES.index("optimizer"), OPTYPES.index("gc")])
    for i in gc[:20]:  # the next compute op of the worker is a forward
        m = compute & (o["rank"] == o["rank"][i]) & (o["step"] == o["step"][i]) \
            & (o["start_ts"] > o["start_ts"][i])
        nxt = np.flatnonzero(m)[np.argmin(o["start_ts"][m])]
        assert o["optype"][nxt] == F
    truth = trace.meta.extra["ground_truth"]
    assert truth[0]["cause"] == "gc" and truth[0]["params"]["pauses"] == len(gc)
    assert truth[0]["params"]["pause_s"] == pytest.approx(o["duration"][gc].sum())


def test_synth_slow_p2p_link():
    trace = generate(dp=2, pp=4, microbatches=8, steps=3, seed=2, slow_link={
        "kind": "p2p", "dp": 1, "stage_from": 2, "stage_to": 1, "factor": 10})
    slow_f = p2p_transfers(trace, 1, 1, 2, "forward")
    slow_b = p2p_transfers(trace, 1, 2, 1, "backward")
    fine = p2p_transfers(trace, 0, 1, 2, "forward")
    other = p2p_transfers(trace, 1, 2, 3, "forward")
    assert np.median(slow_f) == pytest.approx(0.005, rel=0.1)
    assert np.median(slow_b) == pytest.approx(0.005, rel=0.1)
    assert np.median(fine) == pytest.approx(0.0005, rel=0.1)
    assert np.median(other) == pytest.approx(0.0005, rel=0.1)
    truth = trace.meta.extra["ground_truth"]
    assert truth[0]["cause"] == "communication" and truth[0]["where"] == {"dp": [1], "pp": [1, 2]}


def test_synth_slow_collective():
    trace = generate(dp=4, pp=2, microbatches=4, steps=3, seed=2, sync="ddp", slow_link={
        "kind": "collective", "optype": "grads-all-reduce", "stage": 1, "factor": 4})
    assert np.median(group_transfers(trace, "grads-all-reduce", 1)) == pytest.approx(0.024, rel=0.1)
    assert np.median(group_transfers(trace, "grads-all-reduce", 0)) == pytest.approx(0.006, rel=0.1)
    truth = trace.meta.extra["ground_truth"]
    assert truth[0]["where"] == {"pp": [1]} and truth[0]["params"]["optypes"] == ["grads-all-reduce"]


def test_synth_intermittent_slow_link_hits_only_its_steps():
    trace = generate(dp=2, pp=2, microbatches=4, steps=6, seed=3, slow_link={
        "kind": "collective", "optype": "optimizer-clip-main-grad", "stage": None, "factor": 100,
        "steps": [4, 1]})
    o = trace.ops
    m = o["optype"] == OPTYPES.index("optimizer-clip-main-grad")
    for step in range(6):
        idx = np.flatnonzero(m & (o["step"] == step))
        transfer = np.median(o["start_ts"][idx] + o["duration"][idx] - o["start_ts"][idx].max())
        assert transfer == pytest.approx(0.03 if step in (1, 4) else 0.0003, rel=0.1)
    truth = trace.meta.extra["ground_truth"][0]
    assert truth["where"] == {"pp": [0, 1], "steps": [1, 4]} and truth["impact"] > 1.01
    with pytest.raises(InputError, match="steps"):
        generate(dp=2, pp=2, steps=3, slow_link={"kind": "collective", "factor": 2, "steps": [3],
                                                 "optype": "optimizer-clip-main-grad"})


def test_synth_impact_is_measured_against_the_same_job_without_the_cause():
    kw = dict(dp=2, pp=4, microbatches=8, steps=4, seed=1)
    plain = generate(**kw)
    o = plain.ops
    end = o["start_ts"] + o["duration"]
    t_plain = np.mean([end[o["step"] == k].max() - o["start_ts"][o["step"] == k].min()
                       for k in range(4)])
    slow = generate(**kw, slow_worker=(0, 0, 2.0))
    o = slow.ops
    end = o["start_ts"] + o["duration"]
    t_slow = np.mean([end[o["step"] == k].max() - o["start_ts"][o["step"] == k].min()
                      for k in range(4)])
    assert slow.meta.extra["ground_truth"][0]["impact"] == pytest.approx(t_slow / t_plain, rel=1e-5)
    # A slow reduce-scatter on stage 1 has slack before the clip (stage 0 finishes last in
    # 1F1B), so it does not slow the job; on stage 0 it does. The impact tells them apart.
    idle = generate(**kw, slow_link={"kind": "collective", "optype": "grads-reduce-scatter",
                                     "stage": 1, "factor": 5})
    busy = generate(**kw, slow_link={"kind": "collective", "optype": "grads-reduce-scatter",
                                     "stage": 0, "factor": 5})
    assert idle.meta.extra["ground_truth"][0]["impact"] == pytest.approx(1.0, abs=1e-9)
    assert busy.meta.extra["ground_truth"][0]["impact"] > 1.02
    # gc and sequence lengths draw from their own streams: the rest of the job is unchanged
    both = generate(**kw, gc=(0.5, 0.05), seq_imbalance="uniform")
    gc_only = generate(**kw, gc=(0.5, 0.05))
    gc_rows = lambda t: t.ops["start_ts"][t.ops["optype"] == OPTYPES.index("gc")].size
    assert gc_rows(both) == gc_rows(gc_only) > 0


def test_synth_is_deterministic_for_a_seed():
    kw = dict(dp=2, pp=2, microbatches=4, steps=3, gc=(0.5, 0.05), seq_imbalance="uniform")
    a, b, c = generate(seed=3, **kw), generate(seed=3, **kw), generate(seed=4, **kw)
    assert a.ops.keys() == b.ops.keys()
    for k in a.ops:
        np.testing.assert_array_equal(a.ops[k], b.ops[k])
    assert a.meta.to_dict() == b.meta.to_dict()
    assert not np.array_equal(a.ops["duration"][:50], c.ops["duration"][:50])


def test_synth_round_trips_through_a_run_directory(tmp_path):
    trace = generate(dp=2, pp=2, microbatches=4, steps=2, seed=1, seq_imbalance="lognormal",
                     gc=(1.0, 0.02), slow_worker=(0, 1, 2.0))
    back = read_run(write_run(tmp_path / "run", trace))
    assert back.ops.keys() == trace.ops.keys()
    for k in trace.ops:  # rows are already grouped by rank, so the order survives too
        np.testing.assert_array_equal(back.ops[k], trace.ops[k])
    assert back.meta.extra == json.loads(json.dumps(trace.meta.extra))
    # the typed reading of the ground truth is the same before and after the round trip
    truth = ground_truth(back)
    assert truth == ground_truth(trace)
    assert [t.cause for t in truth] == ["worker_fault", "sequence_imbalance", "gc"]
    assert truth[0].where == CauseWhere(dp=[0], pp=[1]) and truth[0].params == {"factor": 2.0}
    assert truth[1].where == CauseWhere() and truth[2].impact is not None


def test_ground_truth_reads_the_generators_causes_or_refuses_in_one_line():
    trace = generate(dp=2, pp=2, microbatches=4, steps=2, seed=1)
    assert ground_truth(trace) == []
    trace.meta.extra["ground_truth"] = [{"cause": "gc", "where": {"dp": "all"}, "params": {}}]
    with pytest.raises(InputError) as err:
        ground_truth(trace)
    assert err.value.field == "ground_truth" and "where.dp" in err.value.problem


def cli_app() -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def _root() -> None:
        """stragglers (test app)"""

    register(app)
    return app


def test_synth_command_writes_a_run(tmp_path):
    out = tmp_path / "job"
    result = CliRunner().invoke(cli_app(), [
        "synth", str(out), "--dp", "2", "--pp", "2", "--microbatches", "2", "--steps", "3",
        "--slow-worker", "1,0,2.5", "--heavy-last-stage", "1.2", "--seq-imbalance", "uniform",
        "--max-len", "4096", "--gc-rate", "0.5", "--gc-length", "0.05",
        "--slow-link", "collective:optimizer-clip-main-grad,all,3", "--slow-link-steps", "0,2",
        "--seed", "5"])
    assert result.exit_code == 0, result.output
    assert "ground truth: worker_fault dp=[1] pp=[0] x2.5 (step time x" in result.output
    assert "; stage_imbalance pp=[1] x1.2 (step time x" in result.output
    trace = read_run(out)
    assert f"{len(trace):,} ops" in result.output
    causes = [t["cause"] for t in trace.meta.extra["ground_truth"]]
    assert causes == ["worker_fault", "stage_imbalance", "sequence_imbalance", "gc",
                      "communication"]
    assert trace.meta.extra["generator"]["seq_imbalance"]["max_len"] == 4096
    assert trace.meta.extra["ground_truth"][-1]["where"] == {"pp": [0, 1], "steps": [0, 2]}
    again = CliRunner().invoke(cli_app(), ["synth", str(out)])
    assert isinstance(again.exception, InputError) and "--force" in str(again.exception)
    forced = CliRunner().invoke(cli_app(), ["synth", str(out), "--force", "--pp", "1"])
    assert forced.exit_code == 0 and len(list(out.glob("rank-*.parquet"))) == 2
    for bad in (["--slow-worker", "1,x,2"], ["--slow-link", "p2p:0,1"]):
        res = CliRunner().invoke(cli_app(), ["synth", str(tmp_path / "bad"), *bad])
        assert isinstance(res.exception, InputError), (bad, res.output)
    # a shape option is SynthSpec's setting: refused as a usage error naming the option
    res = CliRunner().invoke(cli_app(), ["synth", str(tmp_path / "bad"), "--dp", "0"])
    assert res.exit_code == 2 and "'--dp'" in res.output and "at least 1" in res.output


@pytest.mark.slow
def test_synth_real_cli_reports_errors_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "stragglers.cli", "synth", str(tmp_path / "x"),
                           "--slow-worker", "9,0,2"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "slow_worker" in proc.stderr and "Traceback" not in proc.stderr
    # sizes that overflow: one line, no numpy warnings before it
    proc = subprocess.run([sys.executable, "-m", "stragglers.cli", "synth", str(tmp_path / "y"),
                           "--noise", "300"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and not (tmp_path / "y").exists()
    assert proc.stderr.strip().count("\n") == 0 and "noise" in proc.stderr, proc.stderr
