"""A run directory read in step partitions rebuilds a collective some workers lost as the whole
trace's analysis does (whatif/rebuild.py): left out there, a healthy rank's wait for a 3x
straggler in it became a launch delay and `stragglers analyze RUN` named that rank a host stall
that the in-memory analysis did not."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import REPO
from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.runformat import read_run, write_run
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.grid import OPS_LEFT_OUT
from stragglers.whatif.partitioned import analyze_run
from stragglers.whatif.rebuild import rebuild_in_parts, rebuild_lost

sys.path.insert(0, str(REPO / "tests" / "whatif"))
from same_results import assert_same  # noqa: E402
from test_whatif_odd_op_sets import without  # noqa: E402

# (job, the rank that lost the collective, the collective): the straggler's healthy peer lost
# its wait (dp 2 x pp 1), the straggler's pipeline peer lost a cross-stage one (2 x 2)
LOST = {
    "gradient collective": (dict(dp=2, pp=1, microbatches=4, steps=8), 1, "grads-reduce-scatter"),
    "embedding all-reduce": (dict(dp=2, pp=2, microbatches=4, steps=6), 2,
                             "embedding-grads-all-reduce"),
}


def causes(r) -> list[tuple]:
    return [(f.cause, [(w.dp, w.pp) for w in f.where.workers]) for f in r.diagnosis]


@pytest.mark.parametrize("name", list(LOST))
def test_a_run_directory_rebuilds_a_lost_collective_as_the_whole_trace(tmp_path, name):
    # before: every partition count read S 1.498 (gradient) / 1.603 (embedding) with
    # host_stall at the healthy rank beside the worker fault; the whole trace 1.494 / 1.600
    job, rank, optype = LOST[name]
    trace = without(generate(**job, seed=0, slow_worker=(0, 0, 3.0)), rank, optype)
    whole = analyze(read_run(write_run(tmp_path / "run", trace)), steps="all")
    assert abs(whole.slowdown - analyze(trace, steps="all").slowdown) < 1e-12
    assert causes(whole) == [("worker_fault", [(0, 0)])] and "Rebuilt" in whole.warnings[0]
    for partitions in (1, 2, 3):
        r = analyze_run(tmp_path / "run", steps="all", partitions=partitions)[0]
        assert causes(r) == causes(whole), (partitions, causes(r))
        assert r.warnings[0] == whole.warnings[0] and r.warnings[0].startswith(OPS_LEFT_OUT)
        assert_same(whole, r)


def test_an_op_one_partition_cannot_rebuild_is_set_back_in_the_others():
    # one stage, worker 0 ran ops 1 and 2 (all-reduces), worker 1 lost both; step 0 in one
    # partition, step 1 in another. In step 1 worker 1's op 0 ends past op 1's group end (1.6
    # > 1.5): op 1 is not rebuilt, so op 2 begins where op 0 ended in both steps, as in the
    # whole job (in step 0 a rebuilt op 1 would have made it begin at 1.5, not 1.0)
    start = np.array([[[0.0, 0.0], [0.0, 0.0]], [[1.0, 1.0], [np.nan] * 2],
                      [[1.5, 1.5], [np.nan] * 2], [[2.0, 2.0], [2.0, 2.0]]])
    duration = np.array([[[1.0, 1.0], [1.0, 1.6]], [[0.5, 0.5], [0.0, 0.0]],
                         [[0.5, 0.5], [0.0, 0.0]], [[1.0, 1.0], [1.0, 1.0]]])
    present = ~np.isnan(start)
    row = np.where(present, np.arange(16).reshape(4, 2, 2), -1)
    stage, seq = np.zeros(4, np.int32), np.arange(4)
    code = np.full(4, OPTYPE_CODES["all-reduce"], np.int8)
    lost = np.array([False, True, True, False])
    whole = [a.copy() for a in (start, duration, row, present)]
    want = rebuild_lost(*whole, stage, code, seq, lost, np.ones(2, bool))
    parts = [tuple(a[:, :, t:t + 1].copy() for a in (start, duration, row, present))
             + (np.ones(1, bool),) for t in (0, 1)]
    got = rebuild_in_parts(parts, stage, code, seq, lost)
    assert want.tolist() == got.tolist() == [False, False, True, False]
    for a, joined in zip(whole, (np.concatenate([p[i] for p in parts], axis=2)
                                 for i in range(4))):
        assert np.array_equal(a, joined, equal_nan=True)
    assert np.allclose([whole[0][2, 1], whole[1][2, 1]], [[1.0, 1.6], [1.0, 0.4]])


def test_the_cli_names_the_rebuilt_collective_in_one_warning_line(tmp_path):
    from typer.testing import CliRunner

    from stragglers.cli import app

    job, rank, optype = LOST["gradient collective"]
    write_run(tmp_path / "run", without(generate(**job, seed=0, slow_worker=(0, 0, 3.0)),
                                        rank, optype))
    out = CliRunner().invoke(app, ["analyze", str(tmp_path / "run")])   # (80 columns: one line still)
    assert out.exit_code == 0, out.output
    said = [line for line in out.output.splitlines() if OPS_LEFT_OUT in line]
    assert len(said) == 1 and said[0].startswith(f"warning: {OPS_LEFT_OUT}: "), said
    assert said[0].endswith("Rebuilt at the workers that lack them, ending with their group and "
                            "begun after the worker's previous op (its wait kept as a wait): "
                            "grads-reduce-scatter #0 on stage 0 (run by DP rank(s) 0, not by 1)")
    assert "Worker fault" in out.output and "Host-side stall" not in out.output
