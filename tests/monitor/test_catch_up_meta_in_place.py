"""The watch's catch-up (the runs that changed since their last scan) sees a run's meta.json
rewritten in place (issue 34): the same inode and no name added leave the run folder's mtime
as it was, so the catch-up skipped the run and the new metadata (here a new run) waited for
a full rescan (rescan_s, 60 s by default). Real watcher over a real folder, real monitor,
real SQLite; times set in the past so no test waits on a clock."""

from __future__ import annotations

import json
import os
import time

from monitor_jobs import slow_job
from stragglers.monitor.ingest_files import DirectoryWatcher
from stragglers.monitor.service import Monitor
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import open_store


def settled(*paths) -> None:
    """Their times a minute back (settled: older than the 2 s a mtime is trusted)."""
    past = time.time() - 60.0
    for p in paths:
        os.utime(p, (past, past))


def test_a_meta_json_rewritten_in_place_is_found_by_the_catch_up(tmp_path):
    root, run = tmp_path / "runs", tmp_path / "runs" / "run-x"
    run.mkdir(parents=True)
    meta = slow_job(steps=5, slow=None).meta.to_dict()
    meta["extra"]["run"] = "first"
    (run / "meta.json").write_text(json.dumps(meta))
    settled(run / "meta.json", run)
    store = open_store(tmp_path / "mon.db", durable=False)
    config = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600)
    monitor = Monitor(store, config).start()
    try:
        watcher = DirectoryWatcher(monitor, [root])
        assert watcher.scan() == 1
        assert monitor.wait_idle(120)
        assert store.job("run-x").meta["extra"]["run"] == "first"
        assert watcher.scan(changed=True) == 0   # (nothing changed: nothing scanned)
        inode = os.stat(run / "meta.json").st_ino
        meta["extra"]["run"] = "second"   # a new run's metadata, written over the file
        with open(run / "meta.json", "r+") as f:
            f.write(json.dumps(meta))
            f.truncate()
        assert os.stat(run / "meta.json").st_ino == inode
        settled(run)   # (the folder as it was: no name added)
        assert watcher.scan(changed=True) == 1   # (before: 0, the run skipped)
        assert monitor.wait_idle(120)
        assert store.job("run-x").meta["extra"]["run"] == "second"
        settled(run / "meta.json")
        assert watcher.scan(changed=True) == 1   # (its mark taken once settled)
        assert watcher.scan(changed=True) == 0
        # rewritten with its times set back (its ctime still moves): seen all the same
        meta["extra"]["run"] = "third"
        with open(run / "meta.json", "r+") as f:
            f.write(json.dumps(meta))
            f.truncate()
        settled(run / "meta.json", run)
        assert watcher.scan(changed=True) == 1
        assert monitor.wait_idle(120)
        assert store.job("run-x").meta["extra"]["run"] == "third"
        assert watcher.scan(changed=True) == 0
    finally:
        monitor.stop()
        store.close()
