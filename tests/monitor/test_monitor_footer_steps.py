"""A watched file checked from its footer knows only its step range: a window whose last step
lies strictly inside that range reads the file's step column before counting its rank present
there, or taking the range's steps as steps of the job (a part of steps 0..3 and 29 once made
the window of steps 0..4 close without the rank's step 4, dropped as late when it came; a run
sampled every 2nd step had windows of 5 "steps" holding 3)."""

from __future__ import annotations

import numpy as np

from monitor_jobs import slow_job
from stragglers.monitor.part_footers import read_part_footer
from stragglers.monitor.windows import JobTracker
from stragglers.trace.runformat import write_rank


def rows_of(trace, rank: int, steps) -> dict:
    o = trace.ops
    sel = (o["rank"] == rank) & np.isin(o["step"], list(steps))
    return {k: v[sel] for k, v in o.items()}


def footer_file(directory, rank: int, part: int, cols: dict):
    """The part written as a recorder writes it, checked from its footer alone."""
    file = read_part_footer(write_rank(directory, rank, cols, part=part))
    assert file is not None and not isinstance(file, Exception) and file.steps is None
    return file


def add(tr: JobTracker, file, now: float) -> None:
    tr.add_part(file.rank, file.part, file.last_step, None, now, file)


def test_a_window_inside_a_footer_checked_files_range_waits_for_the_steps_it_lacks(tmp_path):
    """Rank 0's watched part 0 holds steps 0..3 and 29 (enough rows that its footer passes):
    the window of steps 0..4 waits for rank 0's step 4 (its part 1) instead of being cut with
    the rank taken as present by the range, its step 4 then dropped as late."""
    trace = slow_job(steps=30, slow=None)
    tr = JobTracker("j", trace.meta, 5, gap_wait_s=10.0)
    add(tr, footer_file(tmp_path, 0, 0, rows_of(trace, 0, [0, 1, 2, 3, 29])), 100.0)
    for rank in (1, 2, 3):
        add(tr, footer_file(tmp_path, rank, 0, rows_of(trace, rank, range(0, 30))), 100.0)
    assert tr.close_ready(101.0) == []
    add(tr, footer_file(tmp_path, 0, 1, rows_of(trace, 0, range(4, 29))), 102.0)
    windows = tr.close_ready(102.0)
    assert [w.steps for w in windows] == [list(range(i, i + 5)) for i in range(0, 30, 5)]
    assert all(w.missing_ranks == [] for w in windows)
    assert tr.late_rows == 0


def test_a_run_sampled_every_other_step_has_windows_of_its_steps_cut_at_once(tmp_path):
    """Every rank's watched part holds steps 0, 2, .., 28 (a recorder sampling every 2nd
    step): the windows hold 5 recorded steps each and are cut at once, not waited for."""
    trace = slow_job(steps=30, slow=None)
    tr = JobTracker("j", trace.meta, 5, gap_wait_s=10.0)
    for rank in range(4):
        add(tr, footer_file(tmp_path, rank, 0, rows_of(trace, rank, range(0, 30, 2))), 100.0)
    windows = tr.close_ready(100.0)
    assert [w.steps for w in windows] == [list(range(i, i + 10, 2)) for i in range(0, 30, 10)]
    assert all(w.missing_ranks == [] for w in windows)


def test_a_footer_checked_file_that_cannot_be_read_again_keeps_its_range(tmp_path):
    """A held file gone before its steps are read (deleted by the operator) is taken by its
    range, as before: its window is not held for it."""
    trace = slow_job(steps=30, slow=None)
    tr = JobTracker("j", trace.meta, 5, gap_wait_s=10.0)
    files = [footer_file(tmp_path, rank, 0, rows_of(trace, rank, range(0, 30)))
             for rank in range(4)]
    for f in files:
        add(tr, f, 100.0)
    files[0].path.unlink()
    windows = tr.close_ready(100.0)
    assert [w.steps[0] for w in windows] == [0, 5, 10, 15, 20, 25]
