"""meta.json documents that are valid JSON but not a job the monitor can analyse (issue 34):
refused before anything is stored, over HTTP and in watched directories."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

TOKEN = "hostile-meta-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=0.5)


@pytest.mark.slow
def test_a_layout_that_leaves_ranks_out_is_refused(tmp_path):
    # a window waits for the layout's ranks: a layout of rank 0 alone (or of none) had every
    # window of a 4-rank job cut without the others and stored as an analysis failure
    trace = slow_job(steps=10)
    layout = trace.meta.extra["layout"]
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for i, entries in enumerate((layout[:1], [], layout[:3])):
                meta = trace.meta.to_dict()
                meta["extra"] = {**meta["extra"], "layout": entries}
                r = c.put(f"/api/jobs/j{i}/meta", content=json.dumps(meta), headers=AUTH)
                assert r.status_code == 422, r.text
                assert "extra.layout" in r.json()["error"] and "one per rank" in r.json()["error"]
                assert c.get(f"/api/jobs/j{i}").status_code == 404
            assert get(c, "/api/jobs")["jobs"] == []
            assert c.get("/health").status_code == 200
    finally:
        s.stop()


@pytest.mark.slow
def test_a_job_without_a_layout_waits_for_every_rank_of_its_world_size(tmp_path):
    # without a layout a window waited for the ranks seen so far: the first rank's part alone
    # cut the job's first window, analysed with one of four workers (an error row)
    trace = slow_job(steps=10)
    meta = trace.meta.to_dict()
    del meta["extra"]["layout"]
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=meta, headers=AUTH).status_code == 200
            for rank, part, cols in parts_of(trace, 5):   # rank by rank, as uploads come
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                          headers=AUTH)
                assert r.status_code == 200, r.text
            eventually(lambda: len(get(c, "/api/jobs/j")["windows"]) == 2, what="windows")
            windows = get(c, "/api/jobs/j")["windows"]
            assert [w["error"] for w in windows] == [None, None], windows
            assert [w["first_step"] for w in windows] == [0, 5]
    finally:
        s.stop()


@pytest.mark.slow
def test_stored_rows_that_do_not_read_leave_the_service_up(tmp_path):
    # a job's metadata stored as a blob, a log entry whose time is text: one such row once
    # stopped every start (the jobs read at start) or failed /api/alerts for every job
    import sqlite3

    trace = slow_job(steps=5)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    with httpx.Client(base_url=s.url, timeout=60) as c:
        for job in ("good", "bad", "worn"):
            assert c.put(f"/api/jobs/{job}/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
    s.stop()
    with sqlite3.connect(tmp_path / "mon.db") as db:
        db.execute("UPDATE jobs SET meta = x'00ff00' WHERE job = 'bad'")
        db.execute("INSERT INTO alert_log (at, fingerprint, job, rule, status, severity, "
                   "summary, description, \"window\") VALUES ('x', 'f', 'bad', 'r', 's', "
                   "'warning', 's', 'd', 'w')")
        db.execute("INSERT INTO windows VALUES ('worn', 0, 0, 4, '[0,1,2,3,4]', 'NaN', NULL, "
                   "NULL, NULL, NULL, NULL, NULL, '[]', '[]', '[]', NULL, 'complete', 0, 0, 0, "
                   "'[]')")
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            assert "good" in {j["job"] for j in get(c, "/api/jobs")["jobs"]}
            assert get(c, "/api/alerts") is not None
            assert get(c, "/api/jobs/good")["state"] == "running"
            # a job whose window row holds text for a figure: shown, the figure empty (its
            # reads were refused, and its later windows dropped: test_monitor_damaged_jobs)
            worn = get(c, "/api/jobs/worn")
            assert [w["slowdown"] for w in worn["windows"]] == [None], worn
            assert worn["window"]["slowdown"] is None and worn["state"] == "running", worn
            assert c.get("/api/jobs/good").status_code == 200
    finally:
        s.stop()


def test_a_key_given_twice_or_a_layout_placing_two_ranks_at_one_place_is_refused(tmp_path):
    # {"dp_size": 3, ..., "dp_size": 2}: JSON leaves which one counts to the reader (the job was
    # taken with the last, a script reading the file may take the first); a layout with two
    # ranks at one (dp_rank, stage) was stored and every window of the job failed
    trace = slow_job(steps=10)
    meta = trace.meta.to_dict()
    twice = '{"dp_size": 3, ' + json.dumps(meta)[1:]   # the last one (2) agrees with the rest
    shared = json.loads(json.dumps(meta))
    shared["extra"]["layout"][1].update(dp_rank=shared["extra"]["layout"][0]["dp_rank"],
                                        stage=shared["extra"]["layout"][0]["stage"])
    runs = tmp_path / "runs"
    for name, text in (("twice", twice), ("shared", json.dumps(shared))):
        (runs / name).mkdir(parents=True)
        (runs / name / "meta.json").write_text(text)
    s = MonitorServer(tmp_path / "mon.db", watch=[runs], port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            r = c.put("/api/jobs/a/meta", content=twice, headers=AUTH)
            assert r.status_code == 422 and "'dp_size'" in r.json()["error"] \
                and "given twice" in r.json()["error"], r.text
            r = c.put("/api/jobs/b/meta", json=shared, headers=AUTH)
            assert r.status_code == 422 and "the place of rank" in r.json()["error"], r.text
            def watched():
                return sorted(p["source"].split("/")[0] for p in get(c, "/api/stats")["rejects"]
                              if p["reason"] == "bad_meta" and "meta.json" in p["source"]
                              and not p["source"].startswith("PUT"))

            assert eventually(lambda: len(watched()) == 2 and watched(),
                              what="both refused") == ["shared", "twice"]
            assert get(c, "/api/jobs")["jobs"] == []
            assert c.get("/health").status_code == 200
    finally:
        s.stop()


def test_a_rewrite_that_changes_a_runs_sizes_once_parts_are_stored_is_a_conflict(tmp_path):
    # the same run's meta.json PUT again with a world of 2 after ranks 2 and 3 sent parts:
    # taken (200), and the next start set the job aside (stored parts of ranks past its world)
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    meta = trace.meta.to_dict()
    smaller = json.loads(json.dumps(meta))
    smaller.update(dp_size=1, world_size=2)
    smaller["extra"]["layout"] = [dict(e, rank=i) for i, e in enumerate(
        e for e in meta["extra"]["layout"] if e["dp_rank"] == 0)]
    for attempt in range(2):
        s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
        try:
            with httpx.Client(base_url=s.url, timeout=60) as c:
                if attempt == 0:
                    assert c.put("/api/jobs/j/meta", json=meta, headers=AUTH).status_code == 200
                    assert c.put("/api/jobs/k/meta", json=meta, headers=AUTH).status_code == 200
                    for rank, part, cols in parts[:4]:
                        assert c.put(f"/api/jobs/j/ranks/{rank}/parts/{part}",
                                     content=table_bytes(cols), headers=AUTH).status_code == 200
                    r = c.put("/api/jobs/j/meta", json=smaller, headers=AUTH)
                    assert r.status_code == 409 and "world_size 2" in r.json()["error"], r.text
                    # a job with no part yet may still be given other sizes
                    assert c.put("/api/jobs/k/meta", json=smaller,
                                 headers=AUTH).status_code == 200
                job = get(c, "/api/jobs/j")
                assert (job["world_size"], job["quarantined"]) == (4, None), job
        finally:
            s.stop()


def test_a_world_larger_than_max_world_size_is_refused(tmp_path):
    # the per-rank state follows the declared world: a meta.json of 1,000,000 ranks, four of
    # which sent a part, held 1.4 GB (and raised an alert for every other rank)
    trace = slow_job(steps=5)
    meta = trace.meta.to_dict()
    del meta["extra"]["layout"]
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN,
                      config=CFG.replace(max_world_size=1000)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for world, code in ((2000, 422), (1000, 200)):
                r = c.put("/api/jobs/big/meta", headers=AUTH,
                          json={**meta, "world_size": world, "dp_size": world // 2})
                assert r.status_code == code, r.text
            assert "max_world_size" in c.put("/api/jobs/big/meta", headers=AUTH, json={
                **meta, "world_size": 2000, "dp_size": 1000}).json()["error"]
            assert get(c, "/api/jobs/big")["world_size"] == 1000
    finally:
        s.stop()


@pytest.mark.slow
def test_a_rewrite_that_moves_a_rank_once_parts_are_stored_is_a_conflict(tmp_path):
    # ranks 0 and 1 swapped in extra.layout after their parts were stored: taken (200), and
    # from then on each one's parts, at its true place, were refused 422 and lost; a layout
    # given to a job without one that contradicts the places its rows showed is the same
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    meta = trace.meta.to_dict()
    swapped = json.loads(json.dumps(meta))
    lay = swapped["extra"]["layout"]
    lay[0]["rank"], lay[1]["rank"] = lay[1]["rank"], lay[0]["rank"]
    bare = json.loads(json.dumps(meta))
    bare["extra"].pop("layout")
    rehosted = json.loads(json.dumps(meta))
    rehosted["extra"]["layout"][0]["host"] = "elsewhere"
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for job, first in (("j", meta), ("k", bare)):
                assert c.put(f"/api/jobs/{job}/meta", json=first, headers=AUTH).status_code \
                    == 200
                for rank, part, cols in parts:
                    if part == 0:
                        r = c.put(f"/api/jobs/{job}/ranks/{rank}/parts/0",
                                  content=table_bytes(cols), headers=AUTH)
                        assert r.status_code == 200, r.text
                r = c.put(f"/api/jobs/{job}/meta", json=swapped, headers=AUTH)
                assert r.status_code == 409 and "layout puts rank" in r.json()["error"], r.text
            # a new host, or the layout dropped, moves no rank
            assert c.put("/api/jobs/j/meta", json=rehosted, headers=AUTH).status_code == 200
            assert c.put("/api/jobs/j/meta", json=bare, headers=AUTH).status_code == 200
            for job in ("j", "k"):
                for rank, part, cols in parts:
                    if part == 1:
                        r = c.put(f"/api/jobs/{job}/ranks/{rank}/parts/1",
                                  content=table_bytes(cols), headers=AUTH)
                        assert r.status_code == 200, (job, rank, r.text)
                wins = eventually(lambda: len(get(c, f"/api/jobs/{job}")["windows"]) == 2
                                  and get(c, f"/api/jobs/{job}")["windows"], what="2 windows")
                full = [get(c, f"/api/jobs/{job}/windows/{w['idx']}") for w in wins]
                assert [(w["error"], w["missing_ranks"]) for w in full] == [(None, [])] * 2
    finally:
        s.stop()


@pytest.mark.slow
def test_sizes_cannot_change_while_a_part_of_the_run_is_on_its_way(tmp_path):
    # a part checked against the world of 4 and not yet committed when a meta.json of a
    # world of 2 came: the metadata was taken (no part stored yet), the part of rank 2
    # stored after it, and the next start set the job aside. The test holds the part in
    # the ingest, just before it is stored.
    import threading

    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    meta = trace.meta.to_dict()
    smaller = json.loads(json.dumps(meta))
    smaller.update(dp_size=1, world_size=2)
    smaller["extra"]["layout"] = [dict(e, rank=i) for i, e in enumerate(
        e for e in meta["extra"]["layout"] if e["dp_rank"] == 0)]
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    entered, release = threading.Event(), threading.Event()
    real = s.monitor.store.add_parts

    def held(*args, **kwargs):
        entered.set()
        release.wait(120)
        return real(*args, **kwargs)

    s.monitor.store.add_parts = held
    answers: list[int] = []
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=meta, headers=AUTH).status_code == 200
            rank, part, cols = next(p for p in parts if p[0] == 2)
            sender = threading.Thread(target=lambda: answers.append(httpx.put(
                f"{s.url}/api/jobs/j/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                headers=AUTH, timeout=180).status_code))
            sender.start()
            try:
                assert entered.wait(60)
                r = c.put("/api/jobs/j/meta", json=smaller, headers=AUTH)
                assert r.status_code == 409 and "world_size 2" in r.json()["error"], r.text
            finally:
                release.set()
                sender.join()
            assert answers == [200]
    finally:
        release.set()
        s.stop()
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            job = get(c, "/api/jobs/j")
            assert (job["world_size"], job["quarantined"]) == (4, None), job
    finally:
        s.stop()
