"""A slow group spanning pipeline stages is one `slow_group` with all its ranks.

A slow node or rack slows its workers alike whatever stage they hold; where it holds one
worker of a stage, that worker alone is its stage's outlier. It was named `worker_fault` there
and `slow_group` on the stage holding two or more (18 of 69 hand-made ring-attention × PP
jobs), or `worker_fault` on both stages when each held one.
"""

from __future__ import annotations

import numpy as np
import pytest
from possible_traces import busy as _busy

from stragglers.trace.load import load_trace
from stragglers.trace.synth.kineto import GpuJob, write_gpu_job
from stragglers.whatif import analyze
from stragglers.whatif.causes.capacity import _groups
from stragglers.whatif.config import DiagnosisConfig


def _named(tmp_path, job: GpuJob) -> set[tuple[str, int]]:
    write_gpu_job(job, tmp_path)
    return {(f.cause, int(w.rank)) for f in analyze(load_trace(tmp_path)).diagnosis
            for w in f.where.workers or []}


# (grid, its shape, the group's ranks): stage 0 holds ranks 0..per-1
GRIDS = {
    "dp 4 x pp 2, one member on stage 1": (dict(ranks=8), (0, 2, 5)),
    "dp 3 x pp 3, one member on each of two stages": (dict(ranks=9, pp_size=3), (1, 7)),
    "tp 2 x dp 2 x pp 2, one member on stage 0": (dict(ranks=8, tp_size=2), (1, 5, 6)),
    "ring cp 2 x dp 2 x pp 2, one member on each stage": (
        dict(ranks=8, cp_size=2, cp_comm="ring"), (3, 6)),
    "ring cp 4 x pp 2, one member on stage 1": (dict(ranks=8, cp_size=4, cp_comm="ring"),
                                                 (0, 3, 6)),
}


@pytest.mark.slow
@pytest.mark.parametrize("grid", sorted(GRIDS))
def test_a_group_over_two_stages_is_one_slow_group(tmp_path, grid):
    shape, group = GRIDS[grid]
    shape = {"pp_size": 2, **shape}
    job = GpuJob(steps=6, seed=7, microbatches=3, ranks_per_host=shape["ranks"],
                 host_jitter_us=200.0, slow_group=(group, 2.0), **shape)
    assert _named(tmp_path, job) == {("slow_group", r) for r in group}


@pytest.mark.slow
def test_a_slow_rank_unlike_the_group_stays_a_worker_fault(tmp_path):
    # the group ×2.5 holds rank 0 of stage 0 and rank 5 of stage 1, rank 9 of stage 2 is
    # ×1.4: three lone outliers of their stages, two of them alike
    job = GpuJob(ranks=12, pp_size=3, microbatches=3, steps=6, seed=3, ranks_per_host=12,
                 slow_group=((0, 5), 2.5), slow_rank=(9, 1.4))
    assert _named(tmp_path, job) == {("slow_group", 0), ("slow_group", 5), ("worker_fault", 9)}


def test_lone_slow_workers_of_two_stages_slowed_alike_are_one_group():
    found = _groups(_busy({(1, 0): 2.0, (3, 1): 2.05}), DiagnosisConfig())
    assert {p: list(np.flatnonzero(slow)) for p, (slow, _) in found.items()} == {0: [1], 1: [3]}


def test_lone_slow_workers_slowed_unlike_stay_faults_of_their_own():
    # ×1.3 and ×2.5: each its stage's outlier (worker_fault's), no group
    assert _groups(_busy({(1, 0): 1.3, (3, 1): 2.5}), DiagnosisConfig()) == {}


def test_of_three_lone_slow_workers_the_two_alike_are_the_group():
    found = _groups(_busy({(0, 0): 2.5, (2, 1): 2.45, (1, 2): 1.4}, p=3), DiagnosisConfig())
    assert {p: list(np.flatnonzero(slow)) for p, (slow, _) in found.items()} == {0: [0], 1: [2]}


def test_a_lone_slow_worker_unlike_the_other_stages_group_is_left_out():
    found = _groups(_busy({(0, 0): 2.5, (1, 0): 2.5, (3, 1): 1.3}), DiagnosisConfig())
    assert {p: list(np.flatnonzero(slow)) for p, (slow, _) in found.items()} == {0: [0, 1]}


