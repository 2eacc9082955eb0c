"""Per-worker step-time tables (.csv): read as a synchronous data-parallel job, bad input refused
with one line naming the file and column."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stragglers.advice import advise
from stragglers.errors import InputError
from stragglers.trace.load import load_trace
from stragglers.whatif import analyze

PAI = Path(__file__).resolve().parents[1] / "data" / "real" / "pai-minibatch"


def _csv(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_a_table_becomes_compute_and_a_synchronising_all_reduce(tmp_path):
    rows = ["rank,step,step_time_ms"]
    for step in range(4):
        rows += [f"{r},{step},{100 + 50 * (r == 2)}" for r in range(3)]
    trace = load_trace(_csv(tmp_path / "t.csv", "\n".join(rows)))
    names = trace.optype_names()
    assert list(names).count("forward-compute") == 12 and list(names).count("grads-all-reduce") == 12
    comp = trace.ops["duration"][names == "forward-compute"]
    assert sorted(set(np.round(comp, 6))) == [0.1, 0.15]               # milliseconds read
    ends = (trace.ops["start_ts"] + trace.ops["duration"])[names == "grads-all-reduce"]
    # every worker's all-reduce of a step ends when the slowest worker (rank 2) arrives
    assert np.allclose(np.sort(ends), np.repeat(np.arange(1, 5) * 0.15, 3))
    result = analyze(trace)
    assert result.sim_error < 1e-9


@pytest.mark.slow
def test_diagnosis_and_advise_agree_on_the_slow_half():
    path = PAI / "job_4_norm.csv"
    result = analyze(load_trace(path))
    slow = {w.rank for f in result.diagnosis for w in f.where.workers}
    assert slow == {0, 5, 6, 7, 8}
    plan = advise(load_trace(path))
    dd = next(a for a in plan.remedies if a.name == "antdt-dd")
    assert dd.applies
    # the DD re-split gives exactly the slow half the smaller batches
    before, after = dd.details.batch_sizes, dd.details.new_batch_sizes
    assert {i for i, (b, n) in enumerate(zip(before, after)) if n < b} == slow


@pytest.mark.parametrize("text, field", [
    ("who,step,step_time\n0,1,2\n", "worker"),
    ("rank,step,colour\n0,1,2\n", "time"),
    ("rank,step,step_time\n0,1,fast\n", "step_time"),
    ("rank,step,step_time\n0,1.5,2\n", "step"),
    ("rank,step,step_time\n0,1,-2\n", "step_time"),
    ("rank,step,step_time\n0,1,2\n0,1,3\n", "step"),
])
def test_bad_tables_are_one_line_errors(tmp_path, text, field):
    path = _csv(tmp_path / "bad.csv", text)
    with pytest.raises(InputError) as err:
        from stragglers.trace.steptimes import read_step_times
        read_step_times(path)
    assert err.value.field == field and "bad.csv" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_csv_without_the_columns_is_not_taken_for_step_times(tmp_path):
    path = _csv(tmp_path / "other.csv", "a,b\n1,2\n")
    with pytest.raises(InputError, match="step times"):
        load_trace(path)


def _table(path: Path, workers: int, slow: set[int], factor: float, noise: float,
           steps: int, seed: int) -> Path:
    """A step-time table: every step's shared variation, the slow workers `factor` as long,
    each worker-step its own lognormal noise."""
    rng = np.random.default_rng(seed)
    shared = np.exp(rng.normal(0, 0.02, steps))
    rows = ["worker,step,step_time"]
    for s in range(steps):
        noise_s = np.exp(rng.normal(0, noise, workers))
        rows += [f"{r},{s},{shared[s] * (factor if r in slow else 1) * noise_s[r]:.6f}"
                 for r in range(workers)]
    return _csv(path, "\n".join(rows))


@pytest.mark.parametrize("workers,slow", [(32, set(range(0, 32, 2))), (10, {1, 2, 3, 4, 5}),
                                          (64, set(range(40)))])
def test_a_slow_half_ten_percent_slower_is_named(tmp_path, workers, slow):
    # 10% slower, each step's time 5% noise: the group's gap is far beyond the spread within
    # each group, but short of the 15% asked of groups that stand apart by size alone (it was
    # named nothing, while a slow 40% was named by the outlier test worker by worker)
    path = _table(tmp_path / "t.csv", workers, slow, 1.1, 0.05, 100, seed=len(slow))
    top = analyze(load_trace(path)).diagnosis[0]
    assert top.cause == "slow_group" and set(top.where.ranks) == slow, top


@pytest.mark.parametrize("workers,noise,steps", [(8, 0.1, 10), (32, 0.05, 30), (128, 0.03, 50)])
def test_noise_alone_makes_no_slow_group(tmp_path, workers, noise, steps):
    path = _table(tmp_path / "t.csv", workers, set(), 1.0, noise, steps, seed=workers)
    assert all(f.cause != "slow_group" for f in analyze(load_trace(path)).diagnosis)


@pytest.mark.parametrize("job,slow", [
    # workers 0-2 about 10% slower all run (worker 6 slow for a stretch in the middle)
    ("job_1_norm.csv", {0, 1, 2}),
    # workers 0 and 1 about 10% slower all run; 6-9 a quarter slower in the last tenth
    ("job_3_norm.csv", {0, 1}),
])
def test_a_group_slower_all_run_is_named_beside_workers_slow_for_a_stretch(job, slow):
    # judged on each worker's median over steps, not its mean: a stretch of slow steps no
    # longer blurs the gap between the groups (both jobs read `none` at S 1.11)
    result = analyze(load_trace(PAI / job))
    top = result.diagnosis[0]
    assert top.cause == "slow_group" and set(top.where.ranks) == slow, result.diagnosis


def test_the_slowest_steps_name_the_worker_slow_in_them():
    # PAI's job_1: worker 6 runs up to 2.4x its peers in a twentieth of the run (its README:
    # "straggler (worker 6) emerges in the middle of the training"), too short a stretch to be
    # worth fixing over the run (slow_group 0-2 is), but it is what those steps waited for
    import os
    import subprocess
    import sys

    result = analyze(load_trace(PAI / "job_1_norm.csv"))
    top = result.slowest_steps[:7]
    by_step = result.step_slowdown
    assert [s.step for s in top] == sorted(by_step, key=lambda k: -by_step[k])[:7]
    assert {s.worker.rank for s in top} == {6} and min(s.ratio for s in top) > 1.4
    assert all(1811 <= s.step <= 1941 for s in top)
    shown = subprocess.run([sys.executable, "-m", "stragglers.cli", "analyze",
                            str(PAI / "job_1_norm.csv")], capture_output=True, text=True,
                           env={**os.environ, "COLUMNS": "160"})
    assert "dp 6 / pp 0 (rank 6) 2.35×" in shown.stdout, shown.stdout[-3000:]


def test_a_step_no_worker_computed_long_in_names_no_worker(tmp_path):
    # every worker alike: the slowest steps are slow for everyone, and no worker is named
    path = _table(tmp_path / "t.csv", 8, set(), 1.0, 0.0, 20, seed=3)
    result = analyze(load_trace(path))
    assert result.slowest_steps and all(s.worker is None and s.ratio is None
                                        for s in result.slowest_steps)


def _rows(workers, steps: int, slow, factor: float = 1.3):
    """(worker, step, seconds) rows, `slow` workers `factor` as long (a little noise)."""
    rng = np.random.default_rng(7)
    return [(w, s, (factor if w in slow else 1.0) * (1 + 0.01 * rng.standard_normal()))
            for s in range(steps) for w in workers]


def test_named_workers_become_ranks_in_natural_order_and_keep_their_names(tmp_path):
    names = [f"node-{i}.dc:2950{i}" for i in (10, 2, 1, 9, 3)]   # node-10 after node-9
    rows = ["worker,step,step_time"] + [f"{w},{s},{t:.5f}"
                                        for w, s, t in _rows(names, 30, {"node-10.dc:295010"})]
    trace = load_trace(_csv(tmp_path / "t.csv", "\n".join(rows)))
    order = sorted(names, key=lambda n: int(n.split("-")[1].split(".")[0]))
    assert trace.meta.extra["workers"] == order
    top = analyze(trace).diagnosis[0]
    assert top.cause == "worker_fault" and top.where.ranks == [4]
    assert top.where.hosts == ["node-10.dc:295010"]


def test_a_wide_table_is_one_time_column_per_worker(tmp_path):
    rows = _rows(range(6), 30, {4})
    lines = ["step;gpu0;gpu1;gpu2;gpu3;gpu4;gpu5"]    # semicolons: sniffed
    for s in range(30):
        # worker 2 has no time for step 5: an empty cell
        cells = ["" if (w == 2 and s == 5) else f"{t:.5f}" for w, st, t in rows if st == s]
        lines.append(f"{s};" + ";".join(cells))
    trace = load_trace(_csv(tmp_path / "t.csv", "\n".join(lines)))
    assert trace.meta.extra["workers"] == [f"gpu{i}" for i in range(6)]
    assert len(trace.ops["step"]) == 2 * (6 * 30 - 1)
    top = analyze(trace).diagnosis[0]
    assert top.cause == "worker_fault" and top.where.ranks == [4]


@pytest.mark.parametrize("sep", ["\t", "|", ";"])
def test_the_separator_is_sniffed(tmp_path, sep):
    rows = [sep.join(["rank", "step", "step_time_ms"])] + [
        sep.join([str(w), str(s), f"{1000 * t:.2f}"]) for w, s, t in _rows(range(5), 20, {1})]
    top = analyze(load_trace(_csv(tmp_path / "t.csv", "\n".join(rows)))).diagnosis[0]
    assert top.cause == "worker_fault" and top.where.ranks == [1]


def test_worker_ids_mixed_with_names_are_one_line_errors(tmp_path):
    path = _csv(tmp_path / "t.csv", "rank,step,step_time\n0,1,2\n1,1,2\nx,1,3\n")
    with pytest.raises(InputError, match="row 4: 'x'; expected every worker given as a number"):
        load_trace(path)


@pytest.mark.parametrize("text,says", [
    # when each step ended, not how long: every worker ends a synchronous step together
    ("rank,step,timestamp\n0,1,1700000000.5\n1,1,1700000000.6\n", "cannot tell a straggler"),
    # a worker and a step column but no time: said, not "not a trace"
    ("rank,step,loss\n0,1,2.5\n", "no time column"),
])
def test_a_table_without_times_per_worker_says_what_is_missing(tmp_path, text, says):
    path = _csv(tmp_path / "t.csv", text)
    with pytest.raises(InputError, match=says) as err:
        load_trace(path)
    assert "\n" not in str(err.value) and "t.csv" in str(err.value)


def test_chance_loads_over_a_few_steps_make_no_slow_group(tmp_path):
    # 8 workers, 8 steps, every worker-step its own 15% load (random sequence lengths): by
    # chance some workers draw more over so few steps, and a split chosen on all steps made a
    # slow group of them (seed 16, and 2 of 2,000 synthetic jobs); it must hold on the even
    # and on the odd steps alone
    named = []
    for seed in range(40):
        rng = np.random.default_rng(seed)
        times = np.exp(rng.normal(0, 0.02, 8))[None] * np.exp(rng.normal(0, 0.15, (8, 8)))
        path = _csv(tmp_path / f"t{seed}.csv", "\n".join(
            ["worker,step,step_time"] + [f"{w},{s},{times[w, s]:.6f}"
                                         for s in range(8) for w in range(8)]))
        if any(f.cause == "slow_group" for f in analyze(load_trace(path)).diagnosis):
            named.append(seed)
    assert named == []
