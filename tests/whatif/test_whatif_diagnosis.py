"""The diagnosis contract (whatif/README.md): right workers at scale, every cause, own-share
predictions with intervals, noise → none, warm-up left out, thresholds from DiagnosisConfig."""

import numpy as np
import pytest

from stragglers.errors import InputError
from stragglers.trace.model import Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.config import STRAGGLING_SLOWDOWN, DiagnosisConfig
from stragglers.whatif.result import Finding, Where, WorkerRef
from test_worker_fault_few_workers import _scaled


def causes(result):
    return [d.cause for d in result.diagnosis]


def finding(result, cause):
    return next(d for d in result.diagnosis if d.cause == cause)


def workers(f):
    return sorted((w.dp, w.pp) for w in f.where.workers)


def test_one_slow_worker_among_512_is_named_alone_with_its_rank():
    trace = generate(dp=64, pp=8, microbatches=8, steps=4, seed=2, slow_worker=(37, 5, 1.7))
    r = analyze(trace)
    f = finding(r, "worker_fault")
    assert workers(f) == [(37, 5)]
    assert f.where.ranks == [5 * 64 + 37]          # synth ranks: stage * dp + dp_rank
    assert f.interval.low <= f.speedup_if_fixed <= f.interval.high


def test_healthy_workers_next_to_a_slow_one_are_not_named():
    r = analyze(generate(dp=64, pp=2, microbatches=4, steps=4, seed=3, slow_worker=(5, 1, 1.7)))
    assert workers(finding(r, "worker_fault")) == [(5, 1)]


@pytest.mark.parametrize("dp,pp,mb", [(64, 2, 2), (64, 1, 2), (1, 4, 8), (8, 8, 8)])
def test_noise_only_jobs_are_none(dp, pp, mb):
    r = analyze(generate(dp=dp, pp=pp, microbatches=mb, steps=6, seed=5, noise=0.05))
    assert causes(r) == ["none"], r.diagnosis


def test_a_second_cause_does_not_hide_the_first():
    trace = generate(dp=4, pp=4, microbatches=8, steps=6, seed=1, slow_worker=(1, 1, 1.6),
                     heavy_last_stage=1.5)
    r = analyze(trace)
    assert {"worker_fault", "stage_imbalance"} <= set(causes(r)), r.diagnosis
    assert finding(r, "stage_imbalance").where.pp == [3]
    summary = r.diagnosis_summary
    assert summary.all_fixed >= max(d.speedup_if_fixed for d in r.diagnosis) - 1e-9
    assert 0 <= summary.unexplained <= 1


@pytest.mark.parametrize("sync", ["zero", "ddp"])
def test_a_dp_rank_that_drew_long_sequences_is_no_slow_worker(sync):
    # DP rank 0 got the longest sequences in two steps: all 8 of its stages computed 1.18x
    # their peers there. Sequences explain it (the trace carries Σs²): no worker fault.
    trace = generate(dp=4, pp=8, microbatches=8, steps=8, seed=1040, noise=0.02, sync=sync,
                     seq_imbalance={"dist": "lognormal"})
    r = analyze(trace)
    assert causes(r) == ["sequence_imbalance"], r.diagnosis


def test_a_slow_worker_among_peers_with_uneven_sequences_is_named():
    # 16 DP ranks whose compute follows their sequences (up to 1.5x apart per step) hid a
    # x1.49 worker from the outlier test; judged on what Σs² does not explain, it stands out.
    trace = generate(dp=16, pp=1, microbatches=8, steps=8, seed=1065, noise=0.05,
                     slow_worker=(1, 0, 1.4892842005888842), seq_imbalance={"dist": "lognormal"})
    r = analyze(trace)
    assert workers(finding(r, "worker_fault")) == [(1, 0)], r.diagnosis


