"""Red team round sixteen (issue 34): the monitor's analysis process, its drop counts and
stored baselines across new runs and restarts, and hostile requests against real servers on
loopback.

Each test is one defect class (its xfail(strict=True) mark went with its fix, branch
s52-rtm16). Real analysis process (spawned), real monitor on loopback, real SQLite.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import pytest

from conftest import REPO
from stragglers.monitor.analyser import WindowAnalyser
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.windows import JobTracker, Window

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import parts_of, slow_job  # noqa: E402

TOKEN = "hostile-round16-token-0123456789"
MONITOR = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


def _windows(n: int) -> list[Window]:
    """n closed 5-step windows of a 2x2 job with one slow worker."""
    trace = slow_job(steps=n * 5, slow=(1, 1, 3.0))
    tr = JobTracker("job-a", trace.meta, 5, 30.0)
    for rank, part, cols in parts_of(trace, steps_per_part=5):
        tr.add_part(rank, part, int(cols["step"].max()), cols, 0.0)
    out = tr.close_ready(0.0)
    assert len(out) == n
    return out


def test_a_process_that_never_starts_the_window_is_stopped_and_the_window_kept():
    """Leftover 1: the analysis process holds a task before the window that never ends (as
    a process hung while importing the engine). Nothing bounded the wait for it to start the
    window: the analysis thread, and every job's windows, waited for good. With
    analysis_start_timeout_s (0.5 s here) the window gets an error row saying so, the process
    is killed by the analyser's own handle and replaced (~0.6 s)."""
    assert MonitorConfig().analysis_start_timeout_s == 120.0
    (w,) = _windows(1)
    analyser = WindowAnalyser(timeout_s=600.0)
    analyser.start_timeout_s = 0.5   # (an attribute: the code before it ignores it, and hangs)
    try:
        process = analyser._executor()
        process.submit(time.sleep, 600)   # (queued behind the engine's import: never done)
        out: list = []
        t = threading.Thread(target=lambda: out.append(analyser.analyse(w)), daemon=True)
        t.start()
        t.join(60)   # (a bound only: the window is given up on after 0.5 s)
        assert out, "the window waited for a process that never started it"
        row, refused = out[0]
        assert row.slowdown is None and refused == []
        assert "did not start this window within analysis_start_timeout_s (0.5 s" in row.error
        assert (row.job, row.idx, row.first_step, row.last_step) == ("job-a", 0, 0, 4)
        assert analyser.restarts == 1 and analyser.stopped == 1
        process.process.join(30)
        assert process.process.exitcode == -signal.SIGKILL
    finally:
        analyser.close()
