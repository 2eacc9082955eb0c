"""Expert load imbalance (MoE): the rank receiving the most rows at the all-to-all dispatch is
named, its prediction matches a run with balanced routing, and balanced routing says none.

Jobs are synthetic Kineto traces (stragglers.trace.synth.kineto) read back by the Kineto
reader: the rows come from the all-to-alls' `Out split size`, as PyTorch's profiler writes it.
"""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest

from stragglers.trace.load import load_trace
from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.synth.kineto import GpuJob, write_gpu_job
from stragglers.whatif import analyze

from possible_traces import stretched


def _named(result) -> set[tuple[str, int]]:
    return {(f.cause, -1 if w is None else int(w.rank)) for f in result.diagnosis
            for w in f.where.workers or [None]}


def _mean_step(trace) -> float:
    ops = trace.ops
    ends = ops["start_ts"] + ops["duration"]
    return float(np.mean([ends[ops["step"] == s].max() - ops["start_ts"][ops["step"] == s].min()
                          for s in np.unique(ops["step"])]))


def test_the_rows_received_come_from_the_split_sizes(tmp_path):
    write_gpu_job(GpuJob(ranks=4, steps=3, seed=2, all_to_alls=1, hot_expert=(1, 3.0)), tmp_path)
    trace = load_trace(tmp_path)
    a2a = trace.ops["optype"] == OPTYPE_CODES["all-to-all"]
    rows = trace.ops["tokens"][a2a]
    ranks = trace.ops["rank"][a2a]
    assert (rows > 0).all() and (trace.ops["tokens"][~a2a] == -1).all()
    # each dispatch routes 4 × 4096 rows; the hot rank gets about 3/6 of them
    per_rank = {r: rows[ranks == r].mean() for r in range(4)}
    assert per_rank[1] == pytest.approx(4 * 4096 * 3 / 6, rel=0.05)
    assert sum(per_rank.values()) == pytest.approx(4 * 4096, rel=1e-9)


def test_the_rows_sent_come_from_the_in_split_sizes(tmp_path):
    """`In split size` gives the rows a rank sent: its own 4096 in a dispatch, and in the
    combine what its experts computed (the rows the dispatch before brought it)."""
    write_gpu_job(GpuJob(ranks=4, steps=3, seed=2, all_to_alls=1, hot_expert=(1, 3.0),
                         combine=True), tmp_path)
    ops = load_trace(tmp_path).ops
    a2a = ops["optype"] == OPTYPE_CODES["all-to-all"]
    assert (ops["sent"][~a2a] == -1).all() and (ops["sent"][a2a] > 0).all()
    for rank in range(4):
        mine = a2a & (ops["rank"] == rank)
        for step in np.unique(ops["step"][mine]):
            at = mine & (ops["step"] == step)
            order = np.argsort(ops["start_ts"][at])
            sent, received = ops["sent"][at][order], ops["tokens"][at][order]
            assert len(sent) == 2                       # the dispatch, then the combine
            assert sent[0] == 4096 and received[1] == 4096
            assert sent[1] == received[0]               # the experts' rows go back


@pytest.mark.parametrize("shape", [{}, {"expert_groups": 2}, {"tp_size": 2}],
                         ids=["one-group", "two-ep-groups", "tp2"])
def test_the_hot_expert_rank_is_named_and_not_as_a_slow_worker(tmp_path, shape):
    write_gpu_job(GpuJob(ranks=8, steps=5, seed=3, all_to_alls=2, hot_expert=(5, 3.0), **shape),
                  tmp_path)
    result = analyze(load_trace(tmp_path))
    assert _named(result) == {("expert_imbalance", 5)}
    finding = result.diagnosis[0]
    assert finding.upper_bound
    capacity = finding.capacity_factor
    speedups = [capacity[c].speedup for c in ("1", "1.25", "1.5", "2")]
    dropped = [capacity[c].dropped for c in ("1", "1.25", "1.5", "2")]
    assert speedups == sorted(speedups, reverse=True) and dropped == sorted(dropped, reverse=True)
    assert dropped[0] > 0


def test_the_prediction_matches_the_job_with_balanced_routing(tmp_path):
    """Run both: the same job with a hot expert and with balanced routing; the predicted gain
    is within 15% of the measured one."""
    hot, even = tmp_path / "hot", tmp_path / "even"
    write_gpu_job(GpuJob(ranks=8, steps=6, seed=7, all_to_alls=2, hot_expert=(2, 2.5)), hot)
    write_gpu_job(GpuJob(ranks=8, steps=6, seed=7, all_to_alls=2), even)
    hot_trace, even_trace = load_trace(hot), load_trace(even)
    finding = analyze(hot_trace).diagnosis[0]
    assert finding.cause == "expert_imbalance"
    measured = _mean_step(hot_trace) / _mean_step(even_trace) - 1
    predicted = finding.speedup_if_fixed - 1
    assert measured > 0.1
    assert abs(predicted - measured) <= 0.15 * measured


def test_balanced_routing_and_a_slow_gpu_are_not_expert_imbalance(tmp_path):
    even, slow = tmp_path / "even", tmp_path / "slow"
    write_gpu_job(GpuJob(ranks=8, steps=5, seed=4, all_to_alls=2), even)
    write_gpu_job(GpuJob(ranks=8, steps=5, seed=4, all_to_alls=2, slow_rank=(6, 1.5)), slow)
    assert _named(analyze(load_trace(even))) == {("none", -1)}
    assert _named(analyze(load_trace(slow))) == {("worker_fault", 6)}


