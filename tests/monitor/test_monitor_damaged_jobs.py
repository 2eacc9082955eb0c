"""A job row damaged in the store is listed as quarantined — on the running service and after
a restart — never left out of the job list, never a 500, and the other jobs are served."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

TOKEN = "damaged-jobs-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)

DAMAGE = {   # how job `v`'s row is damaged → the name it is listed under
    "state as a blob": ("UPDATE jobs SET state = x'00ff' WHERE job = 'v'", "v"),
    "a time as text": ("UPDATE jobs SET created_at = 'yesterday' WHERE job = 'v'", "v"),
    "no known state": ("UPDATE jobs SET state = 'weird' WHERE job = 'v'", "v"),
    # its lease row (copied from the jobs at start) failed every heartbeat: no start at all
    "the name as a blob": ("UPDATE jobs SET job = x'7600' WHERE job = 'v'", "v\x00"),
}


def send(c: httpx.Client, job: str, parts) -> None:
    """Upload these (rank, part, columns) of `job`, each acknowledged."""
    for rank, part, cols in parts:
        r = c.put(f"/api/jobs/{job}/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                  headers=AUTH)
        assert r.status_code == 200, r.text


def serve(tmp_path) -> MonitorServer:
    return MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()


def listed(c: httpx.Client) -> dict[str, str]:
    r = c.get("/api/jobs")
    assert r.status_code == 200, r.text
    return {j["job"]: j["state"] for j in r.json()["jobs"]}


def served(c: httpx.Client) -> None:
    """Every read answers in the API's shape (a damaged job's own may refuse, naming it)."""
    for url in ("/api/jobs/v", "/api/stats", "/api/alerts", "/metrics", "/health"):
        r = c.get(url)
        assert r.status_code < 500, (url, r.status_code, r.text[:300])
    assert get(c, "/api/jobs/g")["state"] == "running"


@pytest.mark.slow
@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_job_row_is_listed_as_quarantined(tmp_path, damage):
    sql, name = DAMAGE[damage]
    trace = slow_job(steps=5)
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for job in ("g", "v"):
                assert c.put(f"/api/jobs/{job}/meta", json=trace.meta.to_dict(),
                             headers=AUTH).status_code == 200
            with sqlite3.connect(tmp_path / "mon.db") as db:
                db.execute(sql)
            # while it runs
            assert listed(c) == {"g": "running", name: "quarantined"}
            served(c)
    finally:
        s.stop()
    s = serve(tmp_path)   # and after a restart
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert listed(c) == {"g": "running", name: "quarantined"}
            served(c)
            assert name in s.monitor.quarantined
    finally:
        s.stop()


@pytest.mark.slow
def test_a_damaged_window_row_leaves_its_job_analysed(tmp_path):
    # a stored window whose figure, text or time held another type (text where a number
    # belongs, a blob) failed the read of the job's last windows the alert rules make: every
    # later window of the job was dropped, none stored, while its parts were acknowledged
    trace = slow_job(steps=20)
    parts = parts_of(trace, 5)
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/v/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            send(c, "v", [p for p in parts if p[1] < 2])
            eventually(lambda: len(get(c, "/api/jobs/v")["windows"]) == 2, what="2 windows")
    finally:
        s.stop()
    with sqlite3.connect(tmp_path / "mon.db") as db:
        db.execute("UPDATE windows SET slowdown = 'abc', error = x'00ff', reason = x'01', "
                   "closed_at = 'yesterday' WHERE job = 'v' AND idx = 1")
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            send(c, "v", [p for p in parts if p[1] >= 2])
            wins = eventually(lambda: len(get(c, "/api/jobs/v")["windows"]) == 4
                              and get(c, "/api/jobs/v")["windows"], what="4 windows")
            assert [w["error"] for w in wins[2:]] == [None, None], wins
            damaged = get(c, "/api/jobs/v/windows/1")   # shown with what reads
            assert damaged["slowdown"] is None and damaged["error"] is None, damaged
            assert get(c, "/api/jobs")["jobs"][0]["state"] == "running"
    finally:
        s.stop()


@pytest.mark.slow
def test_damaged_lease_and_part_rows_leave_their_jobs_analysed(tmp_path):
    # a lease row whose owner, expiry or epoch did not read was never free and never renewed
    # (alone on its store, nobody else takes it): its job's parts were acknowledged and no
    # window of it analysed again; a part row whose time did not read was left out, as if the
    # part never arrived, its acknowledged rows left out of their window
    trace = slow_job(steps=20)
    parts = parts_of(trace, 5)
    jobs = ("owner", "epoch", "part")
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for job in jobs:
                assert c.put(f"/api/jobs/{job}/meta", json=trace.meta.to_dict(),
                             headers=AUTH).status_code == 200
                # (rank 1's part 2 stored, its window not closed yet)
                send(c, job, [p for p in parts if p[1] < 2 or p[:2] == (1, 2)])
            for job in jobs:
                eventually(lambda: len(get(c, f"/api/jobs/{job}")["windows"]) == 2,
                           what=f"windows 0 and 1 of {job}")
    finally:
        s.stop()
    with sqlite3.connect(tmp_path / "mon.db") as db:
        db.execute("UPDATE leases SET owner = x'00', expires_at = NULL WHERE job = 'owner'")
        db.execute("UPDATE leases SET epoch = 'x' WHERE job = 'epoch'")
        db.execute("UPDATE parts SET ingested_at = 'x' WHERE job = 'part' AND rank = 1 AND "
                   "part = 2")
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for job in jobs:
                send(c, job, [p for p in parts if p[1] >= 2 and p[:2] != (1, 2)])
            for job in jobs:
                wins = eventually(lambda: len(get(c, f"/api/jobs/{job}")["windows"]) == 4
                                  and get(c, f"/api/jobs/{job}")["windows"],
                                  what=f"4 windows of {job}")
                assert [w["error"] for w in wins] == [None] * 4, (job, wins)
                missing = get(c, f"/api/jobs/{job}/windows/2")["missing_ranks"]
                assert missing == [], (job, missing)
    finally:
        s.stop()


@pytest.mark.parametrize("stored", ["1e300", "9e999"])
def test_a_part_row_stored_as_arriving_in_the_future_does_not_hold_off_the_stall(tmp_path,
                                                                                 stored):
    # a part row whose time read as a number past now (1e300, infinity) became its job's
    # last arrival when read back: the job never stalled nor finished, whatever its silence
    import concurrent.futures as cf
    import time

    from stragglers.monitor.part_names import fingerprint
    from stragglers.monitor.service import Monitor, PartIn
    from stragglers.monitor.store import open_store
    cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, analysis_process=False)
    trace = slow_job(steps=10)
    m = Monitor(open_store(tmp_path / "mon.db"), cfg, data_dir=tmp_path).start()
    try:
        m.register_job("j", tmp_path / "j", "http", trace.meta.to_dict())
        for rank, _, cols in [p for p in parts_of(trace, 5) if p[1] == 0]:
            body, done = table_bytes(cols), cf.Future()
            m.submit(PartIn("j", rank, 0, "http", body=body, digest=fingerprint(body),
                            done=done))
            assert done.result(60) == "stored"
    finally:
        m.stop()
        m.store.close()
    with sqlite3.connect(tmp_path / "mon.db") as db:
        db.execute(f"UPDATE parts SET ingested_at = {stored} WHERE job = 'j' AND rank = 0")
    m = Monitor(open_store(tmp_path / "mon.db"), cfg, data_dir=tmp_path).start()
    try:
        m.tick(time.time() + cfg.stall_after_s + 1)   # (its clock: silent a stall from now)
        assert m.states["j"] == "stalled"
        assert m.store.job("j").state == "stalled"
    finally:
        m.stop()
        m.store.close()


@pytest.mark.parametrize("owner", ["'ghost'", "x'00ff'"])
def test_a_lease_row_held_by_another_name_is_taken_on_a_store_of_one(tmp_path, owner):
    # alone on its SQLite file, the monitor heartbeats once, at start: a lease row held by
    # another name with an expiry far off was never free, and the job's later parts were
    # acknowledged while none of its windows was analysed
    import concurrent.futures as cf

    from stragglers.monitor.part_names import fingerprint
    from stragglers.monitor.service import Monitor, PartIn
    from stragglers.monitor.store import open_store
    cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, analysis_process=False)
    trace = slow_job(steps=15)
    parts = parts_of(trace, 5)

    def put(m, part):
        for rank, _, cols in [p for p in parts if p[1] == part]:
            body, done = table_bytes(cols), cf.Future()
            m.submit(PartIn("j", rank, part, "http", body=body, digest=fingerprint(body),
                            done=done))
            assert done.result(60) == "stored"

    m = Monitor(open_store(tmp_path / "mon.db"), cfg, data_dir=tmp_path).start()
    try:
        m.register_job("j", tmp_path / "j", "http", trace.meta.to_dict())
        put(m, 0)
        eventually(lambda: len(m.store.windows("j")) == 1, what="window 0")
    finally:
        m.stop()
        m.store.close()
    with sqlite3.connect(tmp_path / "mon.db") as db:
        db.execute(f"UPDATE leases SET owner = {owner}, expires_at = 1e300 WHERE job = 'j'")
    m = Monitor(open_store(tmp_path / "mon.db"), cfg, data_dir=tmp_path).start()
    try:
        assert m.leases.holds("j")
        put(m, 1)
        put(m, 2)
        eventually(lambda: len(m.store.windows("j")) == 3, what="windows 1 and 2 analysed")
    finally:
        m.stop()
        m.store.close()
