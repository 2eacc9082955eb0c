"""Defect classes found attacking a real monitor on loopback (session 39): each case is
answered, stored or refused, and the service starts again with every acknowledged part."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

TOKEN = "adversary-test-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


def in_call(name: str) -> bool:
    """Whether a thread of this process is inside the monitor's function `name` now."""
    import sys

    for frame in sys._current_frames().values():
        while frame is not None:
            if frame.f_code.co_name == name and frame.f_code.co_filename.endswith(
                    "monitor/service.py"):
                return True
            frame = frame.f_back
    return False


def serve(db) -> MonitorServer:
    return MonitorServer(db, port=0, token=TOKEN, config=CFG).start()


def windows(c: httpx.Client, job: str, n: int) -> list[dict]:
    return eventually(lambda: len(get(c, f"/api/jobs/{job}")["windows"]) >= n
                      and get(c, f"/api/jobs/{job}")["windows"], what=f"{n} windows of {job}")


@pytest.mark.slow
def test_a_stored_part_without_rows_does_not_set_its_job_aside_at_the_next_start(tmp_path):
    """A part of zero rows is stored (its last step -1); the next start took that -1 for a
    damaged row and quarantined the job, and its other parts' windows were never analysed."""
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    s = serve(tmp_path / "mon.db")
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            for rank, part, cols in parts:
                if part == 0:
                    r = c.put(f"/api/jobs/j/ranks/{rank}/parts/0", content=table_bytes(cols),
                              headers=AUTH)
                    assert r.status_code == 200, r.text
            empty = {k: v[:0] for k, v in parts[0][2].items()}
            r = c.put("/api/jobs/j/ranks/0/parts/1", content=table_bytes(empty), headers=AUTH)
            assert r.status_code == 200 and r.json()["records"] == 0, r.text
    finally:
        s.stop()
    s = serve(tmp_path / "mon.db")
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            job = get(c, "/api/jobs/j")
            assert job["quarantined"] is None and job["state"] != "quarantined", job
            for rank, part, cols in parts:
                if part == 1:
                    r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{part + (rank == 0)}",
                              content=table_bytes(cols), headers=AUTH)
                    assert r.status_code == 200, r.text
            got = windows(c, "j", 2)
            full = [get(c, f"/api/jobs/j/windows/{w['idx']}") for w in got]
            assert [(w["first_step"], w["error"], w["missing_ranks"]) for w in full] == \
                [(0, None, []), (5, None, [])], full
    finally:
        s.stop()


@pytest.mark.slow
def test_a_read_of_the_store_holds_up_no_other_request(tmp_path):
    """The read endpoints ran their store queries on the event loop: one /api/alerts or
    /api/jobs of 10,000 jobs (anonymous unless --private) held every other request, /health
    and uploads included, until it was done. Here the read waits on the test's event: /health
    and an upload are answered while it waits."""
    import threading

    trace = slow_job(steps=5)
    (rank, part, cols), *_ = parts_of(trace, 5)
    s = serve(tmp_path / "mon.db")
    entered, release = threading.Event(), threading.Event()
    real = s.monitor.store.alerts_page

    def held(*args, **kwargs):
        entered.set()
        release.wait(120)
        return real(*args, **kwargs)

    s.monitor.store.alerts_page = held
    answers: list[int] = []
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            reader = threading.Thread(
                target=lambda: answers.append(httpx.get(f"{s.url}/api/alerts",
                                                        timeout=180).status_code))
            reader.start()
            assert entered.wait(60)
            try:
                assert c.get("/health").status_code == 200
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                          headers=AUTH)
                assert r.status_code == 200, r.text
            finally:
                release.set()
                reader.join()
            assert answers == [200]
    finally:
        release.set()
        s.stop()


@pytest.mark.slow
def test_an_upload_for_a_job_not_held_here_does_not_wait_for_the_ingest_on_the_event_loop(
        tmp_path):
    """An upload for a job without a tracker here (unknown, finished, another instance's)
    looked the job up under the monitor's lock on the event loop: while the ingest held that
    lock (a batch's trackers, windows cut) every request waited, /health included; a client
    sending parts for made-up job names made it so all the time. Here the test holds the lock."""
    import threading

    trace = slow_job(steps=5)
    (rank, part, cols), *_ = parts_of(trace, 5)
    s = serve(tmp_path / "mon.db")
    answers: list[int] = []
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            with s.monitor._lock:
                sender = threading.Thread(target=lambda: answers.append(httpx.put(
                    f"{s.url}/api/jobs/nobody/ranks/0/parts/0", content=table_bytes(cols),
                    headers=AUTH, timeout=180).status_code))
                sender.start()
                eventually(lambda: in_call("tracker"), what="the upload at the lock")
                assert c.get("/health").status_code == 200
            sender.join()
            assert answers == [404]
    finally:
        s.stop()


