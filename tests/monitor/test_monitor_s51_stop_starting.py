"""The analysis process is stopped even while it is still starting (round 15 #1), and a stored
window shown again after a restart is not counted again (round 15 #2)."""

from __future__ import annotations

import multiprocessing
import signal
import sys
import threading

from conftest import REPO
from stragglers.monitor.analyser import WindowAnalyser
from stragglers.monitor.metrics import MonitorMetrics
from stragglers.monitor.windows import JobTracker

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import parts_of, slow_job  # noqa: E402


def test_a_process_still_starting_is_killed_when_stopped():
    """_stop on a process that has not yet answered (spawned, still importing): it is killed
    (SIGKILL) by the analyser's own handle, not left to finish starting and exit on its own."""
    analyser = WindowAnalyser()
    try:
        process = analyser._executor()
        analyser._stop(process)
        process.process.join(30)
        assert process.process.exitcode == -signal.SIGKILL, process.process.exitcode
        assert analyser.restarts == 1
    finally:
        analyser.close()


def test_a_window_shown_again_is_not_counted_again():
    """show_window (a restart's latest stored window) sets S and window_failed without
    adding to stragglers_windows_total or the analysis time histogram."""
    trace = slow_job(steps=5, slow=(1, 1, 3.0))
    tr = JobTracker("job-a", trace.meta, 5, 30.0)
    for rank, part, cols in parts_of(trace, steps_per_part=5):
        tr.add_part(rank, part, int(cols["step"].max()), cols, 0.0)
    (window,) = tr.close_ready(0.0)
    analyser = WindowAnalyser(in_process=True)
    row, _ = analyser.analyse(window)
    metrics = MonitorMetrics()
    metrics.show_window(row)
    r = metrics.registry
    assert r.get_sample_value("stragglers_slowdown", {"job": "job-a"}) > 1.3
    assert r.get_sample_value("stragglers_window_failed", {"job": "job-a"}) == 0.0
    assert r.get_sample_value("stragglers_windows_total", {"job": "job-a"}) is None
    assert r.get_sample_value("stragglers_window_analysis_seconds_count") == 0.0
    metrics.publish_window(row)
    assert r.get_sample_value("stragglers_windows_total", {"job": "job-a"}) == 1.0
    assert r.get_sample_value("stragglers_window_analysis_seconds_count") == 1.0


def test_a_task_queued_before_a_window_does_not_count_in_its_limit():
    """A task ahead of the window in the analysis process (as a read-ahead of watched parts)
    holds it past the window's limit (0.5 s): the window is analysed once it starts, not
    stopped (its limit counted from its hand-over before round 15 #1)."""
    trace = slow_job(steps=10, slow=(1, 1, 3.0))
    tr = JobTracker("job-a", trace.meta, 5, 30.0)
    for rank, part, cols in parts_of(trace, steps_per_part=5):
        tr.add_part(rank, part, int(cols["step"].max()), cols, 0.0)
    first, second = tr.close_ready(0.0)
    analyser = WindowAnalyser(timeout_s=60.0)
    with multiprocessing.Manager() as manager:
        try:
            row, _ = analyser.analyse(first)   # (started and warm)
            assert row.error is None
            analyser.timeout_s = 0.5
            release = manager.Event()
            ahead = analyser._executor().submit(release.wait, 60)
            out: list = []
            t = threading.Thread(target=lambda: out.append(analyser.analyse(second)[0]))
            t.start()
            t.join(1.0)   # (past the limit while the task ahead holds the process)
            release.set()
            t.join(60)
            assert ahead.result(60) is True
            assert out[0].error is None and out[0].slowdown > 1.3, out[0].error
            assert analyser.stopped == 0 and analyser.restarts == 0
        finally:
            analyser.close()