def test_a_host_stall_other_ranks_gc_pauses_cover_is_found_once_gc_is_fixed():
    # In 6 of 8 steps another rank's GC pause outlasts rank 5's 0.26 s stall, so fixing the
    # stall alone buys x1.08 with an interval down to 1.0; with GC fixed it buys every step.
    trace = generate(dp=8, pp=1, microbatches=8, steps=8, seed=1035, noise=0.05, sync="ddp",
                     gc=(0.2905639620201784, 0.2783387153827614),
                     host_stall={"dp": 5, "stage": 0, "seconds": 0.2564480471594024})
    r = analyze(trace)
    assert set(causes(r)) == {"gc", "host_stall"}, r.diagnosis
    stall = finding(r, "host_stall")
    assert workers(stall) == [(5, 0)]
    assert stall.basis == "after_others" and stall.speedup_alone < 1.1
    assert stall.speedup_if_fixed > 1.3


def test_a_cause_another_explains_is_named_in_its_evidence_not_twice():
    from stragglers.whatif.diagnosis import _without_explained
    from stragglers.whatif.causes.base import Candidate
    from stragglers.whatif import analyze_with_model

    trace = generate(dp=4, pp=2, microbatches=4, steps=6, seed=0, slow_worker=(2, 1, 1.8))
    _, w = analyze_with_model(trace)
    cost = w.cost.copy()
    cost[:, 2, :] *= 0.5      # the same fix, found twice: the weaker copy buys nothing after it
    where = Where(workers=[WorkerRef(2, 1)])
    strong = Candidate("worker_fault", where, "strong", cost=cost)
    weak = Candidate("host_stall", where, "weak", cost=cost.copy())

    def entry(cand):
        return Finding(cand.cause, where, cand.evidence, speedup_if_fixed=1.5, basis="alone")

    kept = _without_explained(w, [(strong, entry(strong)), (weak, entry(weak))],
                              DiagnosisConfig())
    assert [c.cause for c, _ in kept] == ["worker_fault"]
    assert "apparent host stall (dp 2 pp 1" in kept[0][1].evidence


@pytest.mark.parametrize("pp,sync", [(1, "ddp"), (4, "zero")])
def test_host_stall_is_attributed_to_the_stalling_worker(pp, sync):
    trace = generate(dp=4, pp=pp, microbatches=8, steps=6, seed=4, sync=sync,
                     host_stall={"dp": 2, "stage": pp - 1, "seconds": 0.15})
    r = analyze(trace)
    f = r.diagnosis[0]
    assert f.cause == "host_stall", r.diagnosis
    assert workers(f) == [(2, pp - 1)]
    truth = trace.meta.extra["ground_truth"][0]["impact"]
    assert abs(f.speedup_if_fixed / truth - 1) < 0.05


def test_a_host_stall_beside_a_slow_peer_of_its_stage_is_named_where_it_holds_the_group_up():
    # dp 2 x pp 2: rank (0, 1) stalls 85 ms per step, its stage peer (1, 1) computes 2.3x. At
    # most collectives the stalled rank arrives first and waits for the slow one (its mean
    # arrival is early), but at the step's first it arrives last and holds the group up by
    # its stall: the stall costs the job x1.05 beside the slow worker, and both are named.
    trace = generate(dp=2, pp=2, microbatches=8, steps=8, seed=1050, noise=0.05, sync="zero",
                     slow_worker=(1, 1, 2.2956349383630235),
                     host_stall={"dp": 0, "stage": 1, "seconds": 0.08512393144889112})
    r = analyze(trace)
    assert set(causes(r)) == {"worker_fault", "host_stall"}, r.diagnosis
    assert workers(finding(r, "worker_fault")) == [(1, 1)]
    stall = finding(r, "host_stall")
    assert workers(stall) == [(0, 1)]
    truth = next(t["impact"] for t in trace.meta.extra["ground_truth"]
                 if t["cause"] == "host_stall")
    assert abs(stall.speedup_if_fixed / truth - 1) < 0.02


def test_gc_inside_compute_is_found_from_the_duration_pattern():
    trace = generate(dp=4, pp=2, microbatches=8, steps=8, seed=6, gc_in_compute=(0.3, 0.2))
    r = analyze(trace)
    assert r.diagnosis[0].cause == "gc", r.diagnosis
    assert r.diagnosis[0].upper_bound is True


