"""An uploaded job set aside for a damaged stored row: its metadata announced again repairs
what it can (the row's way) and brings the job back; where it cannot (a part row past the world
size), the announcement is refused with the reason, not answered "ok" while every part is 409."""

from __future__ import annotations

import sqlite3

import httpx

from conftest import eventually
from monitor_jobs import get, parts_of, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

TOKEN = "damaged-rows-test-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600)


def _stored_then_damaged(tmp_path, sql: str):
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            for rank, n, cols in parts[:3]:
                assert c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                             headers=AUTH).status_code == 200
    finally:
        s.stop()
    with sqlite3.connect(tmp_path / "mon.db") as db:
        db.execute(sql)
    db.close()
    return trace, parts


def _state(c) -> str:
    return {j["job"]: j["state"] for j in get(c, "/api/jobs")["jobs"]}["j"]


def test_a_damaged_way_is_repaired_by_the_metadata_announced_again(tmp_path):
    trace, parts = _stored_then_damaged(tmp_path, "UPDATE jobs SET way = 'ftp' WHERE job = 'j'")
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert _state(c) == "quarantined"
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            for rank, n, cols in parts[3:]:
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                          headers=AUTH)
                assert r.status_code == 200, r.text
            eventually(lambda: get(c, "/api/jobs/j")["windows_total"] == 2, what="2 windows")
    finally:
        s.stop()
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert _state(c) != "quarantined"   # the row itself was repaired
    finally:
        s.stop()


def test_an_announcement_that_cannot_repair_the_rows_is_refused_with_the_reason(tmp_path):
    trace, _ = _stored_then_damaged(tmp_path, "UPDATE parts SET rank = 99 WHERE job = 'j' "
                                    "AND rank = 1")
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            r = c.put("/api/jobs/j/meta", json=trace.meta.to_dict(), headers=AUTH)
            assert r.status_code == 409 and "rank 99" in r.json()["error"], r.text
    finally:
        s.stop()


def _part_refusal(c, parts) -> str:
    rank, n, cols = parts[3]
    r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols), headers=AUTH)
    assert r.status_code == 409, r.text
    return r.json()["error"]


def _with_clock(trace, start: float) -> dict:
    m = trace.meta.to_dict()
    m["extra"]["clock"] = {"start": [start] * trace.meta.world_size}
    return m


def test_a_job_set_aside_for_its_part_rows_is_told_the_new_run_that_brings_it_back(tmp_path):
    # (every 409 said "PUT its meta again", which cannot repair a part row: a client that
    # followed it looped; a new run drops the old run's rows)
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=_with_clock(trace, 1000.0),
                         headers=AUTH).status_code == 200
            for rank, n, cols in parts[:3]:
                assert c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                             headers=AUTH).status_code == 200
    finally:
        s.stop()
    with sqlite3.connect(tmp_path / "mon.db") as db:
        db.execute("UPDATE parts SET rank = 99 WHERE job = 'j' AND rank = 1")
    db.close()
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            error = _part_refusal(c, parts)
            assert "new run" in error and "meta again" not in error, error
            r = c.put("/api/jobs/j/meta", json=_with_clock(trace, 1000.0), headers=AUTH)
            assert r.status_code == 409 and "new run" in r.json()["error"], r.text
            # the remedy named works: a new run's metadata, then its parts
            assert c.put("/api/jobs/j/meta", json=_with_clock(trace, 2000.0),
                         headers=AUTH).status_code == 200
            for rank, n, cols in parts:
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                          headers=AUTH)
                assert r.status_code == 200, r.text
            eventually(lambda: get(c, "/api/jobs/j")["windows_total"] == 2, what="2 windows")
    finally:
        s.stop()


def test_a_job_set_aside_for_rows_no_upload_repairs_is_told_to_use_another_name(tmp_path):
    _, parts = _stored_then_damaged(tmp_path, "UPDATE parts SET rank = 99 WHERE job = 'j' "
                                    "AND rank = 1")   # (its run has no start clock)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            error = _part_refusal(c, parts)
            assert "another job name" in error and "meta again" not in error, error
    finally:
        s.stop()


def test_a_job_set_aside_for_its_metadata_is_told_to_announce_it_again(tmp_path):
    trace, parts = _stored_then_damaged(tmp_path, "UPDATE jobs SET meta = '{\"world_size\": "
                                        "\"x\"}' WHERE job = 'j'")
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert "PUT its meta.json again" in _part_refusal(c, parts)
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            for rank, n, cols in parts[3:]:
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                          headers=AUTH)
                assert r.status_code == 200, r.text
            eventually(lambda: get(c, "/api/jobs/j")["windows_total"] == 2, what="2 windows")
    finally:
        s.stop()