def test_one_slow_worker_in_the_whole_job_is_no_group():
    assert _groups(_busy({(2, 1): 2.0}), DiagnosisConfig()) == {}


@pytest.mark.parametrize("seed", range(20))
def test_noise_alone_makes_no_group_over_stages(seed):
    # three stages of five workers, 5% noise over 6 steps: lone "outliers" of chance
    assert _groups(_busy({}, d=5, p=3, t=6, noise=0.05, seed=seed), DiagnosisConfig()) == {}


def test_a_lone_worker_slowed_in_alternate_steps_is_not_alike_a_steady_group():
    # stage 0: two workers ×1.5 in every step; stage 1: one ×1.2 on even steps and ×1.9 on
    # odd ones (its median ×1.5 like theirs): chance pauses, not the group's device
    busy = _busy({(0, 0): 1.5, (1, 0): 1.5}, d=5)
    busy[3, 1, 0::2] *= 1.2
    busy[3, 1, 1::2] *= 1.9
    found = _groups(busy, DiagnosisConfig())
    assert {p: list(np.flatnonzero(slow)) for p, (slow, _) in found.items()} == {0: [0, 1]}


def test_a_slow_worker_without_seq_lens_is_no_group_with_its_pipeline_peers_mirror():
    # Without Σs² a DP rank's sequence load is read from its other stages: the slow worker
    # (4, 0) makes its stage-1 peer read ×0.44 and the other seven of stage 1 a "group" at
    # its level, which took it in (diagnosis_combinations --wide --no-seq-lens seed 4 job 157)
    from stragglers.trace.synth import generate

    trace = generate(dp=8, pp=2, vpp=1, microbatches=8, steps=8, seed=1157, noise=0.02,
                     sync="zero", seq_imbalance={"dist": "uniform"},
                     slow_worker=(4, 0, 2.260516513580031))
    for column in ("attn_cost", "tokens"):
        trace.ops.pop(column, None)
    named = {(f.cause, w.dp, w.pp) for f in analyze(trace).diagnosis
             for w in f.where.workers or []}
    assert ("worker_fault", 4, 0) in named and not any(c == "slow_group" for c, *_ in named)


def test_a_group_holding_all_but_one_worker_of_a_stage_takes_in_its_lone_member():
    # stage 0: workers 0, 1, 3 ×2 beside one fast worker (2); stage 1: worker 3 ×2 alone. The
    # fast group of one measured the group's level as well as two would: the lone member was
    # left a worker fault (diagnosis_slow_group_stages seed 1: 8 of 138 groups)
    found = _groups(_busy({(0, 0): 2.0, (1, 0): 2.0, (3, 0): 2.0, (3, 1): 2.05}),
                    DiagnosisConfig())
    assert {p: list(np.flatnonzero(slow)) for p, (slow, _) in found.items()} == {
        0: [0, 1, 3], 1: [3]}


def test_one_fast_worker_made_by_the_load_estimate_anchors_no_group():
    # the mirror: the load estimate from a slow worker's (4, 0) other stage makes its stage-1
    # peer read ×0.44 and the other seven a "group" at its level; measured before the
    # estimate, stage 1 holds no such group, and the slow worker stays alone
    busy = _busy({(4, 0): 2.26}, d=8)
    measured = busy.copy()
    busy[4, 1] /= 2.26
    found = _groups(busy, DiagnosisConfig(), measured=measured)
    assert 0 not in found
    assert _groups(busy, DiagnosisConfig())[0][0].tolist() == [i == 4 for i in range(8)]


@pytest.mark.slow
@pytest.mark.parametrize("shape, group", [
    (dict(ranks=8, cp_size=4, cp_comm="ring"), (0, 1, 3, 7)),
    (dict(ranks=8), (2, 4, 6, 7)),
    (dict(ranks=9, pp_size=3), (0, 4, 5)),
], ids=["ring cp 4, three of stage 0", "dp 4, three of stage 1", "dp 3 x pp 3, two of three"])
def test_a_spanning_group_holding_all_but_one_of_a_stage_is_one_slow_group(tmp_path, shape,
                                                                           group):
    shape = {"pp_size": 2, **shape}
    job = GpuJob(steps=6, seed=7, microbatches=3, ranks_per_host=shape["ranks"],
                 host_jitter_us=200.0, all_to_alls=0, slow_group=(group, 2.0), **shape)
    assert _named(tmp_path, job) == {("slow_group", r) for r in group}


