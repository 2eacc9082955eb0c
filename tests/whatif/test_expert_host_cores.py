"""Expert imbalance on ranks that outnumber their host's CPUs: balanced, every rank computes
its experts at once and each piece waits longer for a core than the hot rank did computing
alone; the prediction gives the expert pieces the run delay that the ranks computing beside them
imply, fitted from the run's own compute pieces (causes/host_cores.py).

Recorded runs: `examples/train_moe.py --alternate` on a quiet 2-core machine, 4 gloo ranks
(tests/data/recorded/README.md): even steps skewed (rank 2 holds the hot expert), odd steps
balanced; the skewed steps are analysed and their prediction set against the balanced steps.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from stragglers.trace.load import load_trace
from stragglers.whatif.causes import host_cores
from stragglers.whatif.causes.base import Context, Rows
from stragglers.whatif.causes.experts import expert_imbalance
from stragglers.whatif.config import DiagnosisConfig
from stragglers.whatif.grid import build_grid
from stragglers.whatif.metrics import WhatIf

RECORDED = Path(__file__).resolve().parents[1] / "data" / "recorded"
RUNS = ["moe-alternating-routing-quiet-0", "moe-alternating-routing-quiet-1"]


def _steps(trace, parity: int) -> list[int]:
    """The run's skewed (0) or balanced (1) steps, warm-up steps 0-1 left out."""
    return sorted(int(s) for s in set(trace.ops["step"].tolist()) if s >= 2 and s % 2 == parity)


def _context(trace) -> Context:
    w = WhatIf.build(build_grid(trace, _steps(trace, 0)))
    return Context.build(w, trace, DiagnosisConfig())


def _expert_time(trace) -> tuple[float, float, float]:
    """Expert compute per rank and step (s): skewed steps, predicted balanced, measured
    balanced."""
    ctx = _context(trace)
    cost = expert_imbalance(ctx)[0].cost
    predicted = cost.whole(ctx.w.cost) if isinstance(cost, Rows) else cost
    experts = [e for _, e in ctx.expert_load.pairs]
    balanced = WhatIf.build(build_grid(trace, _steps(trace, 1)))
    return (float(ctx.w.cost[experts].sum(axis=0).mean()),
            float(predicted[experts].sum(axis=0).mean()),
            float(balanced.cost[experts].sum(axis=0).mean()))


@pytest.mark.parametrize("run", RUNS)
def test_balanced_expert_pieces_wait_as_ranks_computing_at_once_do(run):
    # the rows fit alone kept the skewed steps' expert time (balancing moves rows, not time):
    # 23.0 and 21.2 ms per rank and step against 32.7 and 25.7 ms measured balanced
    trace = load_trace(RECORDED / run)
    skewed, predicted, measured = _expert_time(trace)
    assert predicted > skewed * 1.05, (skewed, predicted, measured)
    assert abs(predicted / measured - 1) < abs(skewed / measured - 1)
    assert predicted < measured * 1.15   # the run delay the overlap implies, no more
    fit = _context(trace).expert_load.host.contention
    assert fit is not None and fit.per_rank > 0 and fit.pieces > 100


def _with_layout(trace, **changes):
    """The trace with every layout entry changed (None: the key removed)."""
    out = copy.copy(trace)
    out.meta = copy.deepcopy(trace.meta)
    for entry in out.meta.extra["layout"]:
        for key, value in changes.items():
            if value is None:
                entry.pop(key, None)
            else:
                entry[key] = value
    return out


@pytest.mark.parametrize("layout", [{"cpus": "0-3"}, {"cpus": None}])
def test_a_core_per_rank_or_no_affinity_leaves_the_prediction_to_the_rows(layout):
    """4 ranks on 4 CPUs, or a layout from before `cpus`: no contention model, the prediction
    the rows fit gives (the durations' slope)."""
    trace = load_trace(RECORDED / RUNS[1])
    plain = _with_layout(trace, **layout)
    ctx = _context(plain)
    assert ctx.expert_load.host is not None and ctx.expert_load.host.contention is None
    skewed, predicted, _ = _expert_time(plain)
    assert predicted == pytest.approx(skewed, rel=1e-9)


def test_crowded_hosts_reads_the_layouts_cpus():
    trace = load_trace(RECORDED / RUNS[0])
    ranks = np.arange(4)[:, None]
    assert host_cores.crowded_hosts(trace, ranks).tolist() == [0, 0, 0, 0]
    assert host_cores.crowded_hosts(_with_layout(trace, cpus="0-3"), ranks) is None
    assert host_cores.crowded_hosts(_with_layout(trace, cpus=None), ranks) is None
    # a pipeline's grid holds a worker per (DP rank, stage): not modelled
    assert host_cores.crowded_hosts(trace, np.array([[0, 2], [1, 3]])) is None
    gpu = copy.copy(trace)
    gpu.meta = copy.deepcopy(trace.meta)
    gpu.meta.extra["recorder"]["timer"] = "cuda-events"
    assert host_cores.crowded_hosts(gpu, ranks) is None
    # two hosts, one crowded: only its ranks are modelled
    split = copy.copy(trace)
    split.meta = copy.deepcopy(trace.meta)
    for entry in split.meta.extra["layout"]:
        entry["host"], entry["cpus"] = ("vm", "0") if entry["rank"] < 2 else ("other", "0-7")
    assert host_cores.crowded_hosts(split, ranks).tolist() == [0, 0, -1, -1]


