"""meta.json's numbers past a float's range, and the monitor's own key `extra.started` read back
from the store (red team round 11 findings 2 and 6, review 5 and 6 of session 49): any integer
a reader would take as a float must fit one (10**400 anywhere was a 500 OverflowError, or a
watched run refused at every rescan naming no field), and a stored row's start that is not one
(a timestamp string stored before the key was the monitor's, a start far ahead) is ignored,
not a job set aside or every later run refused. Real server on loopback, real SQLite."""

from __future__ import annotations

import json
import sqlite3

import httpx

from monitor_jobs import get, serving_job, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig

TOKEN = "meta-numbers-token-0123456789abcdef"
CONFIG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_an_integer_past_a_floats_range_anywhere_is_a_422_naming_it(tmp_path):
    trace = slow_job(steps=5, slow=None)
    with serving_job(tmp_path / "mon.db", trace, TOKEN, CONFIG) as c:
        for path in (["extra", "mine"], ["extra", "nested", "deep"], ["extra", "list"]):
            meta = trace.meta.to_dict()
            at = meta
            for key in path[:-1]:
                at = at.setdefault(key, {})
            at[path[-1]] = [1, -10**400] if path[-1] == "list" else 10**400
            r = c.put("/api/jobs/j/meta", content=json.dumps(meta).encode(),
                      headers={"Content-Type": "application/json"})
            assert r.status_code == 422, (path, r.status_code, r.text)
            named = ".".join(path) + ("[1]" if path[-1] == "list" else "")
            assert named in r.json()["error"] and "0000" not in r.json()["error"], r.text
        assert get(c, "/health")["ok"] is True


def _stored(tmp_path, started) -> None:
    """Job `old` registered, then its stored meta's extra.started set to `started`."""
    trace = slow_job(steps=5, slow=None)
    with serving_job(tmp_path / "mon.db", trace, TOKEN, CONFIG) as c:
        meta = {**trace.meta.to_dict()}
        meta["extra"] = {**meta["extra"], "run": "first"}
        assert c.put("/api/jobs/old/meta", json=meta).status_code == 200
    db = sqlite3.connect(tmp_path / "mon.db")
    meta = json.loads(db.execute("SELECT meta FROM jobs WHERE job = 'old'").fetchone()[0])
    meta["extra"]["started"] = started
    db.execute("UPDATE jobs SET meta = ? WHERE job = 'old'", (json.dumps(meta),))
    db.commit()
    db.close()


def test_a_stored_start_that_is_not_one_is_ignored_not_the_job_set_aside(tmp_path):
    # a row stored when extra.started was free-form (a writer's timestamp string)
    _stored(tmp_path, "2026-12-06T10:00:00Z")
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CONFIG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=AUTH) as c:
            assert get(c, "/api/jobs/old")["state"] == "running"   # (was: quarantined)
    finally:
        s.stop()


def test_a_stored_start_far_ahead_does_not_refuse_every_later_run(tmp_path):
    _stored(tmp_path, 1e300)
    trace = slow_job(steps=5, slow=None)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CONFIG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=AUTH) as c:
            meta = trace.meta.to_dict()
            meta["extra"].update(run="second", started=1.7e9)
            r = c.put("/api/jobs/old/meta", json=meta)   # (was: 409 for good, 300 digits)
            assert r.status_code == 200, r.text
            assert s.monitor.store.job("old").meta["extra"]["run"] == "second"
            meta["extra"].update(run="third", started=1e300)
            r = c.put("/api/jobs/old/meta", json=meta)
            assert r.status_code == 422 and "1e+300 is more than" in r.json()["error"], r.text
    finally:
        s.stop()
