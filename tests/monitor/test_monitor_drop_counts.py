"""Uploaders' drop counts (X-Stragglers-Dropped) are each run's own, and only a stored (or
duplicate) part's count is taken: a real monitor on loopback, real SQLite."""

from __future__ import annotations

import httpx
import pytest

from monitor_jobs import parts_of, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

TOKEN = "drop-counts-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def monitor(tmp_path_factory):
    s = MonitorServer(tmp_path_factory.mktemp("drops") / "mon.db", port=0, token=TOKEN,
                      config=MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)).start()
    yield s
    s.stop()


def test_a_new_run_without_a_run_token_reports_its_own_drop_counts(monitor):
    # (a writer that sends no extra.run: its runs are told apart by their start clocks, and
    # the monitor's cache of stored counts by the job's tracker, which a new run replaces)
    with httpx.Client(base_url=monitor.url, timeout=60, headers=AUTH) as c:
        for seed, start, dropped in ((1, 1000.0, "5"), (2, 2000.0, "2")):
            trace = slow_job(steps=5, seed=seed)
            meta = trace.meta.to_dict()
            meta["extra"]["clock"] = {"start": [start] * meta["world_size"]}
            assert c.put("/api/jobs/tokenless/meta", json=meta).status_code == 200
            r = c.put("/api/jobs/tokenless/ranks/0/parts/0",
                      content=table_bytes(parts_of(trace, 5)[0][2]),
                      headers={"X-Stragglers-Dropped": dropped})
            assert r.json()["status"] == "stored", r.text
        assert c.get("/api/jobs/tokenless").json()["upload_dropped"] == {"0": 2}


def test_a_refused_part_leaves_the_drop_count_as_it_was(monitor):
    # (a 4xx changes nothing: other bytes under a stored part number are 409, their count too)
    trace = slow_job(steps=5, seed=4)
    parts = parts_of(trace, 5)
    with httpx.Client(base_url=monitor.url, timeout=60, headers=AUTH) as c:
        assert c.put("/api/jobs/refused/meta", json=trace.meta.to_dict()).status_code == 200
        url = "/api/jobs/refused/ranks/0/parts/0"
        ok = c.put(url, content=table_bytes(parts[0][2]), headers={"X-Stragglers-Dropped": "1"})
        other = c.put(url, content=table_bytes(parts[1][2]),   # rank 1's rows under rank 0
                      headers={"X-Stragglers-Dropped": "9"})
        assert ok.status_code == 200 and other.status_code in (409, 422), other.text
        assert c.get("/api/jobs/refused").json()["upload_dropped"] == {"0": 1}


def test_a_new_run_takes_the_old_runs_drop_counts_off_metrics(monitor):
    # (before its first part says otherwise, the old run's 5 was exported as the new run's)
    with httpx.Client(base_url=monitor.url, timeout=60, headers=AUTH) as c:
        for seed, start in ((5, 1000.0), (6, 2000.0)):
            trace = slow_job(steps=5, seed=seed)
            meta = trace.meta.to_dict()
            meta["extra"]["clock"] = {"start": [start] * meta["world_size"]}
            assert c.put("/api/jobs/rerun/meta", json=meta).status_code == 200
            if start == 1000.0:
                r = c.put("/api/jobs/rerun/ranks/0/parts/0",
                          content=table_bytes(parts_of(trace, 5)[0][2]),
                          headers={"X-Stragglers-Dropped": "5"})
                assert r.json()["status"] == "stored", r.text
                assert 'stragglers_upload_dropped{job="rerun",rank="0"} 5.0' in c.get("/metrics").text
        assert 'stragglers_upload_dropped{job="rerun"' not in c.get("/metrics").text