def test_overlap_counts_the_hosts_other_ranks_computing_during_a_piece():
    # one step, 3 ranks on one host, a 4th on a host with a core per rank; one piece each
    start = np.array([[[0.0], [5.0], [0.0], [0.0]]])                     # [K=1, D=4, T=1]
    dur = np.array([[[10.0], [10.0], [2.0], [10.0]]])
    host = np.array([0, 0, 0, -1])
    got = host_cores.overlap(start, dur, start, dur, host)[0, :, 0]
    # rank 0: rank 1 for 5 of 10, rank 2 for 2 of 10; rank 1: rank 0 for 5 of 10;
    # rank 2: rank 0 all of its 2; rank 3: not modelled
    np.testing.assert_allclose(got[:3], [0.7, 0.5, 1.0])
    assert np.isnan(got[3])


# A run whose rows carry each step's process CPU (`step_cpu`, every thread's): recorded beside
# other agents' work (load 7-8), so its measured gain is noise; what is tested is the floor.
STEP_CPU_RUN = RECORDED / "moe-alternating-routing-step-cpu"


def test_host_cpu_sums_each_hosts_processes_per_step():
    trace = load_trace(STEP_CPU_RUN)
    ctx = _context(trace)
    cpu = ctx.expert_load.host.cpu
    ops = trace.ops
    assert cpu is not None and cpu.cpus.tolist() == [2.0]
    for t, step in enumerate(ctx.w.grid.steps):
        sel = ops["step"] == step
        per_rank = {int(r): float(ops["step_cpu"][sel & (ops["rank"] == r)][0])
                    for r in np.unique(ops["rank"][sel])}
        assert cpu.work[0, t] == pytest.approx(sum(per_rank.values()), rel=1e-12)
    assert cpu.floor().tolist() == pytest.approx((cpu.work[0] / 2).tolist())
    # a host with a core per rank is not crowded: no floor
    assert _context(_with_layout(trace, cpus="0-3")).expert_load.host.cpu is None


def test_at_least_lengthens_the_steps_below_the_floor_to_it_and_no_other():
    from stragglers.whatif._replay import replay

    w = _context(load_trace(STEP_CPU_RUN)).w
    times = replay(w.plan, w.cost, w.step_start)
    floor = times.copy()
    floor[::2] += 0.05
    floor[1::2] -= 0.05
    out = host_cores.at_least(w, w.cost, floor)
    np.testing.assert_allclose(replay(w.plan, out, w.step_start), np.maximum(times, floor),
                               atol=1e-9)
    np.testing.assert_array_equal(out[:, :, 1::2], w.cost[:, :, 1::2])


def test_balanced_routing_is_no_faster_than_the_hosts_cpu_work_allows():
    """Balancing moves the experts' work between the ranks, it does not remove it: where the
    processes' CPU over the host's CPUs exceeds the replay's step, the prediction is that step
    (here the recorded step_cpu ×3, as on a host whose cores the run keeps busy)."""
    from stragglers.whatif._replay import replay

    trace = load_trace(STEP_CPU_RUN)
    for factor, binds in ((1, False), (3, True), (100, True)):
        run = copy.copy(trace)
        run.ops = dict(trace.ops)
        run.ops["step_cpu"] = trace.ops["step_cpu"] * factor
        ctx = _context(run)
        # never past the step measured: CPU counted outside the step is no step's floor
        floor = np.minimum(ctx.expert_load.host.cpu.floor(), ctx.w.t_base)
        predicted = replay(ctx.w.plan, expert_imbalance(ctx)[0].cost, ctx.w.step_start)
        assert (predicted >= floor - 1e-9).all()
        assert bool((predicted <= floor + 1e-9).any()) is binds
        assert predicted.mean() <= ctx.w.t_base.mean() + 1e-9


@pytest.mark.parametrize("bad", [float("inf"), -1.0, 1e300])
def test_a_step_cpu_that_is_no_time_is_one_line(tmp_path, bad):
    import shutil

    import pyarrow.parquet as pq

    from stragglers.errors import InputError

    run = tmp_path / "run"
    shutil.copytree(STEP_CPU_RUN, run)
    part = sorted(run.glob("rank-00000.part-*.parquet"))[1]
    table = pq.read_table(part)
    values = table.column("step_cpu").to_pylist()
    values[3] = bad
    table = table.set_column(table.schema.get_field_index("step_cpu"), "step_cpu",
                             pa.array(values, pa.float64()))
    pq.write_table(table, part)
    with pytest.raises(InputError, match="step_cpu") as err:
        load_trace(run)
    assert "\n" not in str(err.value)
