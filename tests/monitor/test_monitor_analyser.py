"""Window analyses in their own process: same rows as on a thread, and a dead process replaced."""

from __future__ import annotations

import os
import signal
from dataclasses import replace

import pytest

from monitor_jobs import closed_windows as windows
from stragglers.monitor.analyser import WindowAnalyser
from stragglers.monitor.records import plain

TIMINGS = ("analysed_at", "analysis_s")


class _ExitWhenUnpickled:
    """Pickles to a call of os._exit: the process that unpickles it dies at once."""

    def __reduce__(self):
        return os._exit, (3,)


@pytest.fixture
def analyser():
    a = WindowAnalyser()
    yield a
    a.close()


@pytest.mark.slow
def test_a_window_analysed_in_the_process_gets_the_row_a_thread_gets(analyser):
    (w,) = windows(1)
    here, _ = WindowAnalyser(in_process=True).analyse(w)
    there, _ = analyser.analyse(w)
    (child,) = analyser.pids()
    assert child != os.getpid()
    assert here.error is None and here.slowdown > 1.3
    assert {k: v for k, v in plain(there).items() if k not in TIMINGS} == \
        {k: v for k, v in plain(here).items() if k not in TIMINGS}


@pytest.mark.slow
def test_a_process_killed_between_windows_is_replaced_and_the_window_analysed(analyser):
    first, second = windows(2)
    assert analyser.analyse(first)[0].error is None
    (old,) = analyser.pids()
    os.kill(old, signal.SIGKILL)
    row, _ = analyser.analyse(second)
    assert row.error is None and row.slowdown > 1.3
    assert analyser.restarts == 1 and analyser.pids() != [old]


@pytest.mark.slow
def test_a_window_that_kills_the_process_keeps_an_error_row_and_the_next_is_analysed(analyser):
    bad, good = windows(2)
    meta = bad.trace.meta   # (shared by the job's windows: the poisoned one gets a copy)
    bad.trace = replace(bad.trace, meta=replace(meta, extra={**meta.extra,
                                                             "poison": _ExitWhenUnpickled()}))
    row, _ = analyser.analyse(bad)
    assert row.slowdown is None and "analysis process died" in row.error
    assert (row.job, row.idx, row.first_step) == ("job-a", 0, 0)
    assert analyser.restarts == 2          # tried once more in a fresh process, then given up
    nxt, _ = analyser.analyse(good)
    assert nxt.error is None and nxt.idx == 1 and nxt.slowdown > 1.3
    assert analyser.restarts == 2
