"""Review of session 47 (hR): the window last-step bound on ranks whose clocks are apart; a new
job's first meta not paced as a change; /health's stuck reads counting the window readers.
Real trackers and the engine's real analysis; real servers on loopback."""

from __future__ import annotations

import numpy as np
import pytest

from monitor_jobs import parts_of, slow_job
from stragglers.monitor.windows import JobTracker, analyse_window


def skewed_parts(shift: dict[int, float], steps: int = 12, per_part: int = 1,
                 poison: float = 0.0):
    """A dp2 x pp2 job's parts, each rank's timestamps moved by shift[rank] s (clocks not
    aligned); rank 3's latest op of step 4 lasts `poison` s where given."""
    trace = slow_job(steps=steps, slow=None)
    parts = []
    for rank, n, cols in parts_of(trace, per_part):
        cols = {k: v.copy() for k, v in cols.items()}
        if poison and rank == 3 and (cols["step"] == 4).any():
            end = cols["start_ts"] + cols["duration"]
            cols["duration"][int(np.argmax(np.where(cols["step"] == 4, end, -np.inf)))] = poison
        cols["start_ts"] = cols["start_ts"] + shift.get(rank, 0.0)
        parts.append((rank, n, cols))
    return trace, parts


@pytest.mark.parametrize("skew", [5.0, -5.0])
def test_a_rank_whose_clock_is_seconds_off_keeps_every_windows_last_step(skew):
    # (hR_skew.py: rank 3 +5 s refused step 4 and step 9, every window's last step, before)
    trace, parts = skewed_parts({3: skew})
    tracker = JobTracker("j", trace.meta, window_steps=5, gap_wait_s=0.0)
    for rank, n, cols in parts:
        tracker.add_part(rank, n, int(cols["step"].max()), cols, 1.0)
    windows = tracker.close_ready(2.0)
    assert [w.steps for w in windows] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    for w in windows:
        row, refused = analyse_window(w)
        assert row.error is None, row.error
        assert refused == [], refused
        assert row.steps == w.steps


@pytest.mark.parametrize("shift", [{3: -5.0}, {0: 5.0, 1: 5.0}, {}])
def test_one_poisoned_op_is_still_caught_with_clocks_apart_and_its_step_not_listed(shift):
    # parts of 5 steps, the window cut the moment rank 3's part 0 came (no step after known):
    # the op of 3,000 s is judged by the others' spans, whatever their clocks
    trace, parts = skewed_parts(shift, steps=6, per_part=5, poison=3000.0)
    tracker = JobTracker("j", trace.meta, window_steps=5, gap_wait_s=0.5)
    for rank, n, cols in [p for p in parts if p[1] == 0]:
        tracker.add_part(rank, n, int(cols["step"].max()), cols, 1.0)
    assert tracker.close_ready(1.1) == []   # (held for the others' step after)
    window = tracker.close_partial("finished", 2.0)
    row, refused = analyse_window(window)
    assert row.error is None, row.error
    assert row.slowdown < 1.5, row.slowdown
    assert [source for source, _ in refused] == ["job j rank 3"], refused
    assert refused[0][1].startswith("step 4: an op of 3000 s ends"), refused
    # (the row listed step 4 as analysed before)
    assert (row.first_step, row.last_step, row.steps) == (0, 4, [0, 1, 2, 3])
