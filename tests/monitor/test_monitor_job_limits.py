"""Limits on what one writer may create (issue 34): bytes stored per job, empty jobs expired.

Real servers on loopback; the expiry is driven by an explicit sweep with a clock passed in, so
no verdict depends on timing.
"""

from __future__ import annotations

import time

import httpx
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, slow_job
from pg_cluster import postgres_cluster, postgres_url  # noqa: F401 - fixtures
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import open_store
from stragglers.trace.runformat import table_bytes, write_meta, write_rank

TOKEN = "job-limits-test-token-01"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=0.5)


def serve(db, tmp_path, config=CFG, watch=()):
    return MonitorServer(db, watch=list(watch), port=0, token=TOKEN, config=config,
                         data_dir=tmp_path / "uploads").start()


def put_meta(c, job, trace):
    return c.put(f"/api/jobs/{job}/meta", json=trace.meta.to_dict(), headers=AUTH)


def put_part(c, job, rank, part, body):
    return c.put(f"/api/jobs/{job}/ranks/{rank}/parts/{part}", content=body, headers=AUTH)


def stored_parts(c, job) -> int:
    by_job = get(c, "/api/stats", headers=AUTH)["by_job"]
    return by_job.get(job, {}).get("parts", 0)


# ---- bytes stored per job ---------------------------------------------------------------------

def test_a_job_past_its_byte_limit_gets_507_and_other_jobs_go_on(tmp_path):
    trace = slow_job(steps=10)
    bodies = [(rank, part, table_bytes(cols)) for rank, part, cols in parts_of(trace, 5)]
    first_two = len(bodies[0][2]) + len(bodies[1][2])
    cfg = CFG.replace(max_job_bytes=first_two)
    s = serve(tmp_path / "mon.db", tmp_path, cfg)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert put_meta(c, "big", trace).status_code == 200
            assert put_meta(c, "other", trace).status_code == 200
            for rank, part, body in bodies[:2]:
                assert put_part(c, "big", rank, part, body).status_code == 200
            rank, part, body = bodies[2]
            r = put_part(c, "big", rank, part, body)          # refused before it is read
            assert r.status_code == 507, r.text
            assert "max_job_bytes" in r.json()["error"] and "big" in r.json()["error"]
            # a chunked body (no Content-Length) is refused by the ingest thread's check
            r = c.put(f"/api/jobs/big/ranks/{rank}/parts/{part}", headers=AUTH,
                      content=iter([body[:100], body[100:]]))
            assert r.status_code == 507 and "max_job_bytes" in r.json()["error"], r.text
            # a retry of a stored part is still a duplicate, not a refusal
            assert put_part(c, "big", *bodies[0]).json()["status"] == "duplicate"
            assert stored_parts(c, "big") == 2
            assert not any(p.name.startswith(f"rank-{rank:05d}.part-{part:06d}")
                           for p in (tmp_path / "uploads" / "big").iterdir())
            rejects = get(c, "/api/stats", headers=AUTH)["rejects"]
            assert any(r["reason"] == "job_full" for r in rejects)
            for rank, part, body in bodies[:2]:               # another job is not affected
                assert put_part(c, "other", rank, part, body).status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        s.stop()


def test_a_watched_run_past_its_byte_limit_has_further_parts_refused_and_named(tmp_path):
    runs = tmp_path / "runs"
    trace = slow_job(steps=20)
    parts = parts_of(trace, 5)
    big, small = runs / "big", runs / "small"
    write_meta(big, trace.meta)
    write_meta(small, trace.meta)
    paths = [write_rank(big, rank, cols, part=part) for rank, part, cols in parts]
    sizes = [p.stat().st_size for p in paths]
    limit = sum(sizes) // 2
    for rank, part, cols in parts[:4]:
        write_rank(small, rank, cols, part=part)
    s = serve(tmp_path / "mon.db", tmp_path, CFG.replace(max_job_bytes=limit), watch=[runs])
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            eventually(lambda: stored_parts(c, "small") == 4, what="the small run's parts")

            def refused():
                return [r for r in get(c, "/api/stats", headers=AUTH)["rejects"]
                        if r["reason"] == "job_full"]
            got = eventually(refused, what="a job_full refusal")
            assert "max_job_bytes" in got[0]["problem"] and "big/rank-" in got[0]["source"]
            stored = stored_parts(c, "big")
            assert 0 < stored < len(parts)
            assert s.monitor.store.job_bytes("big") <= limit
            # every part was looked at: stored or refused, each named once
            eventually(lambda: stored + len(refused()) == len(parts), what="every part")
            assert c.get("/health").status_code == 200
    finally:
        s.stop()


