"""NDTimeline's real ST sample (8 ranks, 32 sampled steps each timed from its own start) through
the real monitor: converted to a run directory by `stragglers convert` (one whole-rank file a
rank), watched by a real server on loopback. Every rank's file is taken and every window
analysed with every step in it; before the op-span bounds told one clock from steps each
timed from their own start, each rank's file was refused ("an op ... ending after the rank's
step 25 began") and the job had no window."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from conftest import eventually
from monitor_jobs import get
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.convert import convert
from stragglers.trace.load import load_trace


@pytest.mark.slow
def test_the_real_st_sample_watched_has_every_window_analysed(ndtimeline_dir, tmp_path):
    source = ndtimeline_dir / "trace-ST.parquet"
    steps = np.unique(load_trace(source).ops["step"]).tolist()
    convert(source, tmp_path / "runs" / "st")
    config = MonitorConfig(window_steps=10, stall_after_s=600, tick_s=0.05, rescan_s=0.5)
    s = MonitorServer(tmp_path / "mon.db", watch=[tmp_path / "runs"], port=0,
                      config=config).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            def refused():
                # (the polls before the run was found were refused as asking for an unknown job)
                return [r for r in get(c, "/api/stats")["rejects"] if r["reason"] != "unknown_job"]

            def done():
                if c.get("/api/jobs/st").status_code != 200:
                    return False
                job = get(c, "/api/jobs/st?history=100")
                finished = job["state"] == "finished" and job["windows_total"] == 4
                return finished or bool(refused())

            eventually(done, 120, what="the run finished, its 4 windows analysed (or refused)")
            assert refused() == [], refused()   # (before: every rank's file, no window)
            assert get(c, "/api/jobs/st")["windows_total"] == 4
            windows = [get(c, f"/api/jobs/st/windows/{i}") for i in range(4)]
            for w in windows:
                assert w["error"] is None and w["missing_ranks"] == [], w
                assert w["slowdown"] is not None and w["slowdown"] >= 1.0, w["slowdown"]
            assert [st for w in windows for st in w["steps"]] == steps
    finally:
        s.stop()
