"""Red team round fifteen (issue 34): the monitor's window pipeline under the analysis time
limit (`analysis_timeout_s`), and what /metrics says of a job's windows across a restart
(`stragglers_window_failed`, `stragglers_slowdown`).

Each test is one defect class (its xfail(strict=True) mark went with its fix, branch
s51-monfix15). Real
analysis process (spawned), real monitor on loopback, real SQLite.
"""

from __future__ import annotations

import sys
import time
from dataclasses import replace

import httpx
import numpy as np
import pytest

from conftest import REPO, eventually
from stragglers.monitor.analyser import WindowAnalyser
from stragglers.monitor.metrics import MonitorMetrics
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import closed_windows, parts_of, slow_job  # noqa: E402
from monitor_jobs import held as held_window  # noqa: E402

TOKEN = "hostile-round15-token-0123456789"
MONITOR = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


class _SleepWhenUnpickled:
    """Pickles to a call of time.sleep(600): the process that unpickles it hangs there (a
    window whose analysis never ends, as tests/monitor/test_monitor_s51_analysis_timeout.py)."""

    def __reduce__(self):
        return time.sleep, (600,)


def test_the_windows_after_a_stopped_one_are_analysed():
    """A limit between a window's own analysis and an analysis process's start (both
    measured here: ~0.03-0.1 s and ~0.4-1.4 s on this machine; the setting allows >= 0.1 s).
    One window hangs (stopped, error row, process killed and replaced: as documented). The
    README and the error row itself promise "the next window is analysed in a new one", but
    the next window's limit is counted from its hand-over to a pool whose process is still
    being spawned and importing the engine, so it is stopped too, which kills that process,
    and so on: every later window of every job gets an error row (seen with 1.0 s: windows
    1-4 all "analysis stopped")."""
    hung, first, second, *after = closed_windows(6)
    meta = hung.trace.meta
    hung.trace = replace(hung.trace, meta=replace(meta, extra={**meta.extra,
                                                               "hang": _SleepWhenUnpickled()}))
    analyser = WindowAnalyser(timeout_s=600.0)
    try:
        t0 = time.monotonic()
        analyser.warm()
        analyser.pids()   # (queued behind the engine's import: the process's whole start)
        start_s = time.monotonic() - t0
        own_s = 600.0
        for w in (first, second):   # (the quicker of two: the first call warms caches)
            t0 = time.monotonic()
            row, _ = analyser.analyse(w)
            own_s = min(own_s, time.monotonic() - t0)
            assert row.error is None and row.slowdown > 1.3
        limit = start_s / 4   # (a restart may be quicker than the first start: well under)
        if own_s * 3 > limit:   # (the precondition of the defect, not a verdict)
            pytest.skip(f"a window's analysis ({own_s:.2f} s) is not well under a quarter "
                        f"of a process start ({start_s:.2f} s) here")
        analyser.timeout_s = limit
        row, _ = analyser.analyse(hung)
        assert "analysis stopped" in (row.error or "") and analyser.stopped == 1
        rows = [analyser.analyse(w)[0] for w in after]
        errors = [(r.idx, (r.error or "")[:60]) for r in rows if r.error]
        assert errors == [], f"healthy windows after the stopped one (limit {limit:.2f} s, " \
                             f"own analysis {own_s:.2f} s): {errors}"
    finally:
        analyser.close()


def _served(db, config=MONITOR):
    return MonitorServer(db, port=0, token=TOKEN, config=config).start()


def _client(s: MonitorServer) -> httpx.Client:
    return httpx.Client(base_url=s.url, timeout=60,
                        headers={"Authorization": f"Bearer {TOKEN}"})