# ---- empty jobs -------------------------------------------------------------------------------

@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def db(request, tmp_path):
    """The monitor's store: a SQLite file or a PostgreSQL database."""
    if request.param == "sqlite":
        return tmp_path / "mon.db"
    return request.getfixturevalue("postgres_url")


def test_empty_jobs_expire_and_free_their_place_jobs_with_parts_never(db, tmp_path):
    trace = slow_job(steps=5)
    rank, part, cols = parts_of(trace, 5)[0]
    expiry = 600.0
    cfg = CFG.replace(max_jobs=3, empty_job_expiry_s=expiry)
    s = serve(db, tmp_path, cfg)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for job in ("empty-a", "empty-b", "fed"):
                assert put_meta(c, job, trace).status_code == 200
            assert put_part(c, "fed", rank, part, table_bytes(cols)).status_code == 200
            r = put_meta(c, "newcomer", trace)
            assert r.status_code == 409 and "max_jobs" in r.json()["error"], r.text
            # not yet expired: nothing goes
            assert s.monitor.expire_empty_jobs(time.time() + expiry / 2) == []
            gone = s.monitor.expire_empty_jobs(time.time() + expiry + 1)
            assert sorted(gone) == ["empty-a", "empty-b"]
            assert not (tmp_path / "uploads" / "empty-a").exists()
            assert (tmp_path / "uploads" / "fed").is_dir()
            r = c.get("/api/jobs/empty-a", headers=AUTH)
            assert r.status_code == 404 and "error" in r.json()
            r = put_part(c, "empty-b", rank, part, table_bytes(cols))
            assert r.status_code == 404 and "meta" in r.json()["error"], r.text
            assert put_meta(c, "newcomer", trace).status_code == 200   # its place is free
            assert stored_parts(c, "fed") == 1
            names = {j["job"] for j in get(c, "/api/jobs", headers=AUTH)["jobs"]}
            assert names == {"fed", "newcomer"}
    finally:
        s.stop()
    store = open_store(db)
    try:
        assert store.job_names() == {"fed", "newcomer"}
        assert {lease.job for lease in store.leases()} == {"fed", "newcomer"}
    finally:
        store.close()


def test_a_job_announced_again_counts_its_expiry_from_then(tmp_path):
    trace = slow_job(steps=5)
    expiry = 600.0
    s = serve(tmp_path / "mon.db", tmp_path, CFG.replace(empty_job_expiry_s=expiry))
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert put_meta(c, "slow-start", trace).status_code == 200
            row = s.monitor.store.job("slow-start")
            created = row.created_at
            # the store's clock moved on by passing times in: announced again "later"
            s.monitor.store.register_job("slow-start", str(tmp_path / "uploads" / "slow-start"),
                                         "http", trace.meta.to_dict(), now=created + expiry)
            assert s.monitor.expire_empty_jobs(created + expiry + 1) == []
            assert s.monitor.expire_empty_jobs(created + 2 * expiry + 1) == ["slow-start"]
    finally:
        s.stop()


def test_watched_runs_without_parts_are_not_expired(tmp_path):
    runs = tmp_path / "runs"
    trace = slow_job(steps=5)
    write_meta(runs / "waiting", trace.meta)
    s = serve(tmp_path / "mon.db", tmp_path, watch=[runs])
    try:
        eventually(lambda: "waiting" in s.monitor.directories, what="the watched run")
        assert s.monitor.expire_empty_jobs(time.time() + 10 * CFG.empty_job_expiry_s) == []
        assert (runs / "waiting" / "meta.json").exists()
    finally:
        s.stop()
