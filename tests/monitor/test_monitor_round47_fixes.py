"""Red team round 9 F2b: one op cannot poison a window whatever the order its parts and the step
after it arrive in. Parts of window_steps steps (the window closes the moment its last rank's
part 0 comes, before any rank's step after it): an op of 3,000 s at the window's last step of
rank 3 made S 1,863 and fired `severe` when the window was cut before rank 3's next part. The
tracker holds such a window until the step after is known (every rank's, or gap_wait_s after
the first rank's, or the job's stall/finish) and the window judges the op by what is known
then; a rank really held after its collectives (the others' next step waits for it) is kept.
Real trackers, the engine's real analysis, an injected clock (no sleeps)."""

from __future__ import annotations

import numpy as np
import pytest

from monitor_jobs import parts_of, slow_job, write_parts
from stragglers.monitor.parts import read_part_footer
from stragglers.monitor.windows import JobTracker, analyse_window
from stragglers.trace.runformat import rank_file_name


def job(poison: float = 3000.0, held: float = 0.0):
    """Parts of 5 steps of a 6-step dp2 x pp2 job: part 0 (steps 0-4) and part 1 (step 5) of
    each rank. Rank 3's latest op of step 4 lasts `poison` s (an op that did not happen), or
    `held` s longer (rank 3 really held after its collectives: the others' step 5 ends that
    much later, rank 3's own step 5 begins that much later)."""
    trace = slow_job(steps=6, slow=None)
    parts = []
    for rank, n, cols in parts_of(trace, 5):
        cols = {k: v.copy() for k, v in cols.items()}
        end = cols["start_ts"] + cols["duration"]
        if rank == 3 and n == 0:
            k = int(np.argmax(np.where(cols["step"] == 4, end, -np.inf)))
            cols["duration"][k] = poison if poison else cols["duration"][k] + held
        if held and n == 1 and rank == 3:
            cols["start_ts"] += held
        elif held and n == 1:
            cols["duration"][int(np.argmax(end))] += held
        parts.append((rank, n, cols))
    return trace, parts


def add(tracker: JobTracker, parts, at: float, files=None) -> None:
    for rank, n, cols in parts:
        f = read_part_footer(files / rank_file_name(rank, n)) if files else None
        tracker.add_part(rank, n, int(cols["step"].max()), None if f else cols, at, f)


def judged(window):
    row, refused = analyse_window(window)
    assert row.error is None, row.error
    return row, refused


def test_a_window_cut_before_any_ranks_step_after_waits_for_it_then_judges_the_op():
    trace, parts = job()
    tracker = JobTracker("j", trace.meta, window_steps=5, gap_wait_s=0.5)
    add(tracker, [p for p in parts if p[1] == 0], 1.0)
    assert tracker.close_ready(1.1) == []   # (cut here before the fix: S 1,863)
    add(tracker, [p for p in parts if p[1] == 1 and p[0] != 3], 2.0)   # rank 3: nothing more
    assert tracker.close_ready(2.1) == []   # (rank 3's step 5 waited for gap_wait_s)
    [window] = tracker.close_ready(2.7)
    row, refused = judged(window)
    assert row.slowdown < 1.5, row.slowdown
    assert [source for source, _ in refused] == ["job j rank 3"], refused
    assert refused[0][1].startswith("step 4: an op of 3000 s ends"), refused


def test_a_held_window_whose_rank_sends_nothing_more_is_judged_by_the_others_at_the_finish():
    trace, parts = job()
    tracker = JobTracker("j", trace.meta, window_steps=5, gap_wait_s=0.5)
    add(tracker, [p for p in parts if p[1] == 0], 1.0)
    assert tracker.close_ready(100.0) == []   # (no rank's step after: until a stall/finish)
    window = tracker.close_partial("finished", 101.0)
    assert window.steps == [0, 1, 2, 3, 4]
    row, refused = judged(window)
    assert row.slowdown < 1.5, row.slowdown   # (1,863 before)
    assert [source for source, _ in refused] == ["job j rank 3"], refused
    assert "every other rank shows of it" in refused[0][1], refused


def test_part_files_cut_before_any_step_after_judge_the_op_by_the_other_ranks(tmp_path):
    # (a part file's rows are read by its window: not held, judged by what is known then)
    trace, parts = job()
    write_parts(tmp_path, parts)
    tracker = JobTracker("j", trace.meta, window_steps=5, gap_wait_s=0.5)
    add(tracker, [p for p in parts if p[1] == 0], 1.0, files=tmp_path)
    [window] = tracker.close_ready(1.1)
    row, refused = judged(window)
    assert row.slowdown < 1.5, row.slowdown
    assert [source for source, _ in refused] == ["job j rank 3"], refused


