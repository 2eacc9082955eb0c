"""The watch child watches each watched folder and each folder in it on its own, no link
followed (red team round 11 finding 7: its recursive watch followed a link `data -> /` out of
the watched folder, failed under /proc, and the live watch of every run was lost; a link to a
tree of 2,000 folders took 2,000 inotify watches). Here a link to `/` and a folder whose name
is not UTF-8 sit beside a run: the run's parts written later are still seen live (rescans
off), through a handful of watches. Real server, real watch child."""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from conftest import eventually
from monitor_jobs import get, parts_of, slow_job, start_run, write_parts
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig


def _inotify_watches_of_children() -> int:
    """The inotify watches held by this process's watch_child processes (from /proc)."""
    total = 0
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids = [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
        for pid in pids:
            try:
                if b"stragglers.monitor.watch_child" not in \
                        Path(f"/proc/{pid}/cmdline").read_bytes():
                    continue
                for info in Path(f"/proc/{pid}/fdinfo").iterdir():
                    total += info.read_text().count("inotify wd:")
            except OSError:
                continue
    return total


def test_a_link_to_the_root_folder_beside_a_run_leaves_its_live_watch(tmp_path):
    watch = tmp_path / "watch"
    watch.mkdir()
    (watch / "rootlink").symlink_to("/")
    os.mkdir(os.fsencode(watch) + b"/odd-\xff")
    trace = slow_job(steps=10, slow=None)
    parts = parts_of(trace, 5)
    start_run(watch / "good", trace)
    write_parts(watch / "good", [p for p in parts if p[1] == 0])
    s = MonitorServer(tmp_path / "mon.db", watch=[watch], port=0,
                      config=MonitorConfig(window_steps=5, stall_after_s=600,
                                           rescan_s=3600)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            eventually(lambda: get(c, "/api/jobs/good")["windows_total"] >= 1,
                       what="the run's first window")
            eventually(lambda: s.watcher.watching, what="the watch built")
            assert _inotify_watches_of_children() < 10
            write_parts(watch / "good", [p for p in parts if p[1] == 1])   # (seen live only)
            eventually(lambda: get(c, "/api/jobs/good")["windows_total"] >= 2,
                       what="the window of the parts written after the watch began")
            assert s.watcher.watching
    finally:
        s.stop()
