"""One microbatch of a step far longer than a worker's others is no slow worker.

diagnosis_combinations --wide --no-seq-lens seed 1 job 6 (dp 64 × pp 1, generated as it
generates it): GC pauses inside compute, and on rank 14 one microbatch's forward and backward
both paused in steps 1 and 6. The pause test reads a microbatch lengthened on both its ops as
long sequences (they scale both), so those pauses stayed, and rank 14 was named worker_fault
×1.06 "in steps 1, 6". A slow device stretches every microbatch it computes: judged with each
step's longest microbatch at its median one, rank 14 is as fast as its peers. Only in steps
where that microbatch is sporadic for the worker, though: one microbatch slower in every step
(a deterministic GC pause, a slow data-dependent path) is the worker's own, and was not named
when every step's longest microbatch was taken off.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import stragglers.trace.synth._generate as synth
from stragglers.trace.synth import generate
from stragglers.whatif import analyze

JOB: dict[str, Any] = dict(dp=64, pp=1, vpp=1, microbatches=8, steps=8, seed=1006, noise=0.05, sync="ddp",
           seq_imbalance={"dist": "uniform"},
           gc_in_compute=(0.6087111075732264, 0.2382575519255445))


def _found(**extra) -> dict:
    trace = generate(**JOB, **extra)
    for column in ("attn_cost", "tokens"):      # as NDTimeline and profiler traces come
        trace.ops.pop(column, None)
    return {f.cause: f for f in analyze(trace).diagnosis}


@pytest.mark.slow
def test_a_microbatch_paused_on_both_its_ops_names_no_worker():
    found = _found()
    assert "worker_fault" not in found, found["worker_fault"].evidence
    assert "gc" in found


@pytest.mark.slow
def test_a_slow_worker_among_the_same_pauses_is_still_named():
    found = _found(slow_worker=(14, 0, 1.3))
    assert [(w.dp, w.pp) for w in found["worker_fault"].where.workers] == [(14, 0)]


def _one_microbatch_slower(monkeypatch, dp: int, stage: int, mb: int, factor: float = 1.0,
                           add: float = 0.0) -> None:
    """The generator's sampled costs, with worker (dp, stage)'s microbatch `mb` (its forward
    and backward) ×factor + add seconds in every step: no synth option makes one microbatch
    of one worker slow, and the schedule is replayed from these costs as from any others."""
    sample = synth.sample_costs

    def costs(sched, job):
        out = sample(sched, job)
        rows = [n.id for n in sched.nodes if n.optype in ("forward-compute", "backward-compute")
                and n.stage == stage and n.mb == mb]
        cols = np.flatnonzero(np.tile(np.arange(job.dp), job.steps) == dp)
        out.duration[np.ix_(rows, cols)] = out.duration[np.ix_(rows, cols)] * factor + add
        return out

    monkeypatch.setattr(synth, "sample_costs", costs)


def _named(**job) -> list[tuple[int, int]]:
    found = {f.cause: f for f in analyze(generate(**job)).diagnosis}
    assert "worker_fault" in found, [(f.cause, f.evidence) for f in found.values()]
    return [(w.dp, w.pp) for w in found["worker_fault"].where.workers]


SMALL: dict[str, Any] = dict(vpp=1, steps=8, noise=0.05, sync="ddp")


@pytest.mark.parametrize("seed", [1, 2])
def test_one_microbatch_twice_as_long_in_every_step_is_the_worker(monkeypatch, seed):
    _one_microbatch_slower(monkeypatch, dp=3, stage=0, mb=0, factor=2.0)
    assert _named(dp=8, pp=1, microbatches=4, seed=seed, **SMALL) == [(3, 0)]


def test_one_microbatch_steadily_longer_in_every_step_is_the_worker(monkeypatch):
    _one_microbatch_slower(monkeypatch, dp=3, stage=0, mb=1, add=0.15)
    assert _named(dp=8, pp=1, microbatches=4, seed=1, **SMALL) == [(3, 0)]


def test_three_microbatches_one_longer_in_every_step(monkeypatch):
    _one_microbatch_slower(monkeypatch, dp=3, stage=0, mb=0, factor=1.8)
    assert _named(dp=8, pp=1, microbatches=3, seed=1, **SMALL) == [(3, 0)]


def test_one_microbatch_longer_in_every_step_on_a_pipeline_stage(monkeypatch):
    _one_microbatch_slower(monkeypatch, dp=1, stage=1, mb=0, factor=2.0)
    assert _named(dp=4, pp=2, microbatches=4, seed=1, **SMALL) == [(1, 1)]
