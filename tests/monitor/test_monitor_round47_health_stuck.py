"""/health says how many file reads are stuck (`stuck_reads`: given up on after read_timeout_s
and still held, their threads left behind): a watched part whose reads hang (a FUSE file whose
server holds every read, as test_stuck_watched_file's) is counted while its read is held and
no longer once its server is gone and the read returned. Before, /health said nothing of it
(only /metrics' queue depth did)."""

from __future__ import annotations

import os

import httpx
import pytest

from conftest import eventually
from monitor_jobs import parts_of, slow_job, start_run, write_parts
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import rank_file_name
from test_stuck_watched_file import StuckFile

HANG = 60   # seconds: only a hang waits this long
CFG = MonitorConfig(window_steps=4, stall_after_s=600, tick_s=0.05, rescan_s=0.3,
                    read_timeout_s=0.3)


def test_health_counts_the_reads_stuck_on_a_hanging_watched_file(tmp_path):
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse to mount a FUSE file whose reads hang")
    run = tmp_path / "runs" / "run1"
    trace = slow_job(steps=4)
    start_run(run, trace)
    write_parts(run, parts_of(trace, steps_per_part=4))
    fuse = StuckFile(run / rank_file_name(0, 0))
    server = MonitorServer(tmp_path / "mon.db", watch=[run.parent], port=0, config=CFG)
    # the setting reaches the monitor's readers (was 5 s whatever it said: this test waited
    # out the default)
    assert server.monitor.file_readers.timeout_s == CFG.read_timeout_s
    server.start()
    try:
        with httpx.Client(base_url=server.url, timeout=HANG) as c:
            assert fuse.held.wait(HANG), "the monitor never read the hanging file"
            eventually(lambda: c.get("/health").json()["stuck_reads"] == 1, HANG,
                       what="/health counting the stuck read")
            fuse.close()   # (the server gone: the held read fails and returns)
            eventually(lambda: c.get("/health").json()["stuck_reads"] == 0, HANG,
                       what="/health no longer counting it")
    finally:
        fuse.close()
        server.stop()
