"""The diagnosis holds a fix as the rows it changes and replays by step slices (issue 32: 10⁸ ops
in 8 GB): the same numbers, without a copy of the job's grid per candidate."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from stragglers.trace.synth import generate
from stragglers.whatif import analyze, analyze_with_model
from stragglers.whatif import diagnosis
from stragglers.whatif.causes.base import Rows
from stragglers.whatif.diagnosis import diagnose

# Three causes at once (heavy stage, slow worker, GC pauses): every candidate, the fixes
# combined and each one tried after the others, on a grid of many template ops.
JOB = dict(dp=8, pp=4, microbatches=32, steps=20, seed=6, gc=(0.05, 0.1),
           slow_worker=(0, 2, 1.4), heavy_last_stage=1.3)


def test_rows_of_a_fix_are_the_rows_it_changes():
    base = np.arange(24, dtype=float).reshape(4, 3, 2)
    base[1, 0, 0] = np.nan
    fixed = base.copy()
    fixed[2, 1, 1] = -1.0
    rows = Rows.of(fixed, base)
    assert rows.nodes.tolist() == [2]          # NaN equal to NaN: row 1 is unchanged
    np.testing.assert_array_equal(rows.whole(base), fixed)
    np.testing.assert_array_equal(rows.steps(base, slice(1, 2)), fixed[:, :, 1:2])
    assert rows.at(np.array([False, False, True, False])).tolist() == [0]


@pytest.mark.slow
def test_diagnosis_by_one_step_slices_is_the_same(monkeypatch):
    trace = generate(**JOB)
    whole = analyze(trace)
    monkeypatch.setattr(diagnosis, "CHUNK_BYTES", 1)      # every replay a step at a time
    sliced = analyze(trace)
    assert [f.cause for f in whole.diagnosis] == ["stage_imbalance", "worker_fault", "gc"]
    assert json.loads(sliced.to_json())["diagnosis"] == json.loads(whole.to_json())["diagnosis"]
    assert sliced.diagnosis_summary == whole.diagnosis_summary


def test_the_diagnosis_holds_no_grid_copy_per_candidate():
    trace = generate(**JOB)
    _, w = analyze_with_model(trace)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        findings, _ = diagnose(w, trace)
        peak = tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()
    assert len(findings) == 3
    # a copy of the cost grid per candidate, and three more to combine them, took 8.2 grids
    # here; a candidate now holds its rows, and a replay a step slice (2.6 grids)
    assert peak < 4 * w.cost.nbytes, peak / w.cost.nbytes


def test_bootstrap_means_a_row_at_a_time_are_the_same(monkeypatch):
    from stragglers.whatif import confidence
    from stragglers.whatif.config import DiagnosisConfig

    values = np.random.default_rng(3).lognormal(size=(6, 4, 9))
    cfg = DiagnosisConfig()
    whole = confidence.mean_interval(values, cfg)
    monkeypatch.setattr(confidence, "_RESAMPLE_BYTES", 1)    # one row's resamples at a time
    rows = confidence.mean_interval(values, cfg)
    idx = confidence.step_resamples(values.shape[-1], cfg)
    tail = 100 * (1 - cfg.confidence) / 2
    direct = np.percentile(values[..., idx].mean(axis=-1), [tail, 100 - tail], axis=-1)
    for got in (whole, rows):
        np.testing.assert_array_equal(got[0], direct[0])
        np.testing.assert_array_equal(got[1], direct[1])


def test_restored_replays_share_one_buffer_and_leave_it_ideal():
    import pickle

    from stragglers.whatif.partitioned import ReplayShard, Scratch, shard_replay

    trace = generate(**JOB)
    _, w = analyze_with_model(trace)
    shared = Scratch()
    halves = [ReplayShard(w.plan, w.cost[:, :, sl], w.launch_delay[:, :, sl], w.ideal,
                          w.step_start[sl], shared) for sl in (slice(0, 10), slice(10, 20))]
    stage = w.grid.node_stage == 1
    for nodes in (stage, ~stage, stage):
        got = np.concatenate([shard_replay(s, "restored", nodes) for s in halves])
        np.testing.assert_array_equal(got, _restored(w, nodes))
    assert shared.buffer is not None and shared.buffer.shape == halves[1].cost.shape
    np.testing.assert_array_equal(shared.buffer, np.broadcast_to(w.ideal, shared.buffer.shape))
    again = pickle.loads(pickle.dumps(halves[0]))      # the buffer never travels
    assert again.scratch.buffer is None and again.scratch is not shared


def _restored(w, nodes):
    """Per-step times of the ideal costs with `nodes` measured, the whole job at once."""
    from stragglers.whatif._replay import replay

    cost = np.broadcast_to(w.ideal, w.cost.shape).copy()
    cost[nodes] = w.cost[nodes]
    return replay(w.plan, cost, w.step_start)
