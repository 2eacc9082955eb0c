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