def test_a_hot_expert_beside_a_slow_gpu_names_both(tmp_path):
    write_gpu_job(GpuJob(ranks=8, steps=6, seed=5, all_to_alls=2, hot_expert=(6, 2.0),
                         slow_rank=(2, 1.5)), tmp_path)
    assert _named(analyze(load_trace(tmp_path))) == {("worker_fault", 2), ("expert_imbalance", 6)}


def test_split_sizes_as_lists_or_text_and_bad_ones_ignored(tmp_path):
    write_gpu_job(GpuJob(ranks=4, steps=3, seed=2, all_to_alls=1, hot_expert=(0, 3.0)), tmp_path)
    path = tmp_path / "rank-0.json.gz"
    doc = json.loads(gzip.decompress(path.read_bytes()))
    first = None
    for e in doc["traceEvents"]:
        split = e.get("args", {}).get("Out split size")
        if split is not None:
            first = first or split
            e["args"]["Out split size"] = json.loads(split)      # a list, not its text
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    as_list = load_trace(tmp_path)
    for e in doc["traceEvents"]:
        if "Out split size" in e.get("args", {}):
            e["args"]["Out split size"] = ["x", 3]               # not whole numbers: no rows
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
    broken = load_trace(tmp_path)
    a2a = as_list.ops["optype"] == OPTYPE_CODES["all-to-all"]
    mine = a2a & (as_list.ops["rank"] == 0)
    assert (as_list.ops["tokens"][mine] > 0).all() and first is not None
    assert (broken.ops["tokens"][a2a & (broken.ops["rank"] == 0)] == -1).all()


def test_advise_prices_balanced_routing_as_the_diagnosis_does(tmp_path):
    from stragglers.advice.advisor import advise

    write_gpu_job(GpuJob(ranks=8, steps=6, seed=5, all_to_alls=2, hot_expert=(3, 3.0)), tmp_path)
    trace = load_trace(tmp_path)
    finding = analyze(trace).diagnosis[0]
    remedy = next(r for r in advise(trace).remedies if r.name == "expert-balancing")
    assert remedy.applies and remedy.details.where.ranks == [3]
    assert remedy.details.diagnosis_speedup == pytest.approx(finding.speedup_if_fixed)
    assert set(remedy.details.capacity_factor) == {"1", "1.25", "1.5", "2"}
    assert remedy.predicted_speedup > 1.1


def test_advise_refuses_expert_balancing_without_a_hot_expert(tmp_path):
    from stragglers.advice.advisor import advise

    write_gpu_job(GpuJob(ranks=4, steps=4, seed=1, all_to_alls=1), tmp_path)
    remedy = next(r for r in advise(load_trace(tmp_path)).remedies if r.name == "expert-balancing")
    assert not remedy.applies and "no expert load imbalance" in remedy.why_not


def test_a_dispatch_that_noise_pushed_below_the_bar_is_balanced_with_the_others(tmp_path):
    """Once one dispatch shows the imbalance, noise on the compute after another (its own
    correlation below expert_corr) neither drops that one nor makes the hot rank a slow
    worker."""
    from stragglers.whatif.causes import experts
    from stragglers.whatif.causes.base import Context
    from stragglers.whatif.config import DiagnosisConfig
    from stragglers.whatif.grid import build_grid
    from stragglers.whatif.metrics import WhatIf

    write_gpu_job(GpuJob(ranks=8, steps=6, seed=3, all_to_alls=2, hot_expert=(5, 3.0)), tmp_path)
    trace = load_trace(tmp_path)
    ops = trace.ops
    after_second = (ops["optype"] == OPTYPE_CODES["forward-compute"]) & (ops["seq_id"] == 2)
    noise = np.random.default_rng(0).normal(0, 9e-4, int(after_second.sum()))
    plus = np.zeros(len(ops["duration"]))
    plus[after_second] = np.abs(ops["duration"][after_second] + noise) \
        - ops["duration"][after_second]
    trace = stretched(trace, plus=plus)  # each rank's later ops pushed back by what it gained
    grid = build_grid(trace)
    ctx = Context.build(WhatIf.build(grid), trace, DiagnosisConfig())
    load = experts.expert_load(ctx, grid.duration)
    assert load is not None and len(load.pairs) == 2, load
    assert min(load.corr) < DiagnosisConfig().expert_corr <= max(load.corr)
    assert _named(analyze(trace)) == {("expert_imbalance", 5)}


def test_a_rank_that_received_no_rows_at_a_dispatch_leaves_it_priced(tmp_path):
    """A router may send an expert no token in a step (a learned router over 400 steps of our
    MoE example did, at one of its two layers): zero rows are rows. That dispatch was dropped,
    its expert compute left unexplained and the hot rank named a slow worker (×1.35) instead
    of expert_imbalance."""
    write_gpu_job(GpuJob(ranks=8, steps=6, seed=3, all_to_alls=2, hot_expert=(5, 3.0)), tmp_path)
    trace = load_trace(tmp_path)
    ops = trace.ops
    dispatches = np.flatnonzero(ops["optype"] == OPTYPE_CODES["all-to-all"])
    second = dispatches[(ops["rank"][dispatches] == 0) & (ops["seq_id"][dispatches] == 1)]
    assert len(second) == 6
    ops["tokens"][second[0]] = 0            # rank 0's expert got no token in one step
    assert _named(analyze(trace)) == {("expert_imbalance", 5)}