def _job_series(c: httpx.Client, job: str) -> dict[str, float]:
    """/metrics samples of `job` whose name starts with stragglers_slowdown /
    stragglers_window_failed (name → value)."""
    out = {}
    for line in c.get("/metrics").text.splitlines():
        if f'job="{job}"' in line and line.startswith(("stragglers_slowdown{",
                                                       "stragglers_window_failed{")):
            out[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def _no_time(cols: dict) -> dict:
    """Every op at one instant with zero duration: a window of such parts is stored with an
    error row ("every op in the analysed steps has zero duration ...")."""
    return {**cols, "duration": np.zeros_like(cols["duration"]),
            "start_ts": np.full_like(cols["start_ts"], cols["start_ts"].min())}


def _two_windows(db, failed: bool, expect: dict) -> None:
    """Job j (2x2, slow worker) with two windows (the second an error row where `failed`),
    served until its /metrics series read `expect` (the second window published), stopped."""
    trace = slow_job(steps=10)
    s = _served(db)
    try:
        with _client(s) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict()).status_code == 200
            for rank, n, cols in parts_of(trace, 5):
                body = table_bytes(_no_time(cols) if failed and n == 1 else cols)
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=body)
                assert r.status_code == 200, r.text
            eventually(lambda: c.get("/api/jobs/j").json()["windows_total"] >= 2,
                       what="windows 0-1")
            eventually(lambda: _job_series(c, "j") == expect, what=f"/metrics {expect}")
    finally:
        s.stop()


def test_a_failed_latest_window_is_still_shown_failed_after_a_restart(tmp_path):
    """Job j's latest window is an error row (its parts' ops all at one instant with zero
    duration: "the slowdown is undefined"; a window stopped past analysis_timeout_s is stored
    the same way). Before the restart /metrics says stragglers_window_failed{job="j"} 1
    (README: "1 while the job's latest window could not be analysed"). After a restart the
    job's series are gone until its next window, which may never come (a hung job): an
    alert on stragglers_window_failed == 1 resolves at every restart while nothing changed.
    The same for stragglers_slowdown: a straggling job's S 1.72 is not exported after a
    restart (/api/jobs still shows it), so `stragglers_slowdown > 1.3` resolves too."""
    db = tmp_path / "mon.db"
    _two_windows(db, failed=True, expect={"stragglers_window_failed": 1.0})
    s = _served(db)
    try:
        with _client(s) as c:
            jobs = c.get("/api/jobs").json()["jobs"]
            assert [(j["job"], j["window"], j["slowdown"]) for j in jobs] == [("j", 1, None)]
            series = _job_series(c, "j")
            assert series.get("stragglers_window_failed") == 1.0, series
    finally:
        s.stop()


def test_a_straggling_jobs_slowdown_is_still_exported_after_a_restart(tmp_path):
    """The same cause as above, seen on an analysed window: /api/jobs says S 1.72 after the
    restart, /metrics has no stragglers_slowdown{job="j"} (nor window_failed 0)."""
    db = tmp_path / "mon.db"
    _two_windows(db, failed=False, expect={
        "stragglers_slowdown": pytest.approx(1.72, abs=0.05), "stragglers_window_failed": 0.0})
    s = _served(db)
    try:
        with _client(s) as c:
            assert c.get("/api/jobs").json()["jobs"][0]["slowdown"] > 1.6
            series = _job_series(c, "j")
            assert series.get("stragglers_slowdown", 0.0) > 1.6, series
            assert series.get("stragglers_window_failed") == 0.0, series
    finally:
        s.stop()


def test_a_stopped_window_reports_the_time_it_took():
    """A window whose analysis was stopped after the limit (0.2 s, waited for in full) is
    stored with analysis_s 0.0 (the row /api/jobs/<job> serves) and observed as 0.0 s in
    stragglers_window_analysis_seconds: the windows that took longest land in the lowest
    bucket, and a histogram quantile alert on slow analyses never sees them."""
    (first,) = closed_windows(1)
    held = held_window(first)
    analyser = WindowAnalyser(in_process=True, timeout_s=0.2)
    try:
        row, _ = analyser.analyse(held)
    finally:
        held.release.set()
    assert "ran past analysis_timeout_s (0.2 s)" in (row.error or "")
    metrics = MonitorMetrics()
    metrics.publish_window(row)
    total = metrics.analysis_seconds.collect()[0]
    spent = [s.value for s in total.samples if s.name.endswith("_sum")]
    assert row.analysis_s >= 0.2 and spent[0] >= 0.2, (row.analysis_s, spent)
