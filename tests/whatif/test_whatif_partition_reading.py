"""How a step partition reads a run directory (issue 32, item 3): the files' tables checked and
converted at once, file by file where their schemas differ or a value is refused (the error
names the file), only the analysed columns, and step cuts moved to row-group boundaries."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest

from stragglers.errors import InputError
from stragglers.trace.columns import columns_to_table
from stragglers.trace.runformat import read_run, write_meta, write_run
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.partitioned import (analyze_run, read_partition, run_layout,
                                           step_partitions)
from same_results import assert_same


def _recorder_run(path, trace, steps_per_group: int, drop: dict | None = None):
    """A run directory as a recorder leaves it: per rank, a row group per `steps_per_group`
    steps (`drop`: rank → optional column that rank's file lacks)."""
    write_meta(path, trace.meta)
    ops = trace.ops
    for rank in np.unique(ops["rank"]):
        rows = ops["rank"] == rank
        cols = {k: v[rows] for k, v in ops.items() if k != (drop or {}).get(int(rank))}
        table = columns_to_table(cols)
        step = cols["step"]
        with pq.ParquetWriter(path / f"rank-{int(rank):05d}.parquet", table.schema) as w:
            for lo in range(int(step.min()), int(step.max()) + 1, steps_per_group):
                keep = np.flatnonzero((step >= lo) & (step < lo + steps_per_group))
                w.write_table(table.take(keep))
    return path


def _rows_of(trace, steps):
    """The whole trace's rows at `steps`, in read_run's order, as the partition holds them."""
    keep = np.isin(trace.ops["step"], steps)
    return {k: v[keep] for k, v in trace.ops.items()}


def test_cuts_move_to_row_group_boundaries(tmp_path):
    trace = generate(dp=2, pp=2, microbatches=2, steps=24, seed=1)
    layout = run_layout(_recorder_run(tmp_path / "run", trace, 4))
    # even cuts start partitions at steps 5, 10, 15 and 20; a cut moves by a quarter of a
    # partition (1 step) at most: 5 → 4 and 15 → 16, 10 stays (4 or 8 are 2 away)
    parts = step_partitions(layout.steps, 5, layout)
    assert [int(p[0]) for p in parts] == [0, 4, 10, 16, 20]
    assert np.array_equal(np.concatenate(parts), layout.steps)
    assert [int(p[0]) for p in step_partitions(layout.steps, 5)] == [0, 5, 10, 15, 20]
    # row groups of one step each: every cut is clean, the even ones stay
    one = run_layout(_recorder_run(tmp_path / "steps", trace, 1))
    assert [int(p[0]) for p in step_partitions(one.steps, 5, one)] == [0, 5, 10, 15, 20]


def test_a_cut_no_group_allows_stays_even(tmp_path):
    trace = generate(dp=2, pp=2, microbatches=2, steps=8, seed=2)
    layout = run_layout(_recorder_run(tmp_path / "run", trace, 8))   # one group: every step
    assert [int(p[0]) for p in step_partitions(layout.steps, 2, layout)] == [0, 4]


def test_partition_rows_are_the_whole_traces(tmp_path):
    trace = generate(dp=2, pp=2, microbatches=4, steps=9, slow_worker=(1, 1, 1.4), seed=3,
                     seq_imbalance={"dist": "lognormal", "max_len": 4096,
                                    "tokens_per_mb": 8192})
    run = _recorder_run(tmp_path / "run", trace, 2)
    whole = read_run(run)
    layout = run_layout(run)
    assert "tokens" in layout.optional
    for steps in (np.arange(0, 4), np.arange(3, 9), np.array([1, 2, 6])):
        part = read_partition(layout, steps)
        want = _rows_of(whole, steps)
        assert set(part.ops) == {c for c in want if c != "bytes"}   # bytes is not analysed
        for c, values in part.ops.items():
            assert values.dtype == want[c].dtype and np.array_equal(values, want[c],
                                                                    equal_nan=True), c
        assert np.all(np.diff(part.position) > 0)


def test_files_of_other_schemas_are_read_one_by_one(tmp_path):
    trace = generate(dp=2, pp=2, microbatches=4, steps=6, slow_worker=(0, 1, 1.5), seed=4,
                     seq_imbalance={"dist": "lognormal", "max_len": 4096,
                                    "tokens_per_mb": 8192})
    run = _recorder_run(tmp_path / "run", trace, 3, drop={1: "tokens"})
    whole = read_run(run)              # (the rank without tokens filled with -1)
    part = read_partition(run_layout(run), np.arange(6))
    assert np.array_equal(part.ops["tokens"], whole.ops["tokens"])
    assert (part.ops["tokens"][part.ops["rank"] == 1] == -1).all()
    assert_same(analyze(whole), analyze_run(run, partitions=2)[0])


def test_a_bad_value_names_its_file(tmp_path):
    trace = generate(dp=2, pp=2, microbatches=2, steps=4, seed=5)
    trace.ops["duration"][np.flatnonzero(trace.ops["rank"] == 2)[3]] = -1.0
    run = write_run(tmp_path / "run", trace)
    with pytest.raises(InputError, match=r"rank-00002\.parquet.*duration.*negative"):
        analyze_run(run, partitions=2)


def test_recorder_layout_streamed_matches_the_whole_trace(tmp_path):
    trace = generate(dp=4, pp=2, microbatches=4, steps=10, slow_worker=(2, 1, 1.5), seed=6)
    run = _recorder_run(tmp_path / "run", trace, 3)
    whole = analyze(read_run(run))
    for partitions in (2, 3, 5):
        assert_same(whole, analyze_run(run, partitions=partitions)[0])


def test_a_partition_of_a_written_run_decodes_only_its_row_groups(tmp_path):
    from stragglers.trace.runformat import run_group_steps

    trace = generate(dp=2, pp=2, microbatches=16, steps=12, slow_worker=(1, 1, 1.5), seed=3)
    width = run_group_steps(trace.ops["step"], 4)
    assert width == 6            # (so that the 2 partitions below cut where the groups do)
    run = write_run(tmp_path / "run", trace)
    layout = run_layout(run)
    first = read_partition(layout, np.arange(width))
    assert first.rows_read == int((trace.ops["step"] < width).sum()) == len(first.position)
    assert 0 < first.bytes_read < sum(p.stat().st_size for p in run.glob("rank-*"))
    # cut at the groups' steps, the partitions decode every row once, no group twice
    told: list[str] = []
    assert_same(analyze(read_run(run)), analyze_run(run, partitions=2, progress=told.append)[0])
    assert f"read {len(trace):,} rows" in next(m for m in told if m.startswith("read "))


@pytest.mark.parametrize("other", [1, 9])
def test_rows_of_another_rank_in_a_rank_file_name_the_file(tmp_path, other):
    # rank 0's file holding a row of rank 1 (in the world) or rank 9 (outside a world of 4):
    # one line naming the file and field 'rank', whole or by partitions — it was analysed as
    # a rank of its own
    trace = generate(dp=2, pp=2, microbatches=2, steps=4, seed=5)
    run = write_run(tmp_path / "run", trace)
    path = run / "rank-00000.parquet"
    table = pq.read_table(path)
    rank = table.column("rank").to_numpy().copy()
    rank[2] = other
    at = table.schema.get_field_index("rank")
    pq.write_table(table.set_column(at, table.schema.field(at), [rank]), path)
    bad = rf"rank-00000\.parquet: field 'rank': rows of rank {other} in the file of rank 0"
    with pytest.raises(InputError, match=bad):
        read_run(run)
    with pytest.raises(InputError, match=bad):
        analyze_run(run, partitions=2)
