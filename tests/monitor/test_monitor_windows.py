"""Window assembly: complete steps on every rank, parts out of order, gaps, late rows."""

from __future__ import annotations

import numpy as np

from monitor_jobs import parts_of, rank_of, slow_job
from stragglers.monitor.windows import JobTracker, analyse_window


def tracker_for(trace, window_steps=5, gap_wait_s=30.0):
    return JobTracker("job", trace.meta, window_steps, gap_wait_s)


def test_window_closes_only_when_every_rank_finished_its_steps():
    trace = slow_job(steps=12)
    tr = tracker_for(trace)
    parts = parts_of(trace, steps_per_part=3)          # parts 0..3, steps 0-2, 3-5, ...
    ranks = sorted({r for r, _, _ in parts})
    # Every rank but the last sends parts 0 and 1 (steps 0..5): no window yet.
    for rank, part, cols in parts:
        if part <= 1 and rank != ranks[-1]:
            tr.add_part(rank, part, int(cols["step"].max()), cols, 0.0)
    assert tr.close_ready(0.0) == []
    # The last rank's part 1 arrives before its part 0: still nothing (part 0 is missing).
    last = [p for p in parts if p[0] == ranks[-1]]
    tr.add_part(ranks[-1], 1, int(last[1][2]["step"].max()), last[1][2], 0.0)
    assert tr.close_ready(0.0) == []
    tr.add_part(ranks[-1], 0, int(last[0][2]["step"].max()), last[0][2], 0.0)
    (w,) = tr.close_ready(0.0)
    assert w.steps == [0, 1, 2, 3, 4] and w.missing_ranks == []
    assert set(np.unique(w.trace.ops["step"])) == set(range(5))
    assert set(np.unique(w.trace.ops["rank"])) == set(ranks)
    # Step 5 stays pending: only the rows of steps not yet analysed are held.
    assert set(np.unique(np.concatenate([c["step"] for c in tr.chunks]))) == {5}
    assert tr.close_ready(0.0) == []


