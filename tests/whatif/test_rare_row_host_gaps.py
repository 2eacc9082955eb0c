"""A rare row's launch delay (its wait on the place the model guessed for it) stays exact for
the measured replay, while its worker's gap is read from its own previous op (timing.host_gaps):
the replay reproduces the record, and no wait on a guess reads as the worker's stall."""

from __future__ import annotations

import numpy as np
import pytest
from test_spurious_rows_at_honest_ranks import STEPS, _with_row

from stragglers.trace.model import Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze_with_model
from stragglers.whatif._replay import replay
from stragglers.whatif.timing import host_gaps

# rank 3 is (dp 1, pp 1), off the first DP rank the model is built from: its row is placed
# after its last backward, where it did not run (it ran right after the optimizer)
RANK = 3


def _rare(w) -> tuple[int, int]:
    """(the one template op most replica-steps lack, its DP index in the grid)."""
    (node,) = np.flatnonzero(~w.grid.held())
    return int(node), int(np.flatnonzero(w.grid.present[node].any(axis=1))[0])


@pytest.fixture(scope="module")
def clean() -> Trace:
    return generate(dp=2, pp=2, microbatches=4, steps=STEPS, seed=0)


def test_the_replay_stays_exact_and_the_guess_is_no_gap(clean):
    _, w = analyze_with_model(_with_row(clean, RANK, "forward-compute", 4, 4))
    node, d = _rare(w)
    g = w.grid
    # its launch delay is its whole wait on the guess (the step's last microbatches, the
    # all-reduce, the optimizer), which the replay needs to start it where it was recorded
    assert (w.launch_delay[node, d] > 0.05).all(), w.launch_delay[node, d]
    _, _, end = replay(w.plan, w.cost, w.step_start, w.launch_delay, keep_timeline=True)
    assert np.array_equal(np.where(g.present, end, 0.0),
                          np.where(g.present, g.start + g.duration, 0.0))
    gaps = w.host_gap          # computed once with the launch delays, read by both readers
    assert np.array_equal(gaps, host_gaps(g, w.launch_delay))
    # 1 µs after its optimizer ended: that is its worker's gap
    assert np.allclose(gaps[node, d], 1e-6, atol=1e-9), gaps[node, d]
    # every other row (held: the schedule's) reads its launch delay unchanged
    others = np.arange(len(gaps)) != node
    assert np.array_equal(gaps[others], w.launch_delay[others])


def test_a_real_gap_before_a_rare_row_still_counts(clean):
    """The same row begun 50 ms after its worker's optimizer ended: those 50 ms are its
    worker's gap (no guess in them)."""
    trace = _with_row(clean, RANK, "forward-compute", 4, 4)
    o = trace.ops
    o["start_ts"][(o["rank"] == RANK) & (o["mb_id"] == 4)] += 0.05
    _, w = analyze_with_model(trace)
    node, d = _rare(w)
    gaps = w.host_gap
    assert np.allclose(gaps[node, d], 0.05 + 1e-6, atol=1e-9), gaps[node, d]
    assert (w.launch_delay[node, d] > gaps[node, d] + 0.05).all()


def test_a_trace_without_rare_rows_reads_its_launch_delays(clean):
    """(no copy of the job's delays where every row is the schedule's)"""
    _, w = analyze_with_model(clean)
    assert w.grid.held().all()
    assert host_gaps(w.grid, w.launch_delay) is w.launch_delay
    assert w.host_gap is w.launch_delay
