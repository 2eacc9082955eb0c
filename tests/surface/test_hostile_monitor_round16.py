"""Red team round sixteen (issue 34): the monitor's analysis process, its drop counts and
stored baselines across new runs and restarts, and hostile requests against real servers on
loopback.

Each test is one defect class (its xfail(strict=True) mark went with its fix, branch
s52-rtm16). Real analysis process (spawned), real monitor on loopback, real SQLite.
"""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from dataclasses import replace

import httpx
import pytest

from conftest import REPO, eventually
from stragglers.monitor import fast_state
from stragglers.monitor.analyser import WindowAnalyser
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.service import Monitor
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import Store
from stragglers.monitor.windows import JobTracker, Window
from stragglers.trace.runformat import table_bytes

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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One real monitor on loopback for the HTTP cases (each its own job names)."""
    s = MonitorServer(tmp_path_factory.mktemp("r16") / "mon.db", port=0, token=TOKEN,
                      config=MONITOR).start()
    yield s
    s.stop()


def _client(s: MonitorServer) -> httpx.Client:
    return httpx.Client(base_url=s.url, timeout=60,
                        headers={"Authorization": f"Bearer {TOKEN}"})


def _run_meta(seed: int, start: float) -> dict:
    meta = slow_job(steps=5, seed=seed).meta.to_dict()
    meta["extra"]["clock"] = {"start": [start] * meta["world_size"]}
    return meta


def test_an_old_runs_part_in_flight_across_a_new_run_keeps_its_drop_count(served):
    """Leftover 3: a retry of run 1's stored part (drop count 7) is held between its
    acceptance and its count's write (the store's digest read, paused on an event); run 2
    commits meanwhile (a new start clock). The count was written into run 2's rows (and its
    /metrics series): /api/jobs/drops said upload_dropped {0: 7} for a run that dropped
    nothing. Now the count is stored for the run the part was accepted for, or not at all."""
    trace = slow_job(steps=5, seed=1)
    body = table_bytes(parts_of(trace, 5)[0][2])
    url = "/api/jobs/drops/ranks/0/parts/0"
    with _client(served) as c, _client(served) as c2:
        assert c.put("/api/jobs/drops/meta", json=_run_meta(1, 1000.0)).status_code == 200
        r = c.put(url, content=body)
        assert r.json()["status"] == "stored", r.text
        # (its answer comes before it is counted out of flight: a new run meanwhile is 503)
        eventually(served.monitor.idle, what="run 1's part out of flight")
        store, held, go = served.monitor.store, threading.Event(), threading.Event()
        read = store.part_digest

        def paused(*args):
            held.set()
            go.wait(30)
            return read(*args)

        store.part_digest = paused   # (the real read, after a pause)
        out: list = []
        retry = threading.Thread(target=lambda: out.append(c.put(
            url, content=body, headers={"X-Stragglers-Dropped": "7"})))
        retry.start()
        try:
            assert held.wait(30)
            assert c2.put("/api/jobs/drops/meta", json=_run_meta(2, 2000.0)).status_code == 200
        finally:
            go.set()
            retry.join(60)
            store.part_digest = read
        assert out and out[0].status_code < 500, out
        assert c.get("/api/jobs/drops").json()["upload_dropped"] == {}
        assert 'stragglers_upload_dropped{job="drops"' not in c.get("/metrics").text
        assert c.get("/health").status_code == 200


def test_baselines_left_by_older_versions_are_swept_at_start(tmp_path):
    """Leftover 4: fast-detector baselines (fast_state rows) that older versions kept for
    good (a job gone, a rank whose alert resolved another way) were never swept: each start
    left them. Now a start keeps only those a firing rank_slowdown alert holds."""
    state = fast_state.FiredState(frozen=0.1, base=[0.1] * 8, ratio=3.0, since_step=3,
                                  at_step=9)
    store = Store(tmp_path / "mon.db")
    try:
        store.register_job("j", str(tmp_path / "j"), "http", slow_job(steps=5).meta.to_dict())
        fast_state.save(store, "gone", {0: state})   # (its job deleted by an older version)
        fast_state.save(store, "j", {0: state, 1: state})
        store._write(lambda db: store._exec(
            db, "INSERT INTO alerts (fingerprint, rule, job, labels, annotations, status, "
            "starts_at, last_sent) VALUES ('f0', 'rank_slowdown', 'j', ?, '{}', 'firing', 1.0, "
            "1.0)", (json.dumps({"alertname": "rank_slowdown", "job": "j", "rank": "0",
                                 "severity": "warning"}),)))
        monitor = Monitor(store, MONITOR, data_dir=tmp_path / "data").start()
        monitor.stop()
        assert fast_state.load(store, "gone") == {}
        assert sorted(fast_state.load(store, "j")) == [0]   # (rank 1 resolved: swept)
    finally:
        store.close()


def test_a_monitor_whose_analysis_process_hangs_still_stops(tmp_path):
    """A monitor (analysis_process on) whose analysis process hangs on a task (as one hung
    while importing the engine, or on a read no timeout cuts). Its stop closed the analyser
    with ProcessPoolExecutor.shutdown(wait=True): the stop never returned, so the service
    could not be restarted in that process (and a `serve` would not exit on SIGTERM). Now
    the process is killed after CLOSE_WAIT_S (1 s) and the stop returns (~2 s)."""
    store = Store(tmp_path / "mon.db")
    monitor = Monitor(store, MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05,
                                           analysis_process=True),
                      data_dir=tmp_path / "data").start()
    try:
        process = monitor.analyser._executor()
        monitor.analyser.pids()   # (started, the engine imported)
        hung = process.submit(time.sleep, 600)   # (never ends)
        assert process.wait_started(hung, 60)
        stopped = threading.Event()
        threading.Thread(target=lambda: (monitor.stop(), stopped.set()), daemon=True).start()
        assert stopped.wait(60), "the monitor's stop waited for a hung analysis process"
        again = Monitor(Store(tmp_path / "mon.db"), MONITOR, data_dir=tmp_path / "data")
        again.start().stop()   # (restartable: the store is free again)
        again.store.close()
    finally:
        store.close()


class _NoPickle:
    """Raises when pickled (a window the analyser cannot hand to its process)."""

    def __reduce__(self):
        raise TypeError("this value cannot be pickled")


def test_a_window_that_cannot_reach_the_process_keeps_an_error_row():
    """A window whose hand-over to the analysis process fails (its pickling raises: deep or
    odd values in a job's metadata extra, which travels with it). The error was raised out of
    analyse() into the analysis loop, which logged it and went on: the window was never
    stored, and once a later one was, its steps were never analysed again (not even after a
    restart). Now it is stored with an error row, as a window that killed the process."""
    (w,) = _windows(1)
    meta = w.trace.meta
    w.trace = replace(w.trace, meta=replace(meta, extra={**meta.extra, "odd": _NoPickle()}))
    analyser = WindowAnalyser()
    try:
        row, refused = analyser.analyse(w)
        assert row.slowdown is None and refused == []
        assert "analysis failed: TypeError: this value cannot be pickled" in row.error
        assert (row.job, row.idx, row.first_step, row.last_step) == ("job-a", 0, 0, 4)
    finally:
        analyser.close()
