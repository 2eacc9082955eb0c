"""A slow group beside slow ranks of its own: who is a member, and what each fix is priced at.

From diagnosis_slow_group_stages (seeds 2 and 3, jobs rebuilt here as it draws them): a member
below a slower rank of its stage of four was no member; a member beside a rank of its stage
slowed ×1.3 its factor took the rank in; a rank on a stage behind the group's bought ×1.004
once the group was re-split (its stage still at the workers' summed speed) and was not named;
a re-split that took a stage's lone slow rank in made that rank's own fix explain the group.
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


def _members(found) -> dict[int, list[int]]:
    return {p: [int(d) for d in np.flatnonzero(slow)] for p, (slow, _) in found.items()}


def test_a_member_below_a_slower_rank_on_a_stage_of_four_joins_the_group():
    # stage 0: worker 0 ×1.37 (a member) under worker 2 ×1.94; stage 1: worker 3 ×1.38. The
    # widest gap lay above the member, and one worker above three "fast" ones split no more
    found = _groups(_busy({(0, 0): 1.37, (2, 0): 1.94, (3, 1): 1.38}), DiagnosisConfig())
    assert _members(found) == {0: [0], 1: [3]}


def test_a_member_left_among_the_fast_after_the_peel_joins_its_stage_mate():
    # stage 0 of five: workers 1, 2 ×1.28 (members) and 0 ×1.76; stage 1: 0, 3 ×1.30. The peel
    # of the fast side stops with three left, and took one member only
    found = _groups(_busy({(0, 0): 1.76, (1, 0): 1.28, (2, 0): 1.28, (0, 1): 1.30,
                           (3, 1): 1.30}, d=5), DiagnosisConfig())
    assert _members(found) == {0: [1, 2], 1: [0, 3]}


def test_a_stage_mate_unlike_the_members_of_other_stages_is_no_member():
    # stage 2: workers 1 ×1.85 and 2 ×2.41, alike within half the gap below them; stage 1:
    # worker 0 ×1.85. The other stage sides with 1
    found = _groups(_busy({(0, 1): 1.85, (1, 2): 1.85, (2, 2): 2.41}, p=3),
                    DiagnosisConfig())
    assert _members(found) == {1: [0], 2: [1]}


def test_stage_mates_alike_stay_members_whatever_other_stages_show():
    # the group's factor may differ by stage (their work differs): stage 1's member ×1.8
    # stands apart from stage 2's two ×2.0, but has no stage-mate alike the rest, and stays
    found = _groups(_busy({(0, 1): 1.8, (1, 2): 2.0, (2, 2): 2.02}, p=3), DiagnosisConfig())
    assert _members(found) == {1: [0], 2: [1, 2]}


def _named(tmp_path, job: GpuJob) -> set[tuple[str, int]]:
    write_gpu_job(job, tmp_path)
    return {(f.cause, int(w.rank)) for f in analyze(load_trace(tmp_path)).diagnosis
            for w in f.where.workers or []}


SHAPE = dict(first_step=10, all_to_alls=0, forward_us=4000.0, backward_us=8000.0,
             clock_offset_us=300.0)


@pytest.mark.slow
@pytest.mark.parametrize("job, want", [
    (GpuJob(ranks=12, steps=8, seed=200038, buckets=4, jitter=0.012967636168023065,
            ranks_per_host=12, host_jitter_us=369.5899737655436, pp_size=3, microbatches=3,
            tp_size=2, slow_rank=(7, 1.2390156098284602),
            slow_group=((0, 2, 11), 2.0586045620660904), **SHAPE),
     {("slow_group", 0), ("slow_group", 2), ("slow_group", 11), ("worker_fault", 7)}),
    (GpuJob(ranks=12, steps=7, seed=200211, buckets=2, jitter=0.022605107493827027,
            ranks_per_host=12, host_jitter_us=113.36245294464105, pp_size=3, microbatches=2,
            tp_size=2, slow_rank=(10, 2.4405357353299713),
            slow_group=((4, 9), 1.8694917039837708), **SHAPE),
     {("slow_group", 4), ("slow_group", 9), ("worker_fault", 10)}),
    (GpuJob(ranks=12, steps=4, seed=300147, buckets=6, jitter=0.0186795127128831,
            ranks_per_host=12, host_jitter_us=100.32762185019494, pp_size=3, microbatches=4,
            tp_size=2, slow_rank=(2, 1.689176207046564),
            slow_group=((1, 10), 1.1633257576786376), **SHAPE),
     {("slow_group", 1), ("slow_group", 10), ("worker_fault", 2)}),
], ids=["a rank behind the group's stage (seed 2 job 38)",
        "a rank x1.3 the group's beside a member (seed 2 job 211)",
        "a group x1.16 beside a rank x1.69 of its stage (seed 3 job 147)"])
def test_the_group_and_the_rank_beside_it_are_both_named(tmp_path, job, want):
    assert _named(tmp_path, job) == want