def test_frequent_gc_inside_a_deep_pipeline_is_not_taken_for_sequences():
    # 16 compute ops per microbatch, DP rank and step (pp 8): at 5% of ops paused, half the
    # pauses share a microbatch with another by chance; that is no sequence pattern.
    trace = generate(dp=16, pp=8, microbatches=8, steps=8, seed=1127, noise=0.02, sync="ddp",
                     gc_in_compute=(0.814553360615379, 0.11000307822627246))
    r = analyze(trace)
    assert causes(r) == ["gc"], r.diagnosis


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_gc_inside_compute_and_uneven_sequences_are_both_found(seed):
    # with Σs² in the trace: pauses are told apart from long microbatches, and the sequence
    # pattern is read with the pauses taken out (one paused op broke the forward/backward
    # correlation)
    trace = generate(dp=8, pp=8, microbatches=8, steps=8, seed=seed, noise=0.02,
                     seq_imbalance={"dist": "lognormal"}, gc_in_compute=(0.6, 0.2))
    r = analyze(trace)
    assert set(causes(r)) == {"gc", "sequence_imbalance"}, r.diagnosis


def test_intermittent_slowdown_names_its_steps():
    trace = generate(dp=2, pp=4, microbatches=8, steps=10, seed=7, slow_link={
        "kind": "collective", "optype": "grads-reduce-scatter", "stage": 1, "factor": 100,
        "steps": [3, 7]})
    f = finding(analyze(trace), "communication")
    assert f.where.steps == [3, 7]
    assert f.where.pp == [1]


def test_intervals_are_deterministic():
    trace = generate(dp=4, pp=4, microbatches=8, steps=6, seed=1, slow_worker=(1, 2, 1.5))
    a, b = analyze(trace), analyze(trace)
    assert a.diagnosis[0].interval == b.diagnosis[0].interval


def _with_slow_first_step(trace: Trace, factor: float) -> Trace:
    """The same trace with step 0 stretched in time (a warm-up step), later steps shifted."""
    ops = {k: v.copy() for k, v in trace.ops.items()}
    first = ops["step"] == ops["step"].min()
    t0 = ops["start_ts"][first].min()
    end0 = (ops["start_ts"] + ops["duration"])[first].max()
    ops["start_ts"][first] = t0 + (ops["start_ts"][first] - t0) * factor
    ops["duration"][first] *= factor
    ops["start_ts"][~first] += (end0 - t0) * (factor - 1)
    return Trace(ops, trace.meta, trace.source)


def test_warmup_steps_are_left_out_by_default_and_kept_on_request():
    trace = _with_slow_first_step(generate(dp=2, pp=2, microbatches=4, steps=8, seed=8), 4.0)
    r = analyze(trace)
    assert r.warmup_steps == [0] and 0 not in r.steps_analysed
    assert any("warm-up" in w for w in r.warnings)
    assert causes(r) == ["none"]
    everything = analyze(trace, steps="all")
    assert everything.warmup_steps == [] and 0 in everything.steps_analysed
    with pytest.raises(InputError):
        analyze(trace, steps="some")


def test_straggling_threshold_is_defined_once():
    assert DiagnosisConfig().straggling_slowdown == STRAGGLING_SLOWDOWN == 1.1
    r = analyze(generate(dp=2, pp=2, microbatches=4, steps=4, seed=0))
    assert r.diagnosis_config is not None and r.diagnosis_config.straggling_slowdown == STRAGGLING_SLOWDOWN


# --- thresholds swept on synthetic jobs: each decides what its documentation says ----------

