"""`stragglers analyze RUN` in one process reads the run by step partitions (issue 32, item 3):
the same S (to 1e-9), per-step S, attribution and diagnosis as the whole trace read at once,
on synthetic jobs and a real NDTimeline trace; replays of long jobs go a step chunk at a time."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq
import pytest

from stragglers.errors import InputError
from stragglers.trace.columns import columns_to_table
from stragglers.trace.ndtimeline import read_ndtimeline
from stragglers.trace.runformat import read_run, write_meta, write_run
from stragglers.trace.synth import generate
from stragglers.whatif import _replay, analyze, analyze_with_model
from stragglers.whatif.partitioned import analyze_run, run_layout
from same_results import PARTITION_JOBS, assert_same, close

JOBS = {
    "slow worker, gc in some steps": dict(dp=4, pp=2, microbatches=4, steps=8,
                                          slow_worker=(1, 1, 1.5), gc=(0.3, 0.01), seed=3),
    **PARTITION_JOBS,
}


@pytest.mark.parametrize("name", list(JOBS))
def test_synthetic_jobs_streamed_match_the_whole_trace(tmp_path, name):
    run = write_run(tmp_path / "run", generate(**JOBS[name]))
    whole = analyze(read_run(run))
    assert whole.by_optype and whole.diagnosis   # the attribution and findings are compared
    # one partition, a few, and one per step (partitions then lack some template ops: gc)
    for partitions in (1, 3, 100):
        assert_same(whole, analyze_run(run, partitions=partitions)[0])


def test_step_selections_streamed(tmp_path):
    run = write_run(tmp_path / "run", generate(dp=2, pp=2, microbatches=4, steps=7,
                                               slow_worker=(0, 1, 1.6), seed=11))
    trace = read_run(run)
    for steps in (None, "all", [1, 2, 4, 6]):
        assert_same(analyze(trace, steps=steps), analyze_run(run, steps=steps, partitions=3)[0])


def test_a_real_trace_streamed(tmp_path, ndtimeline_dir):
    run = write_run(tmp_path / "SE", read_ndtimeline(ndtimeline_dir / "trace-SE.parquet"))
    assert_same(analyze(read_run(run)), analyze_run(run, partitions=4)[0])


def test_rank_files_in_row_groups_are_read_by_the_groups_of_a_partition(tmp_path):
    trace = generate(dp=2, pp=2, microbatches=2, steps=6, slow_worker=(1, 0, 1.4), seed=4)
    run = tmp_path / "run"
    write_meta(run, trace.meta)
    for rank in np.unique(trace.ops["rank"]):   # a recorder's layout: a row group per 2 steps
        rows = trace.ops["rank"] == rank
        pq.write_table(columns_to_table({k: v[rows] for k, v in trace.ops.items()}),
                       run / f"rank-{int(rank):05d}.parquet", row_group_size=int(rows.sum()) // 3)
    layout = run_layout(run)
    assert all(len(g) == 3 and g[0][2:] == (0, 1) for g in layout.groups)
    assert_same(analyze(read_run(run)), analyze_run(run, partitions=3)[0])


def test_progress_names_the_partitions(tmp_path):
    run = write_run(tmp_path / "run", generate(dp=2, pp=2, microbatches=2, steps=4, seed=1))
    told: list[str] = []
    analyze_run(run, progress=told.append, partitions=2)
    assert told[0] == "reading 4 rank files in 2 step partitions in this process"
    assert told[1:3] == ["1/2 step partitions read", "2/2 step partitions read"]
    assert "diagnosis" in told


def test_bad_rank_file_is_a_one_line_error_naming_it(tmp_path):
    run = write_run(tmp_path / "run", generate(dp=2, pp=2, microbatches=2, steps=4, seed=1))
    (run / "rank-00001.parquet").write_bytes(b"PAR1 not parquet")
    with pytest.raises(InputError, match=r"rank-00001.parquet.*not a readable Parquet file"):
        analyze_run(run)


def test_chunked_replay_is_bit_for_bit_the_whole_replay(tmp_path, monkeypatch):
    trace = generate(dp=4, pp=2, microbatches=4, steps=9, slow_worker=(2, 1, 1.3), seed=6)
    _, w = analyze_with_model(trace)
    whole = (_replay.replay(w.plan, w.cost, w.step_start, w.launch_delay),
             _replay.replay(w.plan, w.ideal, w.step_start, keep_timeline=True))
    monkeypatch.setattr(_replay, "CHUNK_BYTES", w.plan.n_nodes * len(w.grid.dp_ranks) * 8 * 4)
    chunked = (_replay.replay(w.plan, w.cost, w.step_start, w.launch_delay),
               _replay.replay(w.plan, w.ideal, w.step_start, keep_timeline=True))
    assert np.array_equal(whole[0], chunked[0])
    for a, b in zip(whole[1], chunked[1]):
        assert np.array_equal(a, b, equal_nan=True)


@pytest.mark.slow
def test_cli_streams_a_run_directory(tmp_path):
    run = write_run(tmp_path / "run", generate(dp=2, pp=2, microbatches=4, steps=5,
                                               slow_worker=(1, 0, 1.5), seed=2))
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "stragglers.cli", "-v", "analyze", str(run),
                           "--json", str(out), "-q"], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "step partitions read" in proc.stderr
    close(json.loads(analyze(read_run(run)).to_json()), json.loads(out.read_text()), "json")
