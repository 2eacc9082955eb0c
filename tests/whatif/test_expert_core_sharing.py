"""Processor sharing for expert pieces run on shared host CPUs (experts.core_sharing and
shared_costs, benchmarked by moe_balance.py, not used by the finding): where each expert piece
carries its run delay (`cpu_wait`) and its time on a CPU (`cpu_time`), and the compute every
rank runs at once (outside the experts, between two collectives) carries both too, a balanced
piece is its on-CPU time at balanced rows × (1 + that compute's run delay per second on CPU) +
its time off a CPU at balanced rows. Anything less recorded: `balanced_costs`, exactly.

Jobs are synthetic Kineto traces with a hot expert (stragglers.trace.synth.kineto); the tests
add the two columns with known numbers, as our recorder writes them on CPU.
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

RANKS = 8


def _job(tmp_path):
    write_gpu_job(GpuJob(ranks=RANKS, steps=6, seed=7, all_to_alls=2, hot_expert=(2, 2.5),
                         jitter=0.02), tmp_path)
    return load_trace(tmp_path)


def _ctx(trace) -> Context:
    w = WhatIf.build(build_grid(trace))
    return Context.build(w, trace, DiagnosisConfig())


def _split(trace, cpu: float, wait: float, other_cpu: float, other_wait) -> None:
    """Expert pieces: `cpu` and `wait` of their duration on a CPU / waiting for one (the rest
    asleep); every other compute piece `other_cpu` and `other_wait` (a [ranks] array: per rank)."""
    ctx = _ctx(trace)
    g, ops = ctx.w.grid, trace.ops
    load = ctx.expert_load
    assert load is not None
    expert_nodes = {int(experts._next_compute(g, int(n)))
                    for n in np.flatnonzero(g.node_optype == experts.A2A)}
    cpu_col = np.full(len(ops["rank"]), np.nan)
    wait_col = np.full(len(ops["rank"]), np.nan)
    dur = ops["duration"]
    for n in np.flatnonzero(np.isin(g.node_optype, experts._COMPUTE)):
        rows = g.row[int(n)]
        if int(n) in expert_nodes:
            cpu_col[rows], wait_col[rows] = cpu * dur[rows], wait * dur[rows]
        else:
            share = np.asarray(other_wait, dtype=float)[ops["rank"][rows]]
            cpu_col[rows], wait_col[rows] = other_cpu * dur[rows], share * dur[rows]
    ops["cpu_time"], ops["cpu_wait"] = cpu_col, wait_col


def test_balanced_pieces_stretch_their_cpu_time_by_the_shared_rate(tmp_path):
    """Expert pieces 60% on a CPU, 10% waiting, 30% asleep; the other compute waits 0.4 s per
    0.5 s on a CPU (rate 0.8). On-CPU and asleep times are fixed shares of the duration, so
    their fits are those shares of the durations' fit: each balanced piece is its durations'
    balanced value × (0.6 × 1.8 + 0.3) = × 1.38."""
    trace = _job(tmp_path)
    plain = analyze(trace).diagnosis[0]
    _split(trace, cpu=0.6, wait=0.1, other_cpu=0.5, other_wait=np.full(RANKS, 0.4))
    ctx = _ctx(trace)
    load = ctx.expert_load
    share = experts.core_sharing(ctx, load, ctx.w.grid.duration)
    assert share is not None and share.pieces > 0
    np.testing.assert_allclose(share.rate, 0.8, rtol=1e-12)
    np.testing.assert_allclose(share.cpu_slope, 0.6 * load.slope, rtol=1e-9)
    np.testing.assert_allclose(share.off_slope, 0.3 * load.slope, rtol=1e-9)
    cost = ctx.w.cost
    nodes = [e for _, e in load.pairs]
    for cap in (None, 1.25):
        want = experts.balanced_costs(load, cost, cap)
        got = experts.shared_costs(load, share, cost, cap)
        np.testing.assert_allclose(got[nodes], 1.38 * want[nodes], rtol=1e-9)
        others = np.setdiff1d(np.arange(len(cost)), nodes)
        np.testing.assert_array_equal(got[others], cost[others])
    # the finding keeps the durations' prediction (the rate's source misses on busy hosts)
    found = analyze(trace).diagnosis[0]
    assert found.cause == plain.cause == "expert_imbalance"
    assert found.speedup_if_fixed == pytest.approx(plain.speedup_if_fixed, rel=1e-12)


def test_the_rate_is_each_host_s_own(tmp_path):
    """Two hosts in the layout: ranks 0-3 on one whose concurrent compute waited 0.1 s per s
    on a CPU, 4-7 on one that waited 0.9: each rank's balanced pieces meet its host's."""
    trace = _job(tmp_path)
    trace.meta.extra["layout"] = [{"rank": r, "host": "a" if r < 4 else "b"}
                                  for r in range(RANKS)]
    _split(trace, cpu=0.6, wait=0.1, other_cpu=0.5,
           other_wait=np.where(np.arange(RANKS) < 4, 0.05, 0.45))
    ctx = _ctx(trace)
    rate = experts.core_sharing(ctx, ctx.expert_load, ctx.w.grid.duration).rate
    host_b = np.array([ctx.hosts[int(r)] == "b" for r in ctx.ranks[:, 0]])
    assert host_b.sum() == 4
    np.testing.assert_allclose(rate[~host_b], 0.1, rtol=1e-12)
    np.testing.assert_allclose(rate[host_b], 0.9, rtol=1e-12)


@pytest.mark.parametrize("missing", ["cpu_time column", "one expert piece", "other compute"])
def test_without_the_whole_split_nothing_is_corrected(tmp_path, missing):
    """GPU and profiler traces, older runs (no cpu_time), a piece without its split, or no
    compute every rank runs at once with both recorded: exactly today's prediction."""
    trace = _job(tmp_path)
    _split(trace, cpu=0.6, wait=0.1, other_cpu=0.5, other_wait=np.full(RANKS, 0.4))
    ops = trace.ops
    if missing == "cpu_time column":
        del ops["cpu_time"]
    else:
        ctx = _ctx(trace)
        expert_nodes = [e for _, e in ctx.expert_load.pairs]
        g = ctx.w.grid
        if missing == "one expert piece":
            ops["cpu_time"][g.row[expert_nodes[0]][0, 0]] = np.nan
        else:
            keep = np.zeros(len(ops["rank"]), bool)
            for e in expert_nodes:
                keep[g.row[e].ravel()] = True
            ops["cpu_time"][~keep] = np.nan
    ctx = _ctx(trace)
    load = ctx.expert_load
    assert load.host is not None
    share = experts.core_sharing(ctx, load, ctx.w.grid.duration)
    assert share is None
    np.testing.assert_array_equal(experts.shared_costs(load, share, ctx.w.cost),
                                  experts.balanced_costs(load, ctx.w.cost))


def test_no_run_delays_no_split(tmp_path):
    """Without run delays on the expert pieces (GPU ranks, profiler traces) nothing is split."""
    trace = _job(tmp_path)
    _split(trace, cpu=0.6, wait=0.1, other_cpu=0.5, other_wait=np.full(RANKS, 0.4))
    del trace.ops["cpu_wait"]
    ctx = _ctx(trace)
    assert ctx.expert_load.host is None
    assert experts.core_sharing(ctx, ctx.expert_load, ctx.w.grid.duration) is None
