"""A job row damaged while the monitor serves (its part sequence text: a shared store written by
another tool, a torn page) refuses that job's parts alone: the other jobs' parts of the same
ingest batch are stored (the batch's one transaction raised, and every upload in it, of every
job, was answered 500; the damaged job's for good)."""

from __future__ import annotations

import sqlite3

import httpx

from monitor_jobs import parts_of, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import open_store
from stragglers.monitor.store_base import DAMAGED
from stragglers.trace.runformat import table_bytes

TOKEN = "damaged-batch-test-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600)


def _damage(path, sql: str) -> None:
    with sqlite3.connect(path) as db:
        db.execute(sql)
    db.close()


def test_one_batch_stores_the_parts_of_jobs_whose_rows_read(tmp_path):
    path = tmp_path / "mon.db"
    store = open_store(str(path))
    try:
        for job in ("bad", "ok"):
            store.register_job(job, f"/runs/{job}", "http", None)
        _damage(path, "UPDATE jobs SET part_seq = 'x' WHERE job = 'bad'")
        got = store.add_parts([("bad", 0, 0, 5, 0, 4, 100, "http"),
                               ("ok", 0, 0, 5, 0, 4, 100, "http"),
                               ("ok", 1, 0, 5, 0, 4, 100, "http")])
        assert got == [DAMAGED, True, True]   # the damaged job's part refused, none stored
        assert store.totals()["by_job"]["ok"].parts == 2
        assert "bad" not in store.totals()["by_job"]
        assert store.job_marks(["ok"])["ok"].part_seq == 2
    finally:
        store.close()


def test_a_job_row_damaged_while_serving_refuses_its_parts_not_500(tmp_path):
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for job in ("bad", "ok"):
                assert c.put(f"/api/jobs/{job}/meta", json=trace.meta.to_dict(),
                             headers=AUTH).status_code == 200
            _damage(tmp_path / "mon.db", "UPDATE jobs SET part_seq = 'x' WHERE job = 'bad'")
            rank, n, cols = parts[0]
            r = c.put(f"/api/jobs/bad/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                      headers=AUTH)
            # set aside, as a job whose row is damaged at a start is (was 404 'unknown job')
            assert r.status_code == 409 and "set aside" in r.json()["error"], r.text
            assert "bad" in s.monitor.quarantined and "ok" not in s.monitor.quarantined
            r = c.put(f"/api/jobs/ok/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                      headers=AUTH)
            assert r.status_code == 200, r.text
    finally:
        s.stop()