def test_sweep_worker_min_excess():
    # the margin of jobs with fewer than five workers, where no outlier test is possible, for
    # a worker not behind its peers in every step (one that is meets the outlier test with
    # the spread at its floor instead): ×1.48 in five steps, ×0.98 in one
    trace = _scaled(generate(dp=2, pp=2, microbatches=8, steps=6, seed=9), 2,
                    [1.48, 1.48, 0.98, 1.48, 1.48, 1.48])
    found = {}
    for excess in (0.05, 0.2, 0.25, 0.5, 1.0):
        r = analyze(trace, config=DiagnosisConfig(worker_min_excess=excess))
        found[excess] = "worker_fault" in causes(r)
    # the worker computes 1.4x as long: named while the threshold is below its interval's
    # lower end (×1.31), never above
    assert found == {0.05: True, 0.2: True, 0.25: True, 0.5: False, 1.0: False}
    steady = generate(dp=2, pp=2, microbatches=8, steps=6, seed=9, slow_worker=(1, 0, 1.4))
    for excess in (0.05, 1.0):
        assert "worker_fault" in causes(analyze(steady, config=DiagnosisConfig(
            worker_min_excess=excess)))
    # with five workers or more the outlier test decides: the margin does not apply
    big = generate(dp=8, pp=2, microbatches=8, steps=6, seed=9, slow_worker=(3, 0, 1.4))
    for excess in (0.05, 1.0):
        assert "worker_fault" in causes(analyze(big, config=DiagnosisConfig(
            worker_min_excess=excess)))


def test_a_worker_under_the_small_job_margin_is_named_among_many():
    # a x1.15 worker among 16 (below worker_min_excess, which small jobs need): the outlier
    # test names it while outlier_z is under its robust z, never above
    trace = generate(dp=8, pp=2, microbatches=8, steps=10, seed=4, noise=0.02,
                     slow_worker=(5, 1, 1.15))
    named = {z: "worker_fault" in causes(analyze(trace, config=DiagnosisConfig(outlier_z=z)))
             for z in (3.0, 6.0, 50.0)}
    assert named == {3.0: True, 6.0: True, 50.0: False}


def test_sweep_min_gain():
    trace = generate(dp=4, pp=4, microbatches=8, steps=6, seed=1, slow_worker=(1, 2, 1.6))
    gain = finding(analyze(trace), "worker_fault").interval.low
    for min_gain in (1.01, gain - 0.01, gain + 0.01, 1.9):
        r = analyze(trace, config=DiagnosisConfig(min_gain=min_gain))
        assert ("worker_fault" in causes(r)) == (gain >= min_gain), min_gain


def test_sweep_stage_min_excess():
    trace = generate(dp=2, pp=4, microbatches=8, steps=6, seed=2, heavy_last_stage=1.6)
    # last stage 1.6x, the mean stage (3 + 1.6) / 4 = 1.15: excess 0.39
    for excess, expected in ((0.1, True), (0.3, True), (0.5, False)):
        r = analyze(trace, config=DiagnosisConfig(stage_min_excess=excess))
        assert ("stage_imbalance" in causes(r)) == expected, excess


def test_sweep_outlier_z_separates_a_mild_worker():
    trace = generate(dp=16, pp=2, microbatches=8, steps=6, seed=3, slow_worker=(9, 1, 1.3))
    named = [("worker_fault" in causes(analyze(trace, config=DiagnosisConfig(outlier_z=z))))
             for z in (3.0, 6.0, 1e2)]
    assert named[0] and named[1] and not named[2]


def test_sweep_stall_min_fraction():
    trace = generate(dp=4, pp=1, microbatches=8, steps=6, seed=4, sync="ddp",
                     host_stall={"dp": 1, "stage": 0, "seconds": 0.1})
    step = float(np.median(list(analyze(trace).step_times["base"].values())))
    for fraction in (0.01, 0.5 * 0.1 / step, 2 * 0.1 / step):
        r = analyze(trace, config=DiagnosisConfig(stall_min_fraction=min(fraction, 1.0)))
        assert ("host_stall" in causes(r)) == (fraction * step < 0.1), fraction


def test_sweep_comm_min_ratio():
    trace = generate(dp=2, pp=4, microbatches=8, steps=6, seed=5, slow_link={
        "kind": "p2p", "dp": 1, "stage_from": 1, "stage_to": 2, "factor": 60})
    for ratio, expected in ((2.0, True), (20.0, True), (500.0, False)):
        r = analyze(trace, config=DiagnosisConfig(comm_min_ratio=ratio))
        assert ("communication" in causes(r)) == expected, ratio


