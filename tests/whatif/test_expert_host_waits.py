"""Expert imbalance on ranks whose experts run on host CPUs: where each expert piece carries its
run delay (`cpu_wait`: time runnable without a core, our recorder on CPU), the rows fit is made
on the rest, the piece's CPU time; the prediction is the one the durations give, as before.

Jobs are synthetic Kineto traces with a hot expert (stragglers.trace.synth.kineto); the tests
add the `cpu_wait` column on the expert compute, with known numbers, as our recorder writes it
on CPU (NaN on every other compute row).
"""

from __future__ import annotations

import numpy as np
import pytest

from stragglers.trace.load import load_trace
from stragglers.trace.synth.kineto import GpuJob, write_gpu_job
from stragglers.whatif import analyze
from stragglers.whatif.causes import experts
from stragglers.whatif.causes.base import Context
from stragglers.whatif.config import DiagnosisConfig
from stragglers.whatif.grid import build_grid
from stragglers.whatif.metrics import WhatIf


def _job(tmp_path, jitter: float, seed: int = 7):
    write_gpu_job(GpuJob(ranks=8, steps=6, seed=seed, all_to_alls=2, hot_expert=(2, 2.5),
                         jitter=jitter), tmp_path)
    return load_trace(tmp_path)


def _expert_cells(trace) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(rows received, durations, op-table rows) [D, T] of the compute after each dispatch."""
    g, ops = build_grid(trace), trace.ops
    out = []
    for n in np.flatnonzero(g.node_optype == experts.A2A):
        tok = experts._rows_received(g, ops["tokens"], int(n))
        e = experts._next_compute(g, int(n))
        out.append((tok, g.duration[e], g.row[e]))
    return out


def _load(trace):
    w = WhatIf.build(build_grid(trace))
    return experts.expert_load(Context.build(w, trace, DiagnosisConfig()), w.grid.duration)


def _corr(x: np.ndarray, y: np.ndarray) -> float:
    x, y = x - x.mean(axis=0, keepdims=True), y - y.mean(axis=0, keepdims=True)
    return float(np.corrcoef(x.ravel(), y.ravel())[0, 1])


def test_waits_for_a_core_are_left_out_of_the_rows_fit(tmp_path):
    """Kernels 30% noisy: the expert time follows the rows below the bar (correlation
    0.77-0.80) and no expert imbalance is found. Recorded as run delay, the time above each
    piece's rows × its median time per row leaves CPU time that follows the rows."""
    trace = _job(tmp_path, jitter=0.3)
    cells = _expert_cells(trace)
    bar = DiagnosisConfig().expert_corr
    assert max(_corr(tok, dur) for tok, dur, _ in cells) < bar
    assert _load(trace) is None
    wait = np.full(len(trace.ops["rank"]), np.nan)
    for tok, dur, rows in cells:
        wait[rows] = np.maximum(dur - np.median(dur / tok) * tok, 0)
    trace.ops["cpu_wait"] = wait
    load = _load(trace)
    assert load is not None and load.host is not None
    for k, (n, e) in enumerate(load.pairs):
        tok, dur, rows = next(c for c in cells if np.array_equal(c[2], build_grid(trace).row[e]))
        assert load.corr[k] == pytest.approx(_corr(tok, dur - wait[rows]), abs=1e-9)
        assert load.corr[k] >= bar
    total = sum(float(c[1].sum()) for c in cells)
    assert load.host.share == pytest.approx(sum(float(wait[c[2]].sum()) for c in cells) / total)
    # the hot expert's rank is the one named
    rel = (load.rows / load.mean).mean(axis=(0, 2))
    assert int(np.argmax(rel)) == 2


def test_recorded_waits_leave_the_prediction_as_the_durations_give_it(tmp_path):
    trace = _job(tmp_path, jitter=0.02)
    before = analyze(trace).diagnosis[0]
    wait = np.full(len(trace.ops["rank"]), np.nan)
    for _, dur, rows in _expert_cells(trace):
        wait[rows] = 0.25 * dur
    trace.ops["cpu_wait"] = wait
    after = analyze(trace).diagnosis[0]
    assert before.cause == after.cause == "expert_imbalance"
    assert after.speedup_if_fixed == pytest.approx(before.speedup_if_fixed, rel=1e-12)
    assert {c: v.speedup for c, v in after.capacity_factor.items()} == pytest.approx(
        {c: v.speedup for c, v in before.capacity_factor.items()}, rel=1e-12)
    assert "waited for a core 25% of its time" in after.evidence
    assert "waited for a core" not in before.evidence


def test_a_piece_without_its_wait_keeps_the_fit_on_durations(tmp_path):
    """Old runs (no column), GPU ranks and compute outside two collectives have NaN: the fit is
    on the durations, as before, unless every piece of that compute recorded its wait."""
    trace = _job(tmp_path, jitter=0.02)
    plain = _load(trace)
    wait = np.full(len(trace.ops["rank"]), np.nan)
    cells = _expert_cells(trace)
    for _, dur, rows in cells:
        wait[rows] = 0.5 * dur
    first_rows = cells[0][2]
    wait[first_rows[0, 0]] = np.nan
    trace.ops["cpu_wait"] = wait
    load = _load(trace)
    assert load.host is None
    k = [int(np.array_equal(build_grid(trace).row[e], first_rows)) for _, e in load.pairs].index(1)
    assert load.corr[k] == pytest.approx(plain.corr[k], abs=1e-12)
    np.testing.assert_allclose(load.slope, plain.slope, rtol=1e-12)