def test_a_slow_rank_beside_the_group_on_its_stage_is_no_member():
    # stage 0: workers 0, 1 ×1.8 (the group) and 2 ×2.6, slowed unlike them; stage 1: worker
    # 4 ×1.8. Rank 2 was taken into the group, or the three were named faults one by one
    # (diagnosis_slow_group_stages seed 1: 24 of 67 such jobs)
    found = _groups(_busy({(0, 0): 1.8, (1, 0): 1.8, (2, 0): 2.6, (4, 1): 1.8}, d=6),
                    DiagnosisConfig())
    assert {p: list(np.flatnonzero(slow)) for p, (slow, _) in found.items()} == {
        0: [0, 1], 1: [4]}


def test_of_two_unlike_slow_workers_of_a_stage_the_one_alike_the_group_joins_it():
    # stage 0: worker 0 ×1.9 and 3 ×2.75; stage 1: worker 2 ×1.9 alone: 0 and 2 are the group,
    # 3 a fault of its own (it was a "group" of two with 0, and 2 left out)
    found = _groups(_busy({(0, 0): 1.9, (3, 0): 2.75, (2, 1): 1.9}), DiagnosisConfig())
    assert {p: list(np.flatnonzero(slow)) for p, (slow, _) in found.items()} == {
        0: [0], 1: [2]}


@pytest.mark.slow
@pytest.mark.parametrize("shape, group, fault", [
    (dict(ranks=12), (0, 4, 7, 9), (2, 2.7)),
    (dict(ranks=16, tp_size=2, cp_size=2, cp_comm="ring"), (6, 10, 13), (12, 2.6)),
    (dict(ranks=8), (2, 4), (1, 2.8)),
], ids=["dp 6, the rank slower than the group", "ring cp 2 x tp 2, a pair and the rank",
        "dp 4, the rank and one member on stage 0"])
def test_a_group_beside_a_slow_rank_unlike_it_is_named_whole_and_alone(tmp_path, shape, group,
                                                                        fault):
    # the rank is worker_fault's, or nobody's where re-splitting its stage fixes it too
    job = GpuJob(steps=6, seed=7, microbatches=3, ranks_per_host=shape["ranks"], pp_size=2,
                 host_jitter_us=200.0, all_to_alls=0, slow_group=(group, 1.8), slow_rank=fault,
                 **shape)
    named = _named(tmp_path, job)
    assert {r for c, r in named if c == "slow_group"} == set(group)
    assert named - {("slow_group", r) for r in group} <= {("worker_fault", fault[0])}


@pytest.mark.slow
@pytest.mark.parametrize("group", [(1, 3), (0, 3)], ids=["one pipeline replica", "crosswise"])
def test_a_group_of_one_worker_of_each_stage_of_two_is_one_slow_group(tmp_path, group):
    # dp 2 × pp 2: each stage's slower worker, slowed alike; named two worker faults (5 of 243
    # slow groups of diagnosis_gpu_traces seeds 1 and 2 once it drew groups in pipelines)
    job = GpuJob(ranks=4, pp_size=2, steps=6, seed=7, microbatches=3, ranks_per_host=4,
                 host_jitter_us=200.0, all_to_alls=0, slow_group=(group, 2.2))
    assert _named(tmp_path, job) == {("slow_group", r) for r in group}


@pytest.mark.slow
def test_one_slow_worker_of_a_stage_of_two_stays_a_worker_fault(tmp_path):
    job = GpuJob(ranks=4, pp_size=2, steps=6, seed=7, microbatches=3, ranks_per_host=4,
                 host_jitter_us=200.0, all_to_alls=0, slow_rank=(2, 2.2))
    assert _named(tmp_path, job) == {("worker_fault", 2)}


def test_a_member_below_a_slower_rank_of_its_stage_still_joins_the_group():
    # stage 0 of eight: worker 0 ×1.36 (the group) and 6 ×2.0, slowed unlike it: the widest
    # gap lies above the member, which sat among the fast ones; stage 1: worker 1 ×1.36
    found = _groups(_busy({(0, 0): 1.36, (6, 0): 2.0, (1, 1): 1.36}, d=8), DiagnosisConfig())
    assert {p: list(np.flatnonzero(slow)) for p, (slow, _) in found.items()} == {
        0: [0], 1: [1]}


