"""Red-team cases of issue 34 that the earlier hostile tests did not cover: metadata the
analysis reads with the wrong types, part files not named as the recorder names them, bad
meta.json files re-read and named again every rescan, a stray part-named file at the top of a
folder of runs."""

from __future__ import annotations

import json
import os
import shutil
import sqlite3

import httpx
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, slow_job, start_run, write_parts
from stragglers.monitor.ingest_files import DirectoryWatcher
from stragglers.monitor.part_names import parse_part_name
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

TOKEN = "red-team-test-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600)

# extra keys the what-if engine reads, with values of a type it cannot use: each once let
# every window of its job be stored as "analysis failed: TypeError ..."
POISON = {"notes": 5, "ranks_missing": 7}


@pytest.mark.slow
def test_extra_keys_the_analysis_reads_are_checked_before_and_after_they_are_stored(tmp_path):
    trace = slow_job(steps=10)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for key, value in POISON.items():
                meta = trace.meta.to_dict()
                meta["extra"] = {**meta["extra"], key: value}
                r = c.put(f"/api/jobs/bad-{key}/meta", content=json.dumps(meta), headers=AUTH)
                assert r.status_code == 422, r.text
                assert f"extra.{key}" in r.json()["error"], r.text
                assert c.get(f"/api/jobs/bad-{key}").status_code == 404
            for job in ("good", "worn"):
                assert c.put(f"/api/jobs/{job}/meta", json=trace.meta.to_dict(),
                             headers=AUTH).status_code == 200
            for rank, part, cols in parts_of(trace, 5):
                r = c.put(f"/api/jobs/good/ranks/{rank}/parts/{part}",
                          content=table_bytes(cols), headers=AUTH)
                assert r.status_code == 200, r.text
            wins = eventually(lambda: len(get(c, "/api/jobs/good")["windows"]) == 2
                              and get(c, "/api/jobs/good")["windows"], what="2 windows")
            assert [w["error"] for w in wins] == [None, None]
    finally:
        s.stop()
    # the same value written straight into the store: that job is set aside at start, alone
    with sqlite3.connect(tmp_path / "mon.db") as db:
        db.execute("UPDATE jobs SET meta = json_set(meta, '$.extra.notes', 5) WHERE job = 'worn'")
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            states = {j["job"]: j["state"] for j in get(c, "/api/jobs")["jobs"]}
            assert states == {"good": "running", "worn": "quarantined"}, states
            assert "extra.notes" in s.monitor.quarantined["worn"]
            assert len(get(c, "/api/jobs/good")["windows"]) == 2
            rank, part, cols = parts_of(trace, 5)[0]
            r = c.put(f"/api/jobs/worn/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                      headers=AUTH)
            assert r.status_code == 409 and "set aside" in r.json()["error"], r.text
            assert c.get("/health").status_code == 200
    finally:
        s.stop()


def test_only_part_names_as_the_recorder_writes_them_are_parts():
    assert parse_part_name("rank-00003.part-000012.parquet") == (3, 12)
    assert parse_part_name("rank-00003.parquet") == (3, 0)
    assert parse_part_name("rank-1234567.part-999999.parquet") == (1234567, 999999)
    # other spellings of the same numbers named the recorder's own files
    for name in ("rank-3.part-12.parquet", "rank-00003.part-0000012.parquet",
                 "rank-000003.parquet", "rank-00003.part-" + "0" * 300 + "1.parquet"):
        assert parse_part_name(name) is None, name


@pytest.mark.slow
def test_a_copy_of_a_part_under_another_spelling_of_a_number_changes_nothing(tmp_path):
    # rank-0.part-1.parquet, a copy of part 0, was stored as part 1 before the recorder's own
    # part 1 (refused as other bytes) and made the real part 0 an overlap (refused): a window
    # analysed without rank 0; and after a restart part 1's path was rebuilt as the other file
    runs = tmp_path / "runs"
    run = runs / "job"
    trace = slow_job(steps=10)
    start_run(run, trace)
    write_parts(run, parts_of(trace, 5))
    shutil.copy(run / "rank-00000.part-000000.parquet", run / "rank-0.part-1.parquet")
    shutil.copy(run / "rank-00001.part-000000.parquet", run / "rank-00001.part-01.parquet")
    s = MonitorServer(tmp_path / "mon.db", watch=[runs], port=0, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            wins = eventually(lambda: len(get(c, "/api/jobs/job")["windows"]) == 2
                              and get(c, "/api/jobs/job")["windows"], what="2 windows")
            assert [w["error"] for w in wins] == [None, None], wins
            for i in range(2):
                assert get(c, f"/api/jobs/job/windows/{i}")["missing_ranks"] == []
            assert get(c, "/api/stats")["by_job"]["job"]["parts"] == 8
    finally:
        s.stop()


def test_a_bad_meta_json_is_named_once_until_its_file_changes(tmp_path):
    # every rescan re-read each bad meta.json and named it again: a log line per bad run
    # every rescan_s, for as long as the file stayed
    runs = tmp_path / "runs"
    bad = runs / "bad"
    bad.mkdir(parents=True)
    (bad / "meta.json").write_text('{"dp_size": "x"}')
    (runs / "array").mkdir()
    (runs / "array" / "meta.json").write_text("[1]")
    trace = slow_job(steps=5)
    s = MonitorServer(tmp_path / "mon.db", watch=[runs], port=0, config=CFG).start()
    try:
        watcher = s.watcher
        assert isinstance(watcher, DirectoryWatcher)

        def named(run: str) -> int:
            return sum(r["source"] == f"{run}/meta.json" for r in s.monitor.recent_rejects)

        for _ in range(4):
            watcher.scan()
        assert (named("bad"), named("array")) == (1, 1), list(s.monitor.recent_rejects)
        (bad / "meta.json").write_text('{"dp_size": "y"}')   # changed: read and named again
        watcher.scan()
        watcher.scan()
        assert named("bad") == 2
        start_run(bad, trace)   # now good: taken
        watcher.scan()
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert get(c, "/api/jobs/bad")["state"] == "running"
    finally:
        s.stop()


@pytest.mark.slow
def test_a_stray_part_named_file_at_the_top_of_a_folder_of_runs_hides_no_run(tmp_path):
    # the folder was then taken for one run: none of its runs was picked up at start
    runs = tmp_path / "runs"
    trace = slow_job(steps=5)
    start_run(runs / "a", trace)
    write_parts(runs / "a", parts_of(trace, 5))
    os.mkfifo(runs / "rank-00000.part-000000.parquet")
    s = MonitorServer(tmp_path / "mon.db", watch=[runs], port=0, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            wins = eventually(lambda: get(c, "/api/jobs/a")["windows"], what="window of run a")
            assert [w["error"] for w in wins] == [None]
    finally:
        s.stop()


@pytest.mark.slow
def test_a_part_at_another_place_than_its_rank_in_the_layout_is_refused_alone(tmp_path):
    # rank 0 (dp 0, stage 0) sending rows of dp 1 or stage 1: inside the sizes, so stored, and
    # then every window of the job failed ("two ops share ...") for every rank
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    rank, part, cols = parts[0]
    place = next(e for e in trace.meta.extra["layout"] if e["rank"] == rank)
    moved = {"dp_rank": {**cols, "dp_rank": cols["dp_rank"] * 0 + 1 - place["dp_rank"]},
             "stage": {**cols, "stage": cols["stage"] * 0 + 1 - place["stage"]}}
    runs = tmp_path / "runs"
    start_run(runs / "w", trace)
    write_parts(runs / "w", [(rank, part, moved["stage"])])
    s = MonitorServer(tmp_path / "mon.db", watch=[runs], port=0, token=TOKEN,
                      config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            url = f"/api/jobs/j/ranks/{rank}/parts/{part}"
            for column, rows in moved.items():
                r = c.put(url, content=table_bytes(rows), headers=AUTH)
                assert r.status_code == 422, r.text
                assert f"'{column}'" in r.json()["error"] and "layout" in r.json()["error"]
            assert c.put(url, content=table_bytes(cols), headers=AUTH).json()["status"] == \
                "stored"
            for rank, part, cols in parts[1:]:
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                          headers=AUTH)
                assert r.status_code == 200, r.text
            wins = eventually(lambda: len(get(c, "/api/jobs/j")["windows"]) == 2
                              and get(c, "/api/jobs/j")["windows"], what="2 windows")
            assert [w["error"] for w in wins] == [None, None], wins
            # the watched part the same way: refused, named, nothing of it stored
            eventually(lambda: any(r["source"] == "w/rank-00000.part-000000.parquet"
                                   and "layout" in r["problem"]
                                   for r in get(c, "/api/stats")["rejects"]), what="refusal")
            assert "w" not in get(c, "/api/stats")["by_job"]
    finally:
        s.stop()


@pytest.mark.slow
def test_a_part_declared_over_max_part_bytes_is_413_whatever_its_job_holds(tmp_path):
    # it was answered 507 "job full" (which names the job's bytes and limit) before its
    # length was compared with max_part_bytes
    import socket

    trace = slow_job(steps=5)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
        host, port = s.url.removeprefix("http://").split(":")
        for declared in (CFG.max_job_bytes + 1, CFG.max_part_bytes + 1):
            with socket.create_connection((host, int(port)), timeout=60) as sock:
                sock.sendall(f"PUT /api/jobs/j/ranks/0/parts/0 HTTP/1.1\r\nHost: localhost\r\n"
                             f"Authorization: Bearer {TOKEN}\r\nContent-Length: {declared}\r\n"
                             "\r\n".encode())
                head = sock.recv(65536).decode("latin-1")
            assert head.startswith("HTTP/1.1 413"), head[:300]
            assert "max_job_bytes" not in head and "bytes allowed for a part" in head, head
    finally:
        s.stop()


DAMAGED = {   # a stored row of job `v` as the ingest never writes one
    # the next window's index was 2**63: every later window of the job failed to store
    "window index": "UPDATE windows SET idx = 9223372036854775807 WHERE job = 'v' AND idx = 1",
    # every later row of the job was dropped as already analysed
    "window step": "UPDATE windows SET last_step = 9223372036854775807 WHERE job = 'v' "
                   "AND idx = 1",
    "part step": "UPDATE parts SET last_step = 9223372036854775807 WHERE job = 'v' "
                 "AND rank = 1 AND part = 1",
    "part rank": "UPDATE parts SET rank = 99 WHERE job = 'v' AND rank = 1 AND part = 1",
    "way": "UPDATE jobs SET way = 'ftp' WHERE job = 'v'",
    # listed as running, its parts answered 404 "unknown job"
    "no metadata": "UPDATE jobs SET meta = NULL WHERE job = 'v'",
}
# stored rows that name nothing the monitor reads: an uploaded job's folder is its uploads
# folder's, whatever path its row kept (a row saying /etc once had its uploads refused as a
# watched run's, for good; then the job was set aside, as was every uploaded job of a store
# opened by another path)
HARMLESS = {"directory": "UPDATE jobs SET directory = '/etc' WHERE job = 'v'"}


@pytest.mark.slow
def test_stored_rows_the_ingest_never_writes_quarantine_their_job_alone(tmp_path):
    trace = slow_job(steps=15)
    parts = parts_of(trace, 5)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for job in ("g", "v"):
                assert c.put(f"/api/jobs/{job}/meta", json=trace.meta.to_dict(),
                             headers=AUTH).status_code == 200
                for rank, part, cols in parts[:8]:
                    r = c.put(f"/api/jobs/{job}/ranks/{rank}/parts/{part}",
                              content=table_bytes(cols), headers=AUTH)
                    assert r.status_code == 200, r.text
                eventually(lambda: len(get(c, f"/api/jobs/{job}")["windows"]) == 2,
                           what=f"{job}'s windows")
    finally:
        s.stop()
    def copy(src, dst) -> None:   # the store as it is (its write-ahead log included)
        for f in (dst.name, f"{dst.name}-wal", f"{dst.name}-shm"):
            (dst.parent / f).unlink(missing_ok=True)
        with sqlite3.connect(src) as a, sqlite3.connect(dst) as b:
            a.backup(b)
        a.close()
        b.close()

    copy(tmp_path / "mon.db", tmp_path / "pristine.db")
    for damage, sql in [*DAMAGED.items(), *HARMLESS.items()]:
        copy(tmp_path / "pristine.db", tmp_path / "mon.db")
        with sqlite3.connect(tmp_path / "mon.db") as db:
            db.execute(sql)
        s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
        try:
            with httpx.Client(base_url=s.url, timeout=60) as c:
                states = {j["job"]: j["state"] for j in get(c, "/api/jobs")["jobs"]}
                v = "running" if damage in HARMLESS else "quarantined"
                assert states == {"g": "running", "v": v}, (damage, states)
                for rank, part, cols in parts[8:]:   # the good job goes on
                    r = c.put(f"/api/jobs/g/ranks/{rank}/parts/{part}",
                              content=table_bytes(cols), headers=AUTH)
                    assert r.status_code == 200, r.text
                wins = eventually(lambda: len(get(c, "/api/jobs/g")["windows"]) == 3
                                  and get(c, "/api/jobs/g")["windows"], what="g's 3rd window")
                assert [w["error"] for w in wins] == [None] * 3
        finally:
            s.stop()


def test_a_window_missing_one_rank_is_analysed_on_its_whole_replicas():
    # one rank's part lost (deleted, replaced, truncated after it was stored) or a rank dead
    # in a stalled job's last window: the engine refused the window (every step lacked a
    # worker) and it was stored as an error row for every rank
    import time

    import numpy as np

    from stragglers.monitor.windows import Window, analyse_window
    from stragglers.trace.model import Trace

    trace = slow_job(steps=5, dp=2, pp=2)
    o = trace.ops
    lost = int(o["rank"][(o["dp_rank"] == 0) & (o["stage"] == 1)][0])
    keep = o["rank"] != lost
    window = Window("j", 0, list(range(5)), Trace({k: v[keep] for k, v in o.items()},
                                                   trace.meta, "monitor:j#0"),
                    missing_ranks=[lost], closed_at=time.time(), reason="stalled")
    row, refused = analyse_window(window)
    assert row.error is None and row.slowdown is not None, row.error
    assert row.missing_ranks == [lost] and refused == []
    # the replica that is whole is the one scored: the slow worker (dp 1, stage 1) is named
    slow = int(o["rank"][(o["dp_rank"] == 1) & (o["stage"] == 1)][0])
    assert max(row.scores, key=lambda s: s.score).rank == slow
    assert {s.dp for s in row.scores} == {1}
    # a rank missing from the only replica: no whole replica is left, an error row as before
    one = slow_job(steps=5, dp=1, pp=2, slow=(0, 1, 3.0))
    o = one.ops
    keep = o["stage"] == 0
    window = Window("k", 0, list(range(5)), Trace({k: v[keep] for k, v in o.items()},
                                                   one.meta, "monitor:k#0"),
                    missing_ranks=[1], closed_at=time.time(), reason="stalled")
    assert analyse_window(window)[0].error is not None
    assert np.unique(o["stage"]).tolist() == [0, 1]


def test_a_stored_part_replaced_by_other_steps_names_its_rank_missing(tmp_path):
    # a watched file rewritten after it was stored, with rows of other steps: its rank sent
    # no row of the window, which was analysed as if it had, and failed for every rank
    import time

    from stragglers.monitor.part_footers import read_part_footer
    from stragglers.monitor.windows import Window, analyse_window
    from stragglers.trace.runformat import write_rank

    trace = slow_job(steps=10, dp=2, pp=2)
    parts = parts_of(trace, 5)
    files = [read_part_footer(write_rank(tmp_path, rank, cols, part=part))
             for rank, part, cols in parts if part == 0]
    rank0 = parts[0][0]
    later = next(cols for rank, part, cols in parts if (rank, part) == (rank0, 1))
    write_rank(tmp_path, rank0, later, part=0)   # same name, steps 5..9
    window = Window("j", 0, list(range(5)), None, missing_ranks=[], closed_at=time.time(),
                    files=files, meta=trace.meta)
    row, _ = analyse_window(window)
    assert row.missing_ranks == [rank0], row.missing_ranks
    assert row.error is None and row.slowdown is not None, row.error


def test_a_worker_that_sent_some_steps_only_does_not_fail_the_window():
    # one part of a single row (or rows cut short): no step had ops from every worker, and
    # the window was an error row for every rank; now analysed on the whole replicas
    import time

    import numpy as np

    from stragglers.monitor.windows import Window, analyse_window
    from stragglers.trace.model import Trace

    trace = slow_job(steps=5, dp=2, pp=2)
    o = trace.ops
    short = int(o["rank"][(o["dp_rank"] == 0) & (o["stage"] == 0)][0])
    first = np.flatnonzero(o["rank"] == short)[0]
    keep = (o["rank"] != short) | (np.arange(len(o["rank"])) == first)
    window = Window("j", 0, list(range(5)), Trace({k: v[keep] for k, v in o.items()},
                                                   trace.meta, "monitor:j#0"),
                    missing_ranks=[], closed_at=time.time())
    row, _ = analyse_window(window)
    assert row.error is None and row.slowdown is not None, row.error
    assert short in row.missing_ranks and {s.dp for s in row.scores} == {1}


@pytest.mark.slow
def test_a_flood_of_refusals_is_counted_in_full_but_not_logged_line_by_line(tmp_path, caplog):
    # every refused request wrote a log line: a client looping on a wrong token over its
    # 256 connections wrote ~200 KB/s of log for as long as it liked
    import logging
    import time

    from stragglers.monitor.service import REFUSAL_LOG_BURST, REFUSAL_LOG_PER_S

    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with caplog.at_level(logging.WARNING, logger="stragglers.monitor.service"):
            t0 = time.monotonic()
            for i in range(1000):
                s.monitor.reject("unauthorized", f"PUT /api/jobs/j{i}/meta", "no token")
            elapsed = time.monotonic() - t0
        lines = [r for r in caplog.records if "refused PUT /api/jobs/" in r.getMessage()]
        assert len(lines) <= REFUSAL_LOG_BURST + REFUSAL_LOG_PER_S * elapsed + 1, len(lines)
        assert len(lines) >= REFUSAL_LOG_BURST
        text = httpx.get(f"{s.url}/metrics").text
        assert 'stragglers_ingest_rejected_total{reason="unauthorized"} 1000.0' in text
    finally:
        s.stop()


@pytest.mark.slow
def test_watched_runs_named_with_other_letters_are_jobs_the_api_answers(tmp_path):
    # a run folder's name that is no job name is made one: letters outside ASCII were kept
    # ('é' is alphanumeric to Python) and '..' too, and the job was listed but its page and
    # API answered 422 (not a valid job name)
    from stragglers.monitor.part_names import check_job_name
    runs = tmp_path / "runs"
    trace = slow_job(steps=5)
    for name in ("é", "a..b", "run Ⅻ"):
        start_run(runs / name, trace)
        write_parts(runs / name, parts_of(trace, 5))
    s = MonitorServer(tmp_path / "mon.db", watch=[runs], port=0, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            jobs = eventually(lambda: len(get(c, "/api/jobs")["jobs"]) == 3
                              and [j["job"] for j in get(c, "/api/jobs")["jobs"]],
                              what="3 jobs")
            for job in jobs:
                assert check_job_name(job) == job
                wins = eventually(lambda: get(c, f"/api/jobs/{job}")["windows"],
                                  what=f"window of {job}")
                assert [w["error"] for w in wins] == [None]
                assert c.get(f"/jobs/{job}").status_code == 200
    finally:
        s.stop()
