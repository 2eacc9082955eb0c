"""/api/alerts a page at a time (issue 34): it answered every firing alert of every job in one
body, however many there were; now `limit` (a default and a maximum) and cursors for the rest."""

from __future__ import annotations

import httpx
import pytest

from stragglers.monitor.app import ALERTS_PAGE, ALERTS_PAGE_MAX
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig

CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)
FIRING = ALERTS_PAGE * 2 + 37


def _fill(store, firing: int, resolved: int, log_rows: int) -> None:
    """Alert rows and alert log entries written straight into the store (as a fleet of jobs
    would have raised them), plus damaged rows a store may hold."""
    labels = '{"alertname": "straggling", "job": "j0", "severity": "warning"}'
    rows = [(f"{i:016x}", "straggling", f"j{i % 7}", labels, "{}",
             "firing" if i < firing else "resolved", float(i), None, float(i))
            for i in range(firing + resolved)]
    # a fingerprint of another shape; damaged: one stored as a blob, one far longer than a
    # cursor carries
    rows += [("12345", "straggling", "j0", labels, "{}", "firing", 1.0, None, 1.0),
             (b"\x00\x01", "straggling", "j0", labels, "{}", "firing", 1.0, None, 1.0),
             ("f" * 900, "straggling", "j0", labels, "{}", "firing", 1.0, None, 1.0),
             ("g", "straggling", "j0", "{x", "{}", "firing", 1.0, None, 1.0)]

    def tx(db):
        for r in rows:
            store._exec(db, "INSERT INTO alerts (fingerprint, rule, job, labels, annotations, "
                        "status, starts_at, ends_at, last_sent) VALUES (?, ?, ?, ?, ?, ?, ?, "
                        "?, ?)", r)
        for i in range(log_rows):
            store._exec(db, "INSERT INTO alert_log (at, fingerprint, job, rule, status, "
                        "severity, summary, description, window) VALUES (?, ?, ?, ?, ?, ?, ?, "
                        "?, ?)", (float(i), f"{i:016x}", "j0", "straggling", "firing",
                                  "warning", f"s{i}", "d", i))
    store._write(tx)


@pytest.mark.slow
def test_alerts_come_a_page_at_a_time_and_the_cursors_read_each_once(tmp_path):
    s = MonitorServer(tmp_path / "mon.db", port=0, config=CFG).start()
    try:
        _fill(s.monitor.store, FIRING, 50, 250)
        with httpx.Client(base_url=s.url, timeout=60) as c:
            first = c.get("/api/alerts").json()
            assert len(first["firing"]) == ALERTS_PAGE and first["next"]
            assert len(first["log"]) == ALERTS_PAGE and first["log_next"] is not None
            seen, url = [], "/api/alerts?limit=50"
            pages = 0
            while url:
                r = c.get(url)
                assert r.status_code == 200, r.text
                body = r.json()
                assert len(body["firing"]) <= 50
                seen += [a["fingerprint"] for a in body["firing"]]
                url = f"/api/alerts?limit=50&after={body['next']}" if body["next"] else None
                pages += 1
                assert pages < 100
            # every firing alert once, resolved ones and damaged rows left out
            assert seen == [f"{i:016x}" for i in range(FIRING)] + ["12345", "f" * 900]
            # a page ending on a fingerprint longer than a cursor holds goes on past it
            body = c.get(f"/api/alerts?limit=1&after={'12345'.encode().hex()}").json()
            assert [a["fingerprint"] for a in body["firing"]] == ["f" * 900] and body["next"]
            body = c.get(f"/api/alerts?limit=1&after={body['next']}").json()
            assert body["firing"] == [] and body["next"]   # ('g' does not read)
            assert c.get(f"/api/alerts?limit=1&after={body['next']}").json()["next"] is None
            log, before = [], None
            while True:
                q = f"&log_before={before}" if before is not None else ""
                body = c.get(f"/api/alerts?limit={ALERTS_PAGE_MAX}{q}").json()
                log += [e["summary"] for e in body["log"]]
                before = body["log_next"]
                if before is None:
                    break
            assert log == [f"s{i}" for i in reversed(range(250))]
            for bad in ("limit=0", f"limit={ALERTS_PAGE_MAX + 1}", "limit=+5", "after=zz",
                        "after=abc", "after=ff", "log_before=-1"):
                r = c.get(f"/api/alerts?{bad}")
                assert r.status_code == 422 and "error" in r.json(), (bad, r.text)
            assert c.get("/health").status_code == 200
    finally:
        s.stop()