def test_a_part_with_16_bit_float_times_is_refused_naming_the_column(tmp_path):
    """Half floats read as numbers by the schema check, then failed the time check with a
    TypeError's text ("could not be checked (TypeError: ufunc 'isfinite' ...)")."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    from stragglers.monitor.parts import read_part_footer, read_upload
    from stragglers.trace.runformat import rank_file_name

    rank, part, cols = parts_of(slow_job(steps=5), 5)[0]
    for name in ("duration", "start_ts"):
        t = pq.read_table(io.BytesIO(table_bytes(cols)))
        t = t.set_column(t.schema.get_field_index(name), name, t[name].cast(pa.float16()))
        buf = io.BytesIO()
        pq.write_table(t, buf)
        path = tmp_path / rank_file_name(rank, part)
        path.write_bytes(buf.getvalue())
        for got in (read_upload(buf.getvalue(), "upload", rank, part, path),
                    read_part_footer(path)):
            assert isinstance(got, Exception) and got.field == name, got
            assert "TypeError" not in str(got) and "halffloat" in str(got), got


@pytest.mark.slow
def test_a_rescan_lists_only_the_folders_that_changed(tmp_path, monkeypatch):
    """Every rescan listed every subdirectory of a watched folder to find runs: 100,000 empty
    folders there cost ~30% of a core for good. A folder found not to be a run is listed
    again only once it changed (a meta.json or a part added to it changes its mtime)."""
    import os

    from monitor_jobs import start_run
    from stragglers.monitor import ingest_files

    runs = tmp_path / "runs"
    old = 1_000_000_000
    for i in range(50):
        (runs / f"empty{i:03d}").mkdir(parents=True)
        os.utime(runs / f"empty{i:03d}", (old, old))
    start_run(runs / "real", slow_job(steps=5))
    s = MonitorServer(tmp_path / "mon.db", watch=[runs], port=0, token=TOKEN,
                      config=CFG.replace(rescan_s=3600)).start()
    assert s.monitor.wait_idle(120)   # (the first scan runs in the background)
    listed: list[str] = []
    real_is_run = ingest_files._is_run

    def counted(d):
        listed.append(d.name)
        return real_is_run(d)

    monkeypatch.setattr(ingest_files, "_is_run", counted)
    try:
        assert s.watcher.run_dirs() == [runs / "real"]
        assert listed == ["real"], listed   # the empty folders were found so at the start
        start_run(runs / "empty007", slow_job(steps=5))   # a run begins in one of them
        listed.clear()
        assert s.watcher.run_dirs() == [runs / "empty007", runs / "real"]
        assert sorted(listed) == ["empty007", "real"], listed
    finally:
        s.stop()


@pytest.mark.slow
def test_a_wild_step_is_refused_when_it_comes_in_one_batch_with_the_jobs_first_parts(
        tmp_path):
    """A part whose steps lie 2**40 past the job's last step is refused; but the job's last
    step was the one stored before the batch, so a new job's first parts and the wild one
    taken in one batch (a watched run written before the start, uploads queued together)
    let it through: its rows were held, and never analysed. The test holds the ingest on
    another part while the two are queued behind it."""
    import threading

    trace = slow_job(steps=10)
    parts = {(r, p): cols for r, p, cols in parts_of(trace, 5)}
    wild = dict(parts[0, 1], step=parts[0, 1]["step"] + 2**40)
    s = serve(tmp_path / "mon.db")
    entered, release = threading.Event(), threading.Event()
    real = s.monitor.store.add_parts

    def held(*args, **kwargs):
        entered.set()
        release.wait(120)
        return real(*args, **kwargs)

    answers: dict[str, int] = {}

    def send(name: str, rank: int, part: int, cols: dict, job: str = "j") -> threading.Thread:
        t = threading.Thread(target=lambda: answers.setdefault(name, httpx.put(
            f"{s.url}/api/jobs/{job}/ranks/{rank}/parts/{part}", content=table_bytes(cols),
            headers=AUTH, timeout=180).status_code))
        t.start()
        return t

    try:
        with httpx.Client(base_url=s.url, timeout=60):
            for job in ("j", "other"):
                assert httpx.put(f"{s.url}/api/jobs/{job}/meta", json=trace.meta.to_dict(),
                                 headers=AUTH).status_code == 200
            s.monitor.store.add_parts = held
            threads = [send("first", 1, 0, parts[1, 0], "other")]   # (another job's part)
            try:
                assert entered.wait(60)
                threads.append(send("r0p0", 0, 0, parts[0, 0]))
                eventually(lambda: s.monitor._inflight == 2, what="r0p0 queued")
                threads.append(send("wild", 0, 1, wild))
                eventually(lambda: s.monitor._inflight == 3, what="the wild part queued")
            finally:
                release.set()
                for t in threads:
                    t.join()
            assert answers == {"first": 200, "r0p0": 200, "wild": 422}, answers
    finally:
        release.set()
        s.stop()


@pytest.mark.slow
def test_a_huge_world_with_one_rank_heard_holds_no_per_rank_change_state(tmp_path):
    """The change detector's per-rank state (baseline and recent values, ~1 KB a rank) was
    built for the declared world at a job's first part: a job of 65,536 ranks of which one
    sent a part held ~65 MB, and a token holder creating such jobs at the allowed rate grew
    the monitor by ~8 GB a minute. It is built once half the ranks have sent a part."""
    trace = slow_job(steps=5)
    parts = parts_of(trace, 5)
    huge = trace.meta.to_dict()
    huge.update(dp_size=256, pp_size=256, world_size=65_536)
    huge["extra"].pop("layout")
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN,
                      config=CFG.replace(change_detector=True)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/huge/meta", json=huge, headers=AUTH).status_code == 200
            assert c.put("/api/jobs/normal/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            rank, part, cols = parts[0]
            assert c.put(f"/api/jobs/huge/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                         headers=AUTH).status_code == 200
            for rank, part, cols in parts:   # (its parts come after the huge job's)
                assert c.put(f"/api/jobs/normal/ranks/{rank}/parts/{part}",
                             content=table_bytes(cols), headers=AUTH).status_code == 200
            detectors = s.monitor.watchdog.detectors
            eventually(lambda: "normal" in detectors, what="the normal job's detector")
            assert "huge" not in detectors
    finally:
        s.stop()


@pytest.mark.slow
def test_a_tick_does_not_walk_the_ranks_a_job_never_heard_from(tmp_path, monkeypatch):
    """Each tick walked every rank of every running job's declared world, one by one, under
    the monitor's lock (silence, the next deadline, which ranks a window has): 50 running jobs
    of 65,536 ranks with one part each took 57% of a core doing nothing (now 0.4%). The ranks never heard
    from share one silence and are taken at once; the silence decided is the same."""
    import time

    from stragglers.monitor.windows import JobTracker

    trace = slow_job(steps=5)
    huge = trace.meta.to_dict()
    huge.update(dp_size=256, pp_size=256, world_size=65_536)
    huge["extra"].pop("layout")
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN,
                      config=CFG.replace(stall_after_s=3600, tick_s=60)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/huge/meta", json=huge, headers=AUTH).status_code == 200
            rank, part, cols = parts_of(trace, 5)[0]
            assert c.put(f"/api/jobs/huge/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                         headers=AUTH).status_code == 200
            assert s.monitor.wait_idle(60)
        asked: list[int] = []
        real = JobTracker.quiet_since
        monkeypatch.setattr(JobTracker, "quiet_since",
                            lambda self, r: asked.append(r) or real(self, r))
        later = time.time() + 7200   # every rank quiet for 2 h by then
        s.monitor.silence_deadline(later)
        s.monitor.watchdog.check_silence(later)
        s.monitor.trackers["huge"].close_ready(later)
        assert len(asked) <= 8, len(asked)
        # (rank 0 holds the job's last step: quiet, not behind, so not silent)
        assert s.monitor.watchdog.silent["huge"].keys() == set(range(1, 65_536))
    finally:
        s.stop()


def test_whole_rank_files_close_the_run_without_walking_the_world_for_each(monkeypatch):
    """A run of whole-rank files closes once every expected rank came so; each file built
    the set of the declared world to ask (65,536 ranks: quadratic). The question is asked
    once enough ranks came."""
    from stragglers.monitor.windows import JobTracker

    trace = slow_job(steps=5, slow=None)
    tr = JobTracker("j", trace.meta, 5, gap_wait_s=10.0)
    asked: list[int] = []
    real = getattr(JobTracker, "heard_expected", None)
    if real is not None:
        monkeypatch.setattr(JobTracker, "heard_expected",
                            lambda self: asked.append(1) or real(self))
    monkeypatch.setattr(JobTracker, "expected_ranks",
                        property(lambda self: asked.append(1) or list(range(4))))
    for rank in range(4):
        tr.add_part(rank, 0, 4, None, 100.0)
        tr.mark_whole(rank)
        assert tr.closed_marker == (rank == 3)
    assert len(asked) == 1, asked