def test_an_op_whose_part_also_holds_a_step_after_to_match_is_judged_by_the_others():
    # one part of rank 3 holds steps 0-5: the op of 3,000 s at step 4 and a step 5 begun after
    # it (its own next step proves nothing); the others' step 5 (their next parts) ended ~0.1 s
    # after their step 4: the window waits for them and leaves step 4 out
    trace, parts = job()
    three = [c for r, _, c in parts if r == 3]
    three[1] = {**three[1], "start_ts": three[1]["start_ts"] + 3000.0}
    merged = {k: np.concatenate([c[k] for c in three]) for k in three[0]}
    tracker = JobTracker("j", trace.meta, window_steps=5, gap_wait_s=30.0)
    add(tracker, [p for p in parts if p[1] == 0 and p[0] != 3] + [(3, 0, merged)], 1.0)
    assert tracker.close_ready(1.1) == []   # (cut here before: rank 3's own step 5 sufficed)
    add(tracker, [p for p in parts if p[1] == 1 and p[0] != 3], 2.0)
    [window] = tracker.close_ready(2.1)
    row, refused = judged(window)
    assert row.slowdown < 1.5, row.slowdown
    assert [source for source, _ in refused] == ["job j rank 3"], refused
    assert refused[0][1].startswith("step 4: an op of 3000 s ends"), refused


@pytest.mark.parametrize("rank3", ["with the others", "after the gap wait"])
def test_a_rank_really_held_after_its_collectives_is_kept_whatever_the_order(rank3):
    trace, parts = job(poison=0.0, held=30.0)
    tracker = JobTracker("j", trace.meta, window_steps=5, gap_wait_s=0.5)
    add(tracker, [p for p in parts if p[1] == 0], 1.0)
    assert tracker.close_ready(1.1) == []   # (suspected: only the step after can tell)
    later = [p for p in parts if p[1] == 1 and (p[0] != 3 or rank3 == "with the others")]
    add(tracker, later, 2.0)
    [window] = tracker.close_ready(2.1 if rank3 == "with the others" else 2.7)
    row, refused = judged(window)
    assert refused == [] and row.missing_ranks == [], refused
    assert row.steps == [0, 1, 2, 3, 4] and row.slowdown > 2.0, row.slowdown   # (it happened)


def test_a_window_with_no_suspect_op_is_cut_at_once():
    trace, parts = job(poison=0.0)
    tracker = JobTracker("j", trace.meta, window_steps=5, gap_wait_s=30.0)
    add(tracker, [p for p in parts if p[1] == 0], 1.0)
    [window] = tracker.close_ready(1.1)   # (no wait added to a window without a suspect)
    row, refused = judged(window)
    assert refused == [] and row.slowdown < 1.5, (refused, row.slowdown)


def test_a_watched_root_not_named_in_utf8_is_said_unwatchable_in_one_line(tmp_path):
    # (round 9 F5's class: the watch process's own refusal raised UnicodeEncodeError twice,
    # in watchfiles and in encoding its line: a traceback and status 1, not UNWATCHABLE)
    import os
    import subprocess
    import sys

    from stragglers.monitor.watch_child import UNWATCHABLE
    root = tmp_path / os.fsdecode(b"runs-\xff")
    root.mkdir()
    p = subprocess.run([sys.executable, "-m", "stragglers.monitor.watch_child", str(root)],
                       stdin=subprocess.DEVNULL, capture_output=True, timeout=120)
    assert p.returncode == UNWATCHABLE, p.stderr[-500:]
    [line] = p.stderr.decode().splitlines()
    assert line.startswith("stragglers monitor: cannot watch ") and "runs-\\xff" in line, line


@pytest.mark.parametrize("config, name", [("monitor", "rescan_s"), ("monitor", "stall_after_s"),
                                          ("shard", "control_idle_s"), ("shard", "stall_s")])
def test_every_duration_setting_is_bounded_by_what_a_timer_can_wait(config, name):
    # (round 9 F3's class, in config.setting's checks: rescan_s 1e19 killed the rescan thread
    # on OverflowError; every *_s of both services' settings goes through the same check)
    import threading

    from stragglers.adapt.service import ServiceConfig
    from stragglers.config import MAX_DURATION_S
    from stragglers.errors import InputError
    from stragglers.monitor.settings import MonitorConfig
    cls = MonitorConfig if config == "monitor" else ServiceConfig
    with pytest.raises(InputError, match=name):
        cls.from_mapping({name: 1e19}, "settings")
    if config == "monitor":   # (no maximum of its own: the timer's)
        assert getattr(cls.from_mapping({name: MAX_DURATION_S}, "settings"),
                       name) == MAX_DURATION_S
    assert threading.Event().wait(0) is False and MAX_DURATION_S < threading.TIMEOUT_MAX
    assert cls.from_mapping({"restore_bytes_per_s" if config == "shard" else
                             "body_min_bytes_per_s": 1e12}, "settings")   # (a rate: no duration)
