"""HEAD is answered wherever GET is (RFC 9110 §9.3.2): the GET route's status and headers, no
body; every GET route of the monitor answered HEAD 405. Real monitor on loopback."""

from __future__ import annotations

import httpx
import pytest

from monitor_jobs import slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig

TOKEN = "round47-head-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# (reads not paced: each route is asked twice at once)
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, read_interval_s=0)
ROUTES = ["/health", "/metrics", "/api/jobs", "/api/jobs/j", "/api/jobs/j/windows/0",
          "/api/jobs/nosuch", "/api/alerts", "/api/stats", "/", "/jobs/j", "/favicon.ico",
          "/static/dashboard.js", "/static/none.js", "/no/such/path"]
SAME = ("content-type", "etag", "last-modified", "allow", "cache-control")


@pytest.fixture
def server(tmp_path):
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        yield s
    finally:
        s.stop()


def test_every_get_route_answers_head_with_its_status_and_headers_and_no_body(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.put("/api/jobs/j/meta", json=slow_job(steps=4).meta.to_dict(),
                     headers=AUTH).status_code == 200
        for path in ROUTES:
            got, head = c.get(path), c.head(path)
            assert head.status_code == got.status_code, (path, head.status_code, head.text)
            assert head.content == b"", path
            for name in SAME:
                assert head.headers.get(name) == got.headers.get(name), (path, name)
            if path.startswith(("/static/", "/jobs/")) or path == "/":   # (files: fixed)
                assert head.headers["content-length"] == got.headers["content-length"], path
        # the event stream's head is answered and the connection serves the next request
        with c.stream("HEAD", "/api/events") as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith(
                "text/event-stream")
        assert c.get("/health").status_code == 200
        # a PUT-only route refuses HEAD as it refuses GET
        r = c.head("/api/jobs/j/meta")
        assert r.status_code == 405 and r.headers["allow"] == "PUT", r.headers
        r = c.request("HEAD", "/health", content=b"x")
        assert r.status_code == 400
