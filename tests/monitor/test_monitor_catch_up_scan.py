"""The catch-up after the watch of the folders is made again (watch_child's fallback for names
not in UTF-8: at an event naming one, at most once a second) scans the runs whose directory
changed since their last scan, not every run under every root: 1,000 runs under 1,000 roots
cost 6.2 s of CPU per rebuild. Real watcher, real monitor, real SQLite; folders' times set
in the past so no test waits on a clock."""

from __future__ import annotations

import os
import time

from monitor_jobs import parts_of, slow_job, start_run, write_parts
from stragglers.monitor.ingest_files import DirectoryWatcher
from stragglers.monitor.service import Monitor
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import open_store
from stragglers.trace.runformat import rank_file_name


def settled(*folders) -> None:
    """The folders' times a minute back (settled: older than the 2 s a mtime is trusted)."""
    past = time.time() - 60.0
    for f in folders:
        os.utime(f, (past, past))


def test_the_catch_up_scans_the_runs_that_changed_and_finds_what_they_gained(tmp_path):
    roots = [tmp_path / "a", tmp_path / "b"]
    trace = slow_job(steps=5, slow=None)
    parts = parts_of(trace, 5)
    runs = [roots[0] / "run-x", roots[0] / "run-y", roots[1] / "run-z"]
    late = [p for p in parts if p[0] == 3]
    for run in runs:
        start_run(run, trace)
        write_parts(run, [p for p in parts if run.name != "run-y" or p[0] != 3])
    settled(*runs, *(run / "meta.json" for run in runs))   # (its mark has meta.json's)
    store = open_store(tmp_path / "mon.db", durable=False)
    config = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600)
    monitor = Monitor(store, config).start()
    try:
        watcher = DirectoryWatcher(monitor, roots)
        assert watcher.scan() == 3
        assert monitor.wait_idle(120)
        assert watcher.scan(changed=True) == 0   # (nothing changed: nothing scanned)
        assert not store.has_part("run-y", 3, 0)
        write_parts(runs[1], late)   # run-y gains rank 3's part while no watch saw it
        assert watcher.scan(changed=True) == 1
        assert monitor.wait_idle(120)
        assert store.has_part("run-y", 3, 0)
        assert (runs[1] / rank_file_name(3, 0)).exists()
        assert watcher.scan() == 3   # (the periodic rescan: every run)
    finally:
        monitor.stop()
        store.close()
