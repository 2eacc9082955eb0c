"""The monitor's leftovers from the last hardening round (issue 34): a prompt stop of the
directory watcher, read-ahead deadlines that follow read_timeout_s, the demo waiting for the
run's last window, a run older than the current one unable to reset it."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from stragglers.monitor import part_rows
from stragglers.monitor.part_files import StuckRead
from stragglers.monitor.part_footers import PartFile
from stragglers.monitor.readahead import read_ahead
from stragglers.monitor.service import Monitor
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import open_store


def _watched(tmp_path):
    """A Monitor and a DirectoryWatcher of a folder holding one run (rescans: hourly)."""
    from monitor_jobs import slow_job, start_run
    from stragglers.monitor.ingest_files import DirectoryWatcher

    runs = tmp_path / "runs"
    start_run(runs / "job-a", slow_job(steps=6))
    monitor = Monitor(open_store(tmp_path / "mon.db", durable=False),
                      MonitorConfig(rescan_s=3600)).start()
    return monitor, DirectoryWatcher(monitor, [runs])


def test_stop_does_not_wait_on_a_watch_process_that_hangs(tmp_path):
    # the watch child blocked in the kernel (a dead mount): closing its stdin does not end
    # it, and stop joined the watch thread, blocked on its output, for 10 s, then returned
    # leaving the thread and the child behind. SIGSTOP stands for the hang here
    import os
    import signal

    from conftest import eventually

    monitor, watcher = _watched(tmp_path)
    try:
        watcher.start()
        eventually(lambda: watcher.watching, what="the watch up")
        child = watcher._child
        os.kill(child.pid, signal.SIGSTOP)
        watcher.stop()
        assert not any(t.is_alive() for t in watcher._threads), watcher._threads
        assert child.poll() is not None   # (ended and reaped, not left stopped)
    finally:
        watcher.stop()
        monitor.stop()
        monitor.store.close()


def test_stop_does_not_wait_on_a_scan_whose_run_hangs(tmp_path, monkeypatch):
    # a run whose stat hangs holds its scan up to RUN_SCAN_TIMEOUT_S (30 s): stop joined the
    # rescan thread for 10 s and returned with it still waiting. The scan blocks on an event
    from stragglers.monitor.ingest_files import DirectoryWatcher

    release, entered = threading.Event(), threading.Event()

    def held(self, run):
        entered.set()
        release.wait(120)

    monkeypatch.setattr(DirectoryWatcher, "_scan_run", held)
    monitor, watcher = _watched(tmp_path)
    try:
        watcher.start()
        assert entered.wait(60)
        watcher.stop()
        assert not any(t.is_alive() for t in watcher._threads), watcher._threads
    finally:
        release.set()
        watcher.stop()
        monitor.stop()
        monitor.store.close()


def test_a_read_ahead_is_given_up_on_after_the_monitors_read_timeout(tmp_path, monkeypatch,
                                                                       caplog):
    # readahead.py's file readers had a fixed 5 s deadline: a monitor told read_timeout_s
    # (a slow file system's, or a quicker one) read ahead with 5 s whatever it said. The
    # read here blocks on an event; the deadline the readers name is the one checked
    release = threading.Event()
    real = part_rows._read_sized

    def read(path, *args):
        if Path(path).name == "hang":
            release.wait(120)
        return real(path, *args)

    monkeypatch.setattr(part_rows, "_read_sized", read)
    monitor = Monitor(open_store(tmp_path / "mon.db", durable=False),
                      MonitorConfig(read_timeout_s=0.25, analysis_process=False))
    part = PartFile(rank=0, part=0, path=tmp_path / "run" / "hang", records=1, first_step=0,
                    last_step=0, nbytes=1, max_stage=0, max_dp=0)
    try:
        with caplog.at_level(logging.WARNING, logger="stragglers.monitor.part_files"):
            monitor.analyser.read_ahead([part])
            [got] = read_ahead().take([part], 0).values()
        assert isinstance(got, StuckRead), got
        assert "did not return within 0.25 s" in caplog.text, caplog.text
    finally:
        release.set()
        read_ahead().forget(str(tmp_path))
        monitor.store.close()


def test_the_demo_prints_once_the_runs_last_window_is_stored(tmp_path):
    # the demo slept 3 s after the training before reading the job's page: on a loaded
    # machine its last windows (and alerts) were not stored yet and went unprinted. It waits
    # for the window that ends at the run's last step; here it comes in a later upload
    import httpx

    from monitor_jobs import parts_of, slow_job
    from stragglers.monitor.demo import wait_last_window
    from stragglers.monitor.server import MonitorServer
    from stragglers.trace.runformat import table_bytes

    token = "leftovers-34-demo-token-0123456789"
    auth = {"Authorization": f"Bearer {token}"}
    trace = slow_job(steps=10, slow=None)   # (no suspect op: no wait for late parts)
    parts = parts_of(trace, 5)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=token,
                      config=MonitorConfig(window_steps=5, stall_after_s=600,
                                           tick_s=0.05)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=auth) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict()).status_code == 200
            for rank, n, cols in parts:
                if n == 0:
                    assert c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}",
                                 content=table_bytes(cols)).status_code == 200
            assert s.monitor.wait_idle(120)
            # steps 0-4 stored: their window is, the window of 5-9 waits for its steps
            assert [w.last_step for w in wait_last_window(s.url, "j", None).windows] == [4]
            done = threading.Event()
            box: dict = {}

            def wait() -> None:
                box["page"] = wait_last_window(s.url, "j", 9)
                done.set()

            waiter = threading.Thread(target=wait, daemon=True)
            waiter.start()
            for rank, n, cols in parts:
                if n == 1:
                    assert c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}",
                                 content=table_bytes(cols)).status_code == 200
            assert done.wait(120)
            assert [w.last_step for w in box["page"].windows] == [4, 9]
    finally:
        s.stop()


def test_a_run_older_than_the_current_one_cannot_reset_it_once_its_token_is_forgotten(tmp_path):
    # the job's row keeps the last MAX_SUPERSEDED replaced run tokens: an uploader of a run
    # older than those (partitioned, then back) announced a token the job no longer knew,
    # taken as a new run: the newer run's parts and windows were deleted. A run's start
    # (extra.started) orders runs without a list: one that began before the current run is
    # refused 409 superseded_run, whatever the job remembers; a later one still replaces it
    import httpx

    from monitor_jobs import slow_job
    from stragglers.monitor.server import MonitorServer
    from stragglers.monitor.store_base import MAX_SUPERSEDED

    token = "leftovers-34-runs-token-0123456789"
    trace = slow_job(steps=6, slow=None)

    def meta(n: int, started: float | None = None) -> dict:
        # run n began n hours after the first (further apart than hosts' clocks may disagree)
        out = trace.meta.to_dict()
        out["extra"].update(run=f"run-{n}", started=1.7e9 + 3600.0 * n
                            if started is None else started)
        return out

    s = MonitorServer(tmp_path / "mon.db", port=0, token=token,
                      config=MonitorConfig(window_steps=5, stall_after_s=600,
                                           tick_s=0.05)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60,
                          headers={"Authorization": f"Bearer {token}"}) as c:
            for n in range(MAX_SUPERSEDED + 2):
                r = c.put("/api/jobs/t/meta", json=meta(n))
                assert r.status_code == 200, r.text
            current = MAX_SUPERSEDED + 1
            assert "run-0" not in s.monitor.store.superseded("t")   # (forgotten)
            r = c.put("/api/jobs/t/meta", json=meta(0))
            assert r.status_code == 409 and r.json()["kind"] == "superseded_run", r.text
            assert "run-0" in r.json()["error"] and f"run-{current}" in r.json()["error"]
            assert s.monitor.store.job("t").meta["extra"]["run"] == f"run-{current}"
            # a new run on a host whose clock is 30 s behind the last run's host began
            # "before" it by its own clock: within STARTED_SKEW_S it still replaces it
            behind = 1.7e9 + 3600.0 * current - 30.0
            r = c.put("/api/jobs/t/meta", json=meta(current + 1, behind))
            assert r.status_code == 200, r.text
            assert s.monitor.store.job("t").meta["extra"]["run"] == f"run-{current + 1}"
            # a start that is not a time is one clear line, the field named
            bad = meta(current + 2)
            bad["extra"]["started"] = "yesterday"
            r = c.put("/api/jobs/t/meta", json=bad)
            assert r.status_code == 422 and "extra.started" in r.text, r.text
            # nor is a start past this monitor's clock (one of 1e300 refused every later
            # run of the job name for good)
            r = c.put("/api/jobs/t/meta", json=meta(current + 2, 1e300))
            assert r.status_code == 422 and "extra.started" in r.text, r.text
            assert s.monitor.store.job("t").meta["extra"]["run"] == f"run-{current + 1}"
    finally:
        s.stop()
