"""A step-partitioned run's steps: from the row groups' statistics where every step between
their ends can be there, from the step columns where the range is wider than the rows."""

from __future__ import annotations

import numpy as np

from stragglers.trace.runformat import write_run
from stragglers.trace.synth import generate
from stragglers.whatif.partitioned import run_layout


def test_a_step_range_wider_than_the_rows_is_read_from_the_step_columns(tmp_path):
    # two steps a trillion apart: an arange between the statistics' ends asked for 8 TB (one
    # damaged byte of a footer set a step maximum to 2**31+3: 16.9 GB, 103 s; a fuzz find)
    trace = generate(dp=2, pp=1, microbatches=2, steps=2, seed=0)
    far = 10**12
    trace.ops["step"] = np.where(trace.ops["step"] == 1, far, trace.ops["step"]).astype(np.int64)
    write_run(tmp_path / "run", trace)
    assert run_layout(tmp_path / "run").steps.tolist() == [0, far]
    assert run_layout(tmp_path / "run", steps=[far]).steps.tolist() == [far]


def test_contiguous_steps_come_from_the_statistics(tmp_path):
    trace = generate(dp=2, pp=1, microbatches=2, steps=5, seed=0)
    write_run(tmp_path / "run", trace)
    assert run_layout(tmp_path / "run").steps.tolist() == [0, 1, 2, 3, 4]