@pytest.mark.slow
@pytest.mark.parametrize("shape", [dict(cp_size=4, cp_comm="ring"), dict(tp_size=2), {}],
                         ids=["ring cp 4", "tp 2", "dp 4"])
def test_a_slow_rank_on_a_stage_holding_no_member_is_a_worker_fault(tmp_path, shape):
    # pp 3 of four ranks a stage: the group holds two of stage 1 and one of stage 2, rank 2
    # of stage 0 is ×2. The members lifted their stage peers' reference (those read ×0.67)
    # and, with them, widened the outlier test's spread: rank 2 stood 4 deviations out, and
    # only the group was named (diagnosis_slow_group_stages seed 2, jobs 149 and 210)
    job = GpuJob(ranks=12, pp_size=3, steps=6, seed=1, microbatches=3, ranks_per_host=12,
                 host_jitter_us=200.0, slow_group=((6, 7, 11), 1.5), slow_rank=(2, 2.0),
                 **shape)
    assert _named(tmp_path, job) == {("slow_group", 6), ("slow_group", 7), ("slow_group", 11),
                                     ("worker_fault", 2)}


@pytest.mark.slow
def test_a_stage_held_whole_by_the_group_reads_as_a_heavy_stage_or_slow_devices(tmp_path):
    # the group holds two of stage 0 and all of stage 1: no fast worker of stage 1 tells its
    # devices' speed from its work, so a trace shows a heavy stage; the finding says both
    job = GpuJob(ranks=16, pp_size=2, steps=6, seed=1, microbatches=3, ranks_per_host=16,
                 slow_group=((0, 1, *range(8, 16)), 1.6))
    write_gpu_job(job, tmp_path)
    found = {f.cause: f for f in analyze(load_trace(tmp_path)).diagnosis}
    assert {int(w.rank) for w in found["slow_group"].where.workers} == {0, 1}
    heavy = found["stage_imbalance"]
    assert heavy.where.pp == [1]
    assert "devices are slow, as the slow group found on stage 0 is (1.5" in heavy.evidence


def test_two_members_below_a_slower_rank_of_their_stage_are_one_group_there():
    # stage 1 of eight: workers 2 and 7 ×1.36 (the group) and 4 ×1.96, slowed unlike them:
    # the widest gap lies above the pair, and each read as a lone slow worker, of which only
    # one per stage could join stage 0's member (diagnosis_slow_group_stages seed 3 job 3)
    found = _groups(_busy({(4, 0): 1.37, (2, 1): 1.36, (7, 1): 1.36, (4, 1): 1.96}, d=8),
                    DiagnosisConfig())
    assert {p: list(np.flatnonzero(slow)) for p, (slow, _) in found.items()} == {
        0: [4], 1: [2, 7]}


@pytest.mark.slow
def test_a_stage_held_whole_beside_one_member_elsewhere_names_that_worker_as_alike(tmp_path):
    # a slow node holding all of stage 1 and rank 3 of stage 0: no group to compare with (one
    # member beside the heavy stage), so the evidence names the worker slowed alike
    job = GpuJob(ranks=8, pp_size=2, steps=6, seed=1, microbatches=3, ranks_per_host=8,
                 slow_group=((3, 4, 5, 6, 7), 1.8))
    write_gpu_job(job, tmp_path)
    found = {f.cause: f for f in analyze(load_trace(tmp_path)).diagnosis}
    assert found["stage_imbalance"].where.pp == [1]
    assert "as slow as a worker of another stage against its peers ((dp 3, pp 0, rank 3) 1.7" \
        in found["stage_imbalance"].evidence


def test_a_group_below_a_slower_rank_of_its_stage_is_split_off_the_rest():
    # stage 0 of six: workers 0, 2, 3 ×1.32 (the group) and 1 ×1.87, slowed unlike them: the
    # widest gap lay above the group, which, the majority of the rest, stood out of it by no
    # outlier test; the slower rank was named a member (diagnosis_slow_group_stages seed 3
    # job 43)
    found = _groups(_busy({(0, 0): 1.32, (2, 0): 1.32, (3, 0): 1.32, (1, 0): 1.87,
                           (2, 1): 1.32, (3, 1): 1.32}, d=6), DiagnosisConfig())
    assert {p: list(np.flatnonzero(slow)) for p, (slow, _) in found.items()} == {
        0: [0, 2, 3], 1: [2, 3]}
