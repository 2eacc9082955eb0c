"""Numbers in the monitor's paths and queries are plain decimals (0, or no leading zero, no
sign, ASCII digits only): `+0`, `00`, `0_0` or a Unicode digit was read as the same rank, part
or window as `0` (the same part reached under two names), or as a number at all."""

from __future__ import annotations

from urllib.parse import quote

import httpx
import pytest

from monitor_jobs import get, parts_of, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

TOKEN = "path-numbers-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LAX = ["+0", "00", "01", "0_0", " 0", "0 ", "\u0660", "\uff10", "0x0", "1e0", "-0", "0.0", ""]


@pytest.mark.slow
def test_numbers_in_paths_and_queries_are_plain_decimals(tmp_path):
    trace = slow_job(steps=5)
    (rank, part, cols), *_ = parts_of(trace, 5)
    body = table_bytes(cols)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN,
                      config=MonitorConfig(window_steps=5, stall_after_s=600)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            for lax in LAX:
                q = quote(lax, safe="+")
                for url in (f"/api/jobs/j/ranks/{q}/parts/0", f"/api/jobs/j/ranks/0/parts/{q}"):
                    r = c.put(url, content=body, headers=AUTH)
                    if lax == "":   # (an empty segment is another path)
                        assert r.status_code == 404, (url, r.text)
                        continue
                    assert r.status_code == 422, (url, r.status_code, r.text)
                    assert "expected" in r.json()["error"], r.text
                if lax:
                    r = c.get(f"/api/jobs/j/windows/{q}", headers=AUTH)
                    assert r.status_code == 422, (lax, r.status_code, r.text)
                for query in ("window", "history"):
                    r = c.get("/api/jobs/j", params={query: lax}, headers=AUTH)
                    assert r.status_code == 422, (query, lax, r.status_code, r.text)
                    assert query in r.json()["error"], r.text
            job = get(c, "/api/jobs/j")
            assert job["last_part_at"] is None, job   # nothing stored under any of those names
            r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{part}", content=body, headers=AUTH)
            assert r.status_code == 200 and r.json()["status"] == "stored", r.text
            assert c.get("/api/jobs/j", params={"history": "10"}, headers=AUTH).status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        s.stop()


@pytest.mark.slow
def test_a_query_parameter_given_twice_is_refused_on_every_route(tmp_path):
    # (fails before: the last value was taken — `?limit=1&limit=1000` asked for 1,000 alerts
    # where a proxy judging the first saw 1 — and a repeated key is no request a client makes)
    trace = slow_job(steps=5)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN,
                      config=MonitorConfig(window_steps=5, stall_after_s=600)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=AUTH) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict()).status_code == 200
            for url in ("/api/alerts?limit=1&limit=1000", "/api/alerts?after=&after=00",
                        "/api/alerts?log_before=1&log_%62efore=2",
                        "/api/jobs/j?window=0&history=1&window=0", "/api/jobs?x=1&x=2",
                        "/api/stats?a&a", "/metrics?q=1&q=1", "/health?h=1&h=2"):
                r = c.get(url)
                assert r.status_code == 422, (url, r.status_code, r.text)
                assert "more than once" in r.json()["error"], r.text
            r = c.put("/api/jobs/j/meta?x=1&x=1", json=trace.meta.to_dict())
            assert r.status_code == 422, r.text
            assert c.get("/api/alerts?limit=1&after=&log_before=1").status_code == 200
            assert c.get("/api/jobs/j?window=0&history=1").status_code in (200, 404)
            assert c.get("/health").status_code == 200
    finally:
        s.stop()
