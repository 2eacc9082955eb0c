"""Expert imbalance priced step by step: the load a step meets (CPU hogs, the scheduler, a
shared core's other thread) scales every rank's time per row in that step, and balanced routing
gives each rank its group's mean rows at that step's time per row, not at one slope of seconds
pooled over steps (causes/experts.py `_step_slopes`).

Jobs are synthetic Kineto traces with a hot expert (stragglers.trace.synth.kineto: an expert
piece takes its rank's rows × a time per row, 2% kernel noise); each step's expert pieces are
then scaled by that step's load factor, on every rank alike, as a loaded host does. The ground
truth of a balanced piece is then known: its measured time per row × its group's mean rows.
"""

from __future__ import annotations

import numpy as np
import pytest

from stragglers.trace.load import load_trace
from stragglers.trace.synth.kineto import GpuJob, write_gpu_job
from stragglers.whatif.causes import experts
from stragglers.whatif.causes.base import Context
from stragglers.whatif.config import DiagnosisConfig
from stragglers.whatif.grid import build_grid
from stragglers.whatif.metrics import WhatIf

from possible_traces import stretched

# a step's time per row ×0.5-1.5 of the run's: the hot rank beside CPU hogs ran 4.4-23 µs per
# row from step to step (tests/data/recorded/moe-hot-expert-beside-hogs)
LOADS = (1.0, 0.5, 1.5, 0.7, 1.2, 0.6, 1.0, 1.4)


def _context(trace) -> Context:
    w = WhatIf.build(build_grid(trace))
    return Context.build(w, trace, DiagnosisConfig())


def _loaded_job(tmp_path, seed: int):
    """A hot expert (rank 2 three times as likely a destination) whose expert pieces meet each
    step's load factor in LOADS."""
    write_gpu_job(GpuJob(ranks=4, steps=len(LOADS), seed=seed, all_to_alls=2,
                         hot_expert=(2, 3.0), jitter=0.02), tmp_path)
    trace = load_trace(tmp_path)
    g = build_grid(trace)
    load = _context(trace).expert_load
    scale = np.ones(len(trace.ops["duration"]))
    for _, e in load.pairs:
        cells = g.row[e]                                                  # [D, T] op rows
        scale[cells] = np.broadcast_to(np.array(LOADS)[None, :], cells.shape)
    return stretched(trace, scale)       # each rank's later ops pushed back by what it gained


@pytest.mark.parametrize("seed", [3, 4])
def test_balanced_pieces_meet_their_steps_load(tmp_path, seed):
    trace = _loaded_job(tmp_path, seed)
    ctx = _context(trace)
    load = ctx.expert_load
    assert load is not None and len(load.pairs) == 2
    fixed = experts.balanced_costs(load, ctx.w.cost)
    for k, (_, e) in enumerate(load.pairs):
        measured = ctx.w.cost[e]
        truth = measured / load.rows[k] * load.mean[k]                   # its own time per row
        # a slope of seconds pooled over the steps priced the hot rank's balanced piece at
        # 0-9% of this in the ×0.5 step, 36-60% in the ×0.6-0.7 ones and 1.28-1.35× in the
        # ×1.5 one (within 3% now)
        np.testing.assert_allclose(fixed[e], truth, rtol=0.1)
        # the step's time per row, whatever its load: the rows' share of the compute is fitted
        per_row = (measured / load.rows[k]).mean(axis=0)                 # [T]
        np.testing.assert_allclose(load.step_slope[k][2], per_row, rtol=0.1)


def test_without_a_steps_load_the_pricing_is_the_pooled_fits(tmp_path):
    """Every step alike: the step slopes are the one slope the seconds' fit gives (2% noise)."""
    write_gpu_job(GpuJob(ranks=4, steps=6, seed=3, all_to_alls=2, hot_expert=(2, 3.0),
                         jitter=0.02), tmp_path)
    trace = load_trace(tmp_path)
    ctx = _context(trace)
    load = ctx.expert_load
    g = ctx.w.grid
    for k, (n, e) in enumerate(load.pairs):
        pooled, _ = experts._fit(load.rows[k], g.duration[e])
        np.testing.assert_allclose(load.step_slope[k], pooled, rtol=0.1)