def test_sweep_warmup_factor():
    trace = _with_slow_first_step(generate(dp=2, pp=2, microbatches=4, steps=8, seed=8), 2.0)
    assert analyze(trace, config=DiagnosisConfig(warmup_factor=1.5)).warmup_steps == [0]
    assert analyze(trace, config=DiagnosisConfig(warmup_factor=3.0)).warmup_steps == []


def test_every_threshold_is_documented_in_the_contract():
    from pathlib import Path

    import stragglers.whatif as whatif

    readme = (Path(whatif.__file__).parent / "README.md").read_text()
    missing = [name for name, _, help_text in DiagnosisConfig.describe()
               if f"`{name}`" not in readme or not help_text]
    assert not missing, missing


def test_bad_config_is_one_line_error():
    with pytest.raises(InputError, match="min_gain"):
        DiagnosisConfig.from_mapping({"min_gain": 0.5})


def test_hosts_come_from_the_layout_metadata():
    trace = generate(dp=8, pp=2, microbatches=4, steps=4, seed=12, slow_worker=(6, 1, 1.8))
    trace.meta.extra["layout"] = [{"rank": r, "host": f"node-{r // 4}"} for r in range(16)]
    f = finding(analyze(trace), "worker_fault")
    # synth ranks: stage * dp + dp_rank = 14, on node 3
    assert f.where.workers == [WorkerRef(dp=6, pp=1, rank=14, host="node-3")]
    assert f.where.hosts == ["node-3"] and "rank 14 on node-3" in f.evidence


def test_incomplete_steps_are_left_out_of_every_per_step_result():
    trace = generate(dp=2, pp=2, microbatches=4, steps=6, seed=13,
                     slow_link={"kind": "p2p", "dp": 1, "stage_from": 0, "stage_to": 1,
                                "factor": 80, "steps": [1]})
    ops = trace.ops
    keep = ~((ops["step"] == 4) & (ops["rank"] == 3))       # rank 3 lost step 4
    r = analyze(trace.select(keep))
    assert r.steps_analysed == [0, 1, 2, 3, 5]
    assert sorted(r.step_slowdown) == [0, 1, 2, 3, 5]
    assert finding(r, "communication").where.steps == [1]


def test_a_slow_link_with_no_healthy_link_to_compare_says_so():
    # a two-stage pipeline has one link: slow in steps 2 and 5, it is found, and the evidence
    # says a congested network and late-waking hosts look the same in such a trace
    alone = generate(dp=1, pp=2, microbatches=8, steps=8, seed=3, slow_link={
        "kind": "p2p", "dp": 0, "stage_from": 0, "stage_to": 1, "factor": 20, "steps": [2, 5]})
    f = finding(analyze(alone), "communication")
    assert f.where.steps == [2, 5]
    assert "no healthy link to compare with" in f.evidence, f.evidence
    # one slow link among several: located, no such caveat
    located = generate(dp=2, pp=4, microbatches=8, steps=8, seed=3, slow_link={
        "kind": "p2p", "dp": 1, "stage_from": 1, "stage_to": 2, "factor": 20})
    f = finding(analyze(located), "communication")
    assert f.where.pp == [1, 2] and "no healthy link" not in f.evidence


def _with_cpu_wait(trace, fraction):
    """The trace with cpu_wait on its p2p rows: `fraction` of each slow transfer's time beyond
    the median (as if the threads carrying it waited that long for a CPU), 0 on the others."""
    from stragglers.trace.model import OPTYPE_CODES as C, P2P_OPTYPES

    ops = dict(trace.ops)
    p2p = np.isin(ops["optype"], [C[o] for o in P2P_OPTYPES])
    median = np.median(ops["duration"][p2p])
    slow = p2p & (ops["duration"] > 2 * median)
    ops["cpu_wait"] = np.where(slow, fraction * (ops["duration"] - median),
                               np.where(p2p, 0.0, np.nan))
    return Trace(ops, trace.meta)


