"""A `--private` monitor tells a client without its token nothing of what it holds: /health
says only that the service is up (it said how many jobs it had, and how many it held), and
every other route a stranger may reach answers without a count or a path. Real server on
127.0.0.1, httpx clients."""

from __future__ import annotations

import httpx
import pytest

from monitor_jobs import slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig

TOKEN = "s3cret-token-private"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


@pytest.fixture
def private(tmp_path):
    s = MonitorServer(tmp_path / "p.db", port=0, token=TOKEN, private=True, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            trace = slow_job(steps=5, slow=(0, 1, 3.0))
            for job in ("job-secret-a", "job-secret-b"):
                r = c.put(f"/api/jobs/{job}/meta", json=trace.meta.to_dict(), headers=AUTH)
                assert r.status_code == 200, r.text
            yield c
    finally:
        s.stop()


@pytest.mark.slow
def test_health_without_the_token_says_only_that_the_service_is_up(private):
    r = private.get("/health")
    assert r.status_code == 200
    assert r.json() == {"ok": True}
    # with the token it says what it did (a probe that holds the token loses nothing)
    full = private.get("/health", headers=AUTH).json()
    assert full["ok"] is True and full["jobs"] == 2 and "jobs_held" in full
    # a wrong token is no token
    wrong = private.get("/health", headers={"Authorization": "Bearer " + "x" * 20}).json()
    assert wrong == {"ok": True}


@pytest.mark.slow
def test_no_route_answers_a_stranger_with_what_the_service_holds(private):
    # every GET a stranger may send: refused 401, or answered with what any install serves
    for path in ("/api/jobs", "/api/jobs/job-secret-a", "/api/jobs/job-secret-a/windows/0",
                 "/api/stats", "/api/alerts", "/metrics", "/", "/jobs/job-secret-a",
                 "/api/jobs/" + "x" * 200, "/api/alerts?limit=zz", "/api/events"):
        r = private.get(path)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
        assert "job-secret" not in r.text and "p.db" not in r.text, (path, r.text[:200])
    for path in ("/health", "/favicon.ico", "/static/nothing.js", "/no/such/route"):
        r = private.get(path)
        assert "job-secret" not in r.text and "p.db" not in r.text, (path, r.text[:200])
        assert '"jobs' not in r.text, (path, r.text[:200])