def test_a_part_that_never_arrives_is_given_up_after_gap_wait():
    trace = slow_job(steps=12)
    tr = tracker_for(trace, window_steps=3, gap_wait_s=10.0)
    for rank, part, cols in parts_of(trace, steps_per_part=3):
        if (rank, part) != (0, 1):                     # rank 0's part 1 was dropped
            tr.add_part(rank, part, int(cols["step"].max()), cols, 100.0)
    first = tr.close_ready(105.0)                      # within gap_wait: only steps 0-2
    assert [w.steps for w in first] == [[0, 1, 2]]
    later = tr.close_ready(111.0)                      # gap given up: the rest closes
    assert [w.steps for w in later] == [[3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert later[0].missing_ranks == [0]               # rank 0 has no rows in steps 3-5
    assert tr.skipped_parts() == 1


def test_rows_of_analysed_steps_are_dropped_and_partial_close_names_missing_ranks():
    trace = slow_job(steps=8)
    tr = tracker_for(trace, window_steps=4)
    parts = parts_of(trace, steps_per_part=4)
    for rank, part, cols in parts:
        if part == 0:
            tr.add_part(rank, part, int(cols["step"].max()), cols, 0.0)
    (w,) = tr.close_ready(0.0)
    assert w.steps == [0, 1, 2, 3]
    # A re-sent old part under a new number adds nothing to pending rows.
    rank, _, cols = parts[0]
    tr.add_part(rank, 7, int(cols["step"].max()), cols, 0.0)
    assert tr.pending_rows == 0 and tr.late_rows == len(cols["step"])
    # Only two ranks send steps 4-7, then the job stalls: the window closes without the others.
    for rank, part, cols in parts:
        if part == 1 and rank in (0, 1):
            tr.add_part(rank, part, int(cols["step"].max()), cols, 0.0)
    assert tr.close_ready(0.0) == []
    w = tr.close_partial("stalled", 0.0)
    assert w.steps == [4, 5, 6, 7] and w.missing_ranks == [2, 3] and w.reason == "stalled"


def test_window_analysis_scores_the_slow_worker_hottest_with_rank_and_host():
    trace = slow_job(steps=10, slow=(1, 1, 3.0))
    tr = tracker_for(trace, window_steps=10)
    for rank, part, cols in parts_of(trace, steps_per_part=5):
        tr.add_part(rank, part, int(cols["step"].max()), cols, 0.0)
    (w,) = tr.close_ready(0.0)
    row, refused = analyse_window(w)
    assert row.error is None and row.slowdown > 1.3 and refused == []
    hot = max(row.scores, key=lambda s: s.score)
    slow_rank = rank_of(trace, 1, 1)
    assert (hot.dp, hot.pp, hot.rank) == (1, 1, slow_rank)
    assert hot.host == f"host{slow_rank % 2}"
    fault = [f for f in row.diagnosis if f.cause == "worker_fault"]
    assert fault and fault[0].ranks == [slow_rank]
    assert f"rank {slow_rank}" in fault[0].headline


def test_windows_read_from_part_files_hold_exactly_the_rows_of_held_columns(tmp_path):
    # parts of 3 steps, windows of 5: a part reaching past a window is read by both windows
    from stragglers.monitor.parts import read_part_footer
    from stragglers.trace.runformat import write_rank
    trace = slow_job(steps=12)
    parts = parts_of(trace, steps_per_part=3)
    held, files = tracker_for(trace), tracker_for(trace)
    for rank, part, cols in parts:
        held.add_part(rank, part, int(cols["step"].max()), cols, 0.0)
        f = read_part_footer(write_rank(tmp_path, rank, cols, part=part))
        files.add_part(rank, part, f.last_step, None, 0.0, f)
    a, b = held.close_ready(0.0), files.close_ready(0.0)
    assert [w.steps for w in a] == [w.steps for w in b] == [list(range(5)), list(range(5, 10))]
    assert files.pending_rows == sum(len(c["step"]) for _, p, c in parts if p == 3)
    for wa, wb in zip(a, b):
        assert wb.trace is None and wb.missing_ranks == wa.missing_ranks == []
        tb, refused = wb.load()
        assert refused == []
        order_a = np.lexsort((wa.trace.ops["start_ts"], wa.trace.ops["rank"]))
        order_b = np.lexsort((tb.ops["start_ts"], tb.ops["rank"]))
        assert sorted(tb.ops) == sorted(wa.trace.ops)
        for k in wa.trace.ops:
            assert np.array_equal(tb.ops[k][order_b], wa.trace.ops[k][order_a]), k
    assert analyse_window(b[0])[0].slowdown == analyse_window(a[0])[0].slowdown


def test_read_ahead_holds_parts_until_the_window_that_ends_them_and_stays_bounded(tmp_path):
    from stragglers.monitor.parts import read_part_file, read_part_footer
    from stragglers.monitor.readahead import ReadAhead
    from stragglers.trace.runformat import write_rank
    trace = slow_job(steps=6)
    files = [read_part_footer(write_rank(tmp_path, r, c, part=p))
             for r, p, c in parts_of(trace, steps_per_part=3)]
    rows = sum(f.records for f in files)
    ahead = ReadAhead(max_rows=rows - 1)         # one part too many: the last is left out
    ahead.add(files)
    assert ahead.rows == rows - files[-1].records
    got = ahead.take(files, last_step=2)           # a window of steps 0..2
    assert sorted(got) == sorted(str(f.path) for f in files[:-1])
    for f in files[:-1]:
        alone = read_part_file(f.path).columns
        assert all(np.array_equal(got[str(f.path)].columns[k], v) for k, v in alone.items())
    # parts ending at step 2 are let go; those reaching step 5 stay for the next window
    assert ahead.rows == sum(f.records for f in files[:-1] if f.last_step > 2)
    ahead.take(files, last_step=5)
    assert ahead.rows == 0 and ahead.take(files, last_step=5) == {}


def _rows(trace, rank, steps):
    o = trace.ops
    sel = (o["rank"] == rank) & np.isin(o["step"], list(steps))
    return {k: v[sel] for k, v in o.items()}


def _wild_rank_0():
    """A 4-rank job's tracker (windows of 5 steps, gap_wait_s 30) after steps 0-4 of every rank,
    rank 0's part 1 holding one step at 900,000, and steps 5-9 of ranks 1-3; and its trace."""
    trace = slow_job(steps=20, slow=None)
    tr = tracker_for(trace, window_steps=5, gap_wait_s=30.0)
    for r in range(4):
        tr.add_part(r, 0, 4, _rows(trace, r, range(5)), 1.0)
    wild = _rows(trace, 0, [5])
    wild["step"] = np.full_like(wild["step"], 900_000)
    tr.add_part(0, 1, 900_000, wild, 2.0)
    for r in range(1, 4):
        tr.add_part(r, 1, 9, _rows(trace, r, range(5, 10)), 3.0)
    return trace, tr


def test_one_wild_step_does_not_leave_its_rank_out_of_later_windows():
    # rank 0's part 1 holds one step at 900,000 (inside the step-gap bound): its frontier jumped
    # there, and the window of steps 5-9 was cut without rank 0 (its real part came late and
    # was dropped, window after window)
    trace, tr = _wild_rank_0()
    assert [w.steps for w in tr.close_ready(4.0)] == [[0, 1, 2, 3, 4]]
    assert tr.close_ready(31.9) == []          # rank 0 waited for as a missing part is
    tr.add_part(0, 2, 9, _rows(trace, 0, range(5, 10)), 32.0)
    [w] = tr.close_ready(32.0)
    assert (w.steps, w.missing_ranks) == ([5, 6, 7, 8, 9], [])


def test_a_rank_past_a_window_without_its_rows_is_waited_for_gap_wait_s_only():
    _, tr = _wild_rank_0()
    tr.close_ready(4.0)
    [w] = tr.close_ready(32.0)                 # 30 s after rank 0's latest part: without it
    assert (w.steps, w.missing_ranks) == ([5, 6, 7, 8, 9], [0])