def test_a_slow_link_its_threads_waited_for_a_cpu_is_cpu_contention():
    link = generate(dp=2, pp=4, microbatches=8, steps=8, seed=3, slow_link={
        "kind": "p2p", "dp": 1, "stage_from": 1, "stage_to": 2, "factor": 20})
    # no waits measured during the slow transfers: the link itself is slow
    comm = finding(analyze(_with_cpu_wait(link, 0.0)), "communication")
    assert comm.where.pp == [1, 2] and "0% of their lateness" in comm.evidence
    # the threads that carried them waited for a CPU the whole time: a busy host, not the link
    r = analyze(_with_cpu_wait(link, 1.0))
    assert "communication" not in causes(r), r.diagnosis
    f = finding(r, "cpu_contention")
    assert f.where.pp == [1, 2] and "not a slow link" in f.evidence, f.evidence
    # the same transfers at their median: the same prediction, another remedy
    assert f.speedup_if_fixed == pytest.approx(comm.speedup_if_fixed) and "core" in f.fix
    # traces without the column (other formats, older runs) read as before
    assert "communication" in causes(analyze(link))


def test_sweep_contention_explains():
    import re

    link = _with_cpu_wait(generate(dp=2, pp=4, microbatches=8, steps=8, seed=3, slow_link={
        "kind": "p2p", "dp": 1, "stage_from": 1, "stage_to": 2, "factor": 20}), 0.25)
    comm = finding(analyze(link, config=DiagnosisConfig(contention_explains=1.0)),
                   "communication")
    share = int(re.search(r"(\d+)% of their lateness", comm.evidence).group(1)) / 100
    assert 0.2 < share < 0.9, comm.evidence  # both ends' waits: a quarter each, about half
    for threshold, expected in ((share - 0.1, "cpu_contention"), (share + 0.1, "communication")):
        r = analyze(link, config=DiagnosisConfig(contention_explains=threshold))
        assert expected in causes(r) and len(
            {"cpu_contention", "communication"} & set(causes(r))) == 1, (threshold, causes(r))


@pytest.mark.parametrize("seed", range(100, 108))
def test_a_small_but_established_worker_fault_is_named(seed):
    # A ×1.25 worker on the first stage of dp 8 × pp 4 with 10% op noise costs the job only
    # ×1.035–1.06: its gain's interval over 10 steps can start under min_gain (seeds 101 and
    # 103: 1.023, 1.030), which made the job "unexplained" although the worker is an outlier
    # among 32 by far. The outlier test establishes it; the gain needs only to be real (> 1)
    # and relevant (>= min_gain).
    trace = generate(dp=8, pp=4, microbatches=8, steps=10, seed=seed, noise=0.1,
                     slow_worker=(7, 0, 1.25))
    impact = trace.meta.extra["ground_truth"][0]["impact"]
    result = analyze(trace)
    assert [f.cause for f in result.diagnosis] == ["worker_fault"], result.diagnosis
    finding = result.diagnosis[0]
    assert finding.where.dp == [7] and finding.where.pp == [0]
    assert abs(finding.speedup_if_fixed / impact - 1) < 0.02
    assert finding.interval.low > 1.0


def test_only_an_established_candidate_clears_on_its_point_gain():
    from stragglers.whatif.causes.base import Candidate
    from stragglers.whatif.diagnosis import _clears

    cfg = DiagnosisConfig()
    plain = Candidate("worker_fault", {}, "")
    established = Candidate("worker_fault", {}, "", established=True)
    assert _clears(plain, 1.04, 1.031, cfg) and _clears(established, 1.04, 1.031, cfg)
    assert not _clears(plain, 1.04, 1.02, cfg)       # a 2- or 4-worker job: no outlier test
    assert _clears(established, 1.04, 1.02, cfg)
    assert not _clears(established, 1.02, 1.01, cfg)  # not worth fixing
    assert not _clears(established, 1.04, 0.99, cfg)  # not surely a gain
