"""An uploads folder belongs to one store (monitor/uploads_mark.py): started with a folder that
lacks the store's uploaded parts, or with another store's folder, the monitor refuses in one
line; the store and its folder moved together go on."""

from __future__ import annotations

import shutil
import sqlite3

import httpx
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, slow_job
from stragglers.errors import InputError
from stragglers.monitor.part_names import part_path
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.uploads_mark import MARK_FILE
from stragglers.trace.runformat import table_bytes

TOKEN = "uploads-mark-test-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600)


def _serve(tmp_path, data_dir):
    return MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG,
                         data_dir=data_dir).start()


def _upload(s, trace, parts) -> None:
    with httpx.Client(base_url=s.url, timeout=60) as c:
        assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                     headers=AUTH).status_code == 200
        for rank, n, cols in parts:
            r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                      headers=AUTH)
            assert r.status_code == 200, r.text


def test_an_uploads_folder_without_the_stores_parts_is_refused(tmp_path):
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    s = _serve(tmp_path, tmp_path / "up1")
    try:
        _upload(s, trace, parts[:3])
    finally:
        s.stop()
    # another (empty) folder: its parts acknowledged before could not be read from it, and
    # the window they open was never analysed ("vanished before it could be read")
    with pytest.raises(InputError, match="not this store's uploads folder") as err:
        _serve(tmp_path, tmp_path / "up2")
    assert "\n" not in str(err.value) and "up2" in str(err.value)
    # the folder and its store moved together (the mark moves with it): the job goes on
    (tmp_path / "up1").rename(tmp_path / "up3")
    s = _serve(tmp_path, tmp_path / "up3")
    try:
        _upload(s, trace, parts[3:])
        with httpx.Client(base_url=s.url, timeout=60) as c:
            eventually(lambda: get(c, "/api/jobs/j")["windows_total"] == 2, what="2 windows")
    finally:
        s.stop()


def _stored_before_marks(tmp_path) -> None:
    """Job j's first two parts uploaded into tmp/up, its mark gone, as a monitor before marks
    left the folder."""
    trace = slow_job(steps=10)
    s = _serve(tmp_path, tmp_path / "up")
    try:
        _upload(s, trace, parts_of(trace, 5)[:2])
    finally:
        s.stop()
    (tmp_path / "up" / MARK_FILE).unlink()


def test_a_folder_from_before_marks_holding_the_jobs_is_marked(tmp_path):
    _stored_before_marks(tmp_path)
    _serve(tmp_path, tmp_path / "up").stop()
    assert (tmp_path / "up" / MARK_FILE).read_text().strip()


def test_another_stores_folder_is_refused(tmp_path):
    MonitorServer(tmp_path / "a.db", port=0, token=TOKEN, config=CFG,
                  data_dir=tmp_path / "up").start().stop()
    with pytest.raises(InputError, match="the uploads folder of another store"):
        MonitorServer(tmp_path / "b.db", port=0, token=TOKEN, config=CFG,
                      data_dir=tmp_path / "up")


def test_a_folder_from_before_marks_may_lack_its_finished_jobs(tmp_path):
    # a finished job's parts are never read again: an operator who removed its folder to free
    # space could not start the version with marks at all
    _stored_before_marks(tmp_path)
    shutil.rmtree(tmp_path / "up" / "j")
    with sqlite3.connect(tmp_path / "mon.db") as db:   # as the monitor finishes a job
        db.execute("UPDATE jobs SET state = 'finished' WHERE job = 'j'")
    db.close()
    _serve(tmp_path, tmp_path / "up").stop()


def test_a_mark_that_cannot_be_read_is_one_line_naming_it(tmp_path):
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / MARK_FILE).mkdir()
    with pytest.raises(InputError, match=MARK_FILE) as err:
        _serve(tmp_path, tmp_path / "up")
    assert "\n" not in str(err.value)


def test_a_job_whose_parts_are_in_another_marked_folder_is_set_aside_not_left_running(
        tmp_path):
    # the store started by turns with two uploads folders, both marked for it: parts
    # acknowledged into one were "vanished" in the other, the job listed as running and its
    # parts never analysed (each upload after them 200)
    cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600)
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    MonitorServer(tmp_path / "mon.db", port=0, config=cfg,
                  data_dir=tmp_path / "up2").start().stop()   # up2 marked, nothing in it
    s = MonitorServer(tmp_path / "mon.db", port=0, config=cfg, data_dir=tmp_path / "up1").start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict()).status_code == 200
            for rank, n, cols in parts[:3]:
                assert c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}",
                             content=table_bytes(cols)).status_code == 200
    finally:
        s.stop()
    s = MonitorServer(tmp_path / "mon.db", port=0, config=cfg, data_dir=tmp_path / "up2").start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert {j["job"]: j["state"] for j in get(c, "/api/jobs")["jobs"]} == \
                {"j": "quarantined"}
            rank, n, cols = parts[3]
            r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols))
            assert r.status_code == 409 and "--data-dir" in r.json()["error"], r.text
            # (its metadata announced here makes its folder, not its parts: still set aside)
            r = c.put("/api/jobs/j/meta", json=trace.meta.to_dict())
            assert r.status_code == 409 and "--data-dir" in r.json()["error"], r.text
    finally:
        s.stop()
    # the folder they went to brings the job back, and its windows are analysed
    s = MonitorServer(tmp_path / "mon.db", port=0, config=cfg, data_dir=tmp_path / "up1").start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for rank, n, cols in parts[3:]:
                assert c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}",
                             content=table_bytes(cols)).status_code == 200
            eventually(lambda: get(c, "/api/jobs/j")["windows_total"] == 2, what="2 windows")
    finally:
        s.stop()


@pytest.mark.slow
def test_the_one_unanalysed_part_lost_from_the_right_folder_is_passed_over(tmp_path):
    # window 0 analysed, rank 0's next part stored, then its file lost: the job was set aside
    # as "started with another --data-dir" (the folder is the right one, it holds window 0's
    # parts) and every later upload was 409
    cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600,
                        gap_wait_s=0.5)
    trace = slow_job(steps=15)
    parts = parts_of(trace, 5)   # 3 windows x 4 ranks

    def serve():
        return MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=cfg,
                             data_dir=tmp_path / "up").start()
    s = serve()
    try:
        _upload(s, trace, parts[:5])
        with httpx.Client(base_url=s.url, timeout=60) as c:
            eventually(lambda: get(c, "/api/jobs/j")["windows_total"] == 1, what="window 0")
    finally:
        s.stop()
    rank, n, _ = parts[4]
    assert (rank, n) == (0, 1)
    part_path(tmp_path / "up" / "j", rank, n).unlink()
    s = serve()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert get(c, "/api/jobs")["jobs"][0]["state"] == "running"
            for rank, n, cols in parts[5:]:
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                          headers=AUTH)
                assert r.status_code == 200, r.text
            eventually(lambda: get(c, "/api/jobs/j")["windows_total"] == 3, what="3 windows")
    finally:
        s.stop()
