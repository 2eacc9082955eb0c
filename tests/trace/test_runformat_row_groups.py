"""Rank files in row groups by block of steps (issue 32, item 3): write_run cuts every rank file
at the same steps, sized by a stated cost model; row order, contents and old one-group runs read
as before; a recorder's part stays one group."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from stragglers.trace.columns import columns_to_table
from stragglers.trace.runformat import (GROUP_COST_ROWS, MIN_READ_PARTITIONS, group_bounds,
                                        read_run, run_group_steps, steps_per_group, write_meta,
                                        write_rank, write_run)
from stragglers.trace.synth import generate


def _cost(g: int, steps: int, rows: float, partitions: int) -> float:
    """The read cost steps_per_group minimises (its docstring's model)."""
    return (steps / g + partitions) * GROUP_COST_ROWS + (steps + partitions * g) * rows


def test_steps_per_group_minimises_the_stated_cost():
    for steps, rows, partitions in [(50, 196, 19), (172, 190, 4), (6, 50, 4), (20, 49, 4),
                                    (100, 3, 4), (10, 100_000, 4), (1, 500, 4)]:
        g = steps_per_group(rows, steps, partitions)
        assert 1 <= g <= steps
        best = min(_cost(k, steps, rows, partitions) for k in range(1, steps + 1))
        # the rounded continuous optimum: within a few percent of the best whole number
        assert _cost(g, steps, rows, partitions) <= best * 1.05, (steps, rows, partitions, g)
    # the 10,240-rank × 50-step job (196 rows a rank and step, read in 19 partitions): 2 steps
    assert steps_per_group(196, 50, 19) == 2
    # a file with 100,000 rows a step: a group per step; tiny files: one group
    assert steps_per_group(100_000, 10, 4) == 1
    assert steps_per_group(3, 20, 4) == 20


def test_group_bounds_cut_at_multiples_of_the_width():
    step = np.repeat(np.arange(3, 12), 5)                         # steps 3..11, 5 rows each
    bounds = group_bounds(step, 4)                                # blocks 0-3, 4-7, 8-11
    assert bounds.tolist() == [0, 5, 25, 45]
    assert group_bounds(step, 20).tolist() == [0, 45]
    assert group_bounds(step[::-1].copy(), 4).tolist() == [0, 45]   # not in step order: one
    assert group_bounds(step[:0], 4).tolist() == [0, 0]


def test_write_run_cuts_every_file_at_the_same_steps_and_reads_back_the_same(tmp_path):
    trace = generate(dp=2, pp=2, microbatches=16, steps=12, slow_worker=(1, 1, 1.5), seed=3)
    width = run_group_steps(trace.ops["step"], 4)
    rows_a_step = len(trace) / (4 * 12)
    assert width == steps_per_group(rows_a_step, 12, MIN_READ_PARTITIONS) and 1 < width < 12
    run = write_run(tmp_path / "run", trace)
    blocks = set()
    for f in sorted(run.glob("rank-*.parquet")):
        md = pq.read_metadata(f)
        assert md.num_row_groups == -(-12 // width)
        at = md.schema.names.index("step")
        for g in range(md.num_row_groups):
            st = md.row_group(g).column(at).statistics
            assert st.min // width == st.max // width            # one block of steps
            blocks.add((st.min, st.max))
    assert len(blocks) == -(-12 // width)                         # the same cuts in every file
    back = read_run(run)
    order = np.argsort(trace.ops["rank"], kind="stable")         # read_run's order: by file
    for c, values in back.ops.items():
        assert np.array_equal(values, trace.ops[c][order]), c


def test_a_recorder_part_is_one_group_and_old_one_group_runs_read(tmp_path):
    trace = generate(dp=2, pp=1, microbatches=32, steps=8, seed=2)
    ops = trace.ops
    rows = ops["rank"] == 0
    part = write_rank(tmp_path / "parts", 0, {k: v[rows] for k, v in ops.items()}, part=0)
    assert pq.read_metadata(part).num_row_groups == 1
    # a run written before row groups by steps: one group per file, read as before
    old = tmp_path / "old"
    write_meta(old, trace.meta)
    for r in (0, 1):
        keep = ops["rank"] == r
        pq.write_table(columns_to_table({k: v[keep] for k, v in ops.items()}),
                       old / f"rank-{r:05d}.parquet")
    assert pq.read_metadata(old / "rank-00001.parquet").num_row_groups == 1
    new = write_run(tmp_path / "new", trace)
    assert pq.read_metadata(new / "rank-00001.parquet").num_row_groups > 1
    a, b = read_run(old), read_run(new)
    for c in a.ops:
        assert np.array_equal(a.ops[c], b.ops[c]), c
