"""A window's analysis past analysis_timeout_s is stopped and the window kept with an error row
saying so; the next window is analysed (in a new process, or once the thread's engine ended)."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

from monitor_jobs import closed_windows as windows
from monitor_jobs import held as held_window
from stragglers.monitor.analyser import WindowAnalyser
from stragglers.monitor.settings import MonitorConfig


class _SleepWhenUnpickled:
    """Pickles to a call of time.sleep(600): the process that unpickles it hangs there (as on
    a window whose analysis never ends)."""

    def __reduce__(self):
        return time.sleep, (600,)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # (a killed child not yet reaped is a zombie: gone for this purpose)
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def test_the_default_limit_is_a_setting():
    assert MonitorConfig().analysis_timeout_s == 300.0
    assert WindowAnalyser(timeout_s=MonitorConfig().analysis_timeout_s).timeout_s == 300.0


@pytest.mark.slow
def test_a_window_past_the_limit_has_its_process_killed_and_an_error_row():
    (w,) = windows(1)
    meta = w.trace.meta
    w.trace = replace(w.trace, meta=replace(meta, extra={**meta.extra,
                                                         "hang": _SleepWhenUnpickled()}))
    analyser = WindowAnalyser(timeout_s=0.3)
    try:
        analyser.warm()
        (old,) = analyser.pids()   # (started and warm: the limit counts the window alone)
        t0 = time.monotonic()
        row, refused = analyser.analyse(w)   # (was: waited for the window for good)
        took = time.monotonic() - t0
        assert row.slowdown is None and refused == []
        assert "analysis stopped: it ran past analysis_timeout_s (0.3 s)" in row.error
        assert (row.job, row.idx, row.first_step, row.last_step) == ("job-a", 0, 0, 4)
        assert 0.3 <= took < 60.0 and analyser.stopped == 1 and analyser.restarts == 1
        deadline = time.monotonic() + 30
        while _alive(old) and time.monotonic() < deadline:
            time.sleep(0.05)   # (bound only: SIGKILL was sent before analyse returned)
        assert not _alive(old)
    finally:
        analyser.close()


def test_on_the_thread_the_window_gets_its_error_row_and_the_next_waits_for_the_engine():
    first, second = windows(2)
    held = held_window(first)
    analyser = WindowAnalyser(in_process=True, timeout_s=0.2)
    row, _ = analyser.analyse(held)   # (was: the analysis thread held until the rows came)
    assert row.slowdown is None and "ran past analysis_timeout_s (0.2 s)" in row.error
    assert "cannot be stopped" in row.error and analyser.stopped == 1
    held.release.set()   # the engine left behind ends; the next window is analysed whole
    nxt, _ = analyser.analyse(second)
    assert nxt.error is None and nxt.idx == 1 and nxt.slowdown > 1.3
    assert analyser.stopped == 1
