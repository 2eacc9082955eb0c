"""The monitor against hostile input and unlucky operators (issue 34): no document, file,
connection or number can stop the service, hold it, or lose what it acknowledged. Real servers
on loopback, real SQLite, real files and FIFOs."""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import socket
import sqlite3
import subprocess
import sys
import time

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, slow_job, start_run, write_whole_run
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.columns import columns_to_table
from stragglers.trace.runformat import table_bytes, write_rank

TOKEN = "hostile-test-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=0.5)


def serve(tmp_path, config=CFG, watch=(), **kw):
    return MonitorServer(tmp_path / "mon.db", watch=list(watch), port=0, token=TOKEN,
                         config=config, **kw).start()


def meta_of(trace) -> dict:
    return trace.meta.to_dict()


def put_part(c, job, rank, part, body):
    return c.put(f"/api/jobs/{job}/ranks/{rank}/parts/{part}", content=body, headers=AUTH)


# ---- stored documents -------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("bad", ['"x"', "null", "1e400", "[1]", "true", "-1", "99"])
def test_a_layout_rank_that_is_no_rank_is_refused_and_nothing_is_stored(tmp_path, bad):
    trace = slow_job(steps=5)
    raw = json.dumps(meta_of(trace))
    first = json.dumps(trace.meta.extra["layout"][0])
    text = raw.replace(first, first.replace('"rank": 0', f'"rank": {bad}'), 1)
    assert text != raw
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            r = c.put("/api/jobs/job-m/meta", content=text, headers=AUTH)
            assert r.status_code == 422 and "layout" in r.json()["error"], r.text
            assert c.get("/api/jobs/job-m").status_code == 404
            assert c.get("/health").status_code == 200
    finally:
        s.stop()
    serve(tmp_path).stop()   # and the service starts again


@pytest.mark.slow
@pytest.mark.parametrize("layout", ['"all"', "{}", "[[0]]", '[{"rank": 0}, {"rank": 0}]'])
def test_a_layout_that_is_no_list_of_ranks_is_refused(tmp_path, layout):
    trace = slow_job(steps=5)
    raw = meta_of(trace)
    raw["extra"]["layout"] = "@"
    text = json.dumps(raw).replace('"@"', layout)
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            r = c.put("/api/jobs/job-m/meta", content=text, headers=AUTH)
            assert r.status_code == 422 and "extra.layout" in r.json()["error"], r.text
    finally:
        s.stop()


@pytest.mark.slow
def test_a_bad_stored_row_quarantines_its_job_not_the_service(tmp_path):
    # a row damaged in the store (or written by a version with looser checks): the service
    # starts, names the job as set aside, and serves every other job
    trace = slow_job(steps=10)
    s = serve(tmp_path)
    with httpx.Client(base_url=s.url, timeout=60) as c:
        for job in ("good", "bad", "worse", "odd"):
            assert c.put(f"/api/jobs/{job}/meta", json=meta_of(trace),
                         headers=AUTH).status_code == 200
    s.stop()
    broken = dict(meta_of(trace))
    broken["extra"] = {"layout": [{"rank": "x"}]}
    with sqlite3.connect(tmp_path / "mon.db") as db:
        db.execute("UPDATE jobs SET meta = ? WHERE job = 'bad'", (json.dumps(broken),))
        db.execute("UPDATE jobs SET meta = ? WHERE job = 'worse'", ("{not json",))
        db.execute("UPDATE jobs SET directory = x'00ff' WHERE job = 'odd'")
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            jobs = {j["job"]: j["state"] for j in get(c, "/api/jobs")["jobs"]}
            assert jobs["bad"] == jobs["worse"] == jobs["odd"] == "quarantined"
            assert jobs["good"] == "running"
            assert "extra.layout" in get(c, "/api/jobs/bad")["quarantined"]
            r = put_part(c, "bad", 0, 0, table_bytes(parts_of(trace, 5)[0][2]))
            assert r.status_code == 409 and "set aside" in r.json()["error"]
            for rank, part, cols in parts_of(trace, 5):
                assert put_part(c, "good", rank, part, table_bytes(cols)).status_code == 200
            eventually(lambda: len(get(c, "/api/jobs/good")["windows"]) == 2, what="windows")
            # good metadata again brings the job back
            assert c.put("/api/jobs/bad/meta", json=meta_of(trace),
                         headers=AUTH).status_code == 200
            assert get(c, "/api/jobs/bad")["state"] == "running"
    finally:
        s.stop()


def test_server_paths_are_not_shown_to_readers_of_the_job_list(tmp_path):
    trace = slow_job(steps=5)
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            c.put("/api/jobs/job-p/meta", json=meta_of(trace), headers=AUTH)
            for path in ("/api/jobs", "/api/jobs/job-p", "/api/stats"):
                text = c.get(path).text
                assert str(tmp_path) not in text and '"directory"' not in text, (path, text)
    finally:
        s.stop()


# ---- watched files ----------------------------------------------------------------------------

def test_fifos_and_bad_meta_in_watched_runs_hold_nothing_and_good_runs_still_come(tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    trace = slow_job(steps=10)
    bad = runs / "bad-layout"
    bad.mkdir()
    broken = meta_of(trace)
    broken["extra"]["layout"][0]["rank"] = "x"
    (bad / "meta.json").write_text(json.dumps(broken))
    fifo_meta = runs / "fifo-meta"
    fifo_meta.mkdir()
    os.mkfifo(fifo_meta / "meta.json")
    huge = runs / "huge-meta"
    huge.mkdir()
    (huge / "meta.json").write_text(" " * (CFG.max_meta_bytes + 10) + "{}")
    fifo_part = runs / "fifo-part"
    start_run(fifo_part, trace)
    os.mkfifo(fifo_part / "rank-00000.part-000000.parquet")
    s = serve(tmp_path, watch=[runs])
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            good = runs / "good"                 # a good run added later is picked up
            start_run(good, trace)
            for rank, part, cols in parts_of(trace, 5):
                write_rank(good, rank, cols, part=part)
            eventually(lambda: len(get(c, "/api/jobs/good")["windows"]) == 2, what="windows")
            problems = " ".join(r["source"] + " " + r["problem"]
                                for r in get(c, "/api/stats")["rejects"])
            assert "not a regular file" in problems and "extra.layout" in problems
            assert "bytes; expected at most" in problems
            assert "fifo-meta/meta.json" in problems and str(tmp_path) not in problems
    finally:
        t0 = time.monotonic()
        s.stop()
        assert time.monotonic() - t0 < 60   # nothing blocked on a FIFO


@pytest.mark.slow
def test_watched_whole_rank_files_keep_their_tail_across_a_restart(tmp_path):
    # rank-RRRRR.parquet is part 0 of its rank; the restart rebuilt a part-file name for it,
    # found nothing, and the steps not yet in a window were never analysed
    runs = tmp_path / "runs"
    run = runs / "whole"
    trace = slow_job(steps=22)
    write_whole_run(run, trace)
    s = serve(tmp_path, watch=[runs])
    with httpx.Client(base_url=s.url, timeout=60) as c:
        eventually(lambda: len(get(c, "/api/jobs/whole")["windows"]) == 4, what="4 windows")
    s.stop()
    s = serve(tmp_path, config=CFG.replace(stall_after_s=1.0), watch=[runs])
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            wins = eventually(lambda: len(get(c, "/api/jobs/whole")["windows"]) == 5
                              and get(c, "/api/jobs/whole")["windows"], what="the tail window")
            assert (wins[-1]["first_step"], wins[-1]["last_step"]) == (20, 21)
            assert wins[-1]["error"] is None
    finally:
        s.stop()


# ---- parts: bombs, columns, corruption, numbers ------------------------------------------------

def job_with_meta(c, job, trace):
    assert c.put(f"/api/jobs/{job}/meta", json=meta_of(trace), headers=AUTH).status_code == 200


def test_extra_columns_are_refused(tmp_path):
    trace = slow_job(steps=5)
    rank, part, cols = parts_of(trace, 5)[0]
    t = columns_to_table(cols).append_column("payload", pa.array(["x" * 100] * len(cols["step"])))
    buf = pa.BufferOutputStream()
    pq.write_table(t, buf)
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            job_with_meta(c, "job-c", trace)
            r = put_part(c, "job-c", rank, part, buf.getvalue().to_pybytes())
            assert r.status_code == 422 and "payload" in r.json()["error"], r.text
    finally:
        s.stop()


@pytest.mark.slow
def test_a_million_rows_of_a_long_op_name_are_refused_without_decoding_them(tmp_path):
    # 0.14 MB of Parquet once decoded to +2 GB before its unknown op type was refused
    n = 1_000_000
    name = "x" * 1000
    cols = {"rank": np.zeros(n, np.int32), "dp_rank": np.zeros(n, np.int32),
            "stage": np.zeros(n, np.int32), "step": np.zeros(n, np.int64),
            "start_ts": np.zeros(n), "duration": np.zeros(n), "seq_id": np.zeros(n, np.int32),
            "mb_id": np.zeros(n, np.int32), "mc": np.zeros(n, np.int32),
            "gmc": np.zeros(n, np.int32)}
    arrays = {k: pa.array(v) for k, v in cols.items()}
    arrays["optype"] = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)),
                                                      pa.array([name]))
    buf = pa.BufferOutputStream()
    # without the Arrow schema in the file, a reader takes the op type as plain strings
    pq.write_table(pa.table(arrays), buf, compression="zstd", store_schema=False)
    body = buf.getvalue().to_pybytes()
    assert len(body) < 2**20
    trace = slow_job(steps=5)
    s = serve(tmp_path, config=CFG.replace(max_part_bytes=4 * 2**20))
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            job_with_meta(c, "job-b", trace)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            r = put_part(c, "job-b", 0, 0, body)
            grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
            assert r.status_code == 422 and "unknown op types" in r.json()["error"], r.text
            assert grew < 700 * 2**20, grew
    finally:
        s.stop()


@pytest.mark.slow
def test_a_corrupt_page_in_any_column_is_refused_before_the_reply(tmp_path):
    trace = slow_job(steps=5)
    rank, part, cols = parts_of(trace, 5)[0]
    body = table_bytes(cols)
    meta = pq.ParquetFile(pa.BufferReader(body)).metadata
    names = meta.schema.to_arrow_schema().names
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            job_with_meta(c, "job-k", trace)
            for name in ("mc", "stage", "seq_id"):   # columns the footer check trusted
                chunk = meta.row_group(0).column(names.index(name))
                start, size = chunk.data_page_offset, chunk.total_compressed_size
                bad = bytearray(body)
                for k in range(start + size // 2, start + size - 2):
                    bad[k] ^= 0x5A
                r = put_part(c, "job-k", rank, part, bytes(bad))
                assert r.status_code == 422, (name, r.text)
            assert get(c, "/api/stats")["by_way"] == {}
            assert put_part(c, "job-k", rank, part, body).status_code == 200
    finally:
        s.stop()


@pytest.mark.slow
def test_one_wild_step_does_not_stop_later_windows(tmp_path):
    # a part holding a step of 2**63-1 once made it the job's last analysed step: every later
    # row was dropped as late and no window came again
    trace = slow_job(steps=15)
    parts = parts_of(trace, 5)
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            job_with_meta(c, "job-w", trace)
            for rank, part, cols in parts:
                if part == 0:
                    assert put_part(c, "job-w", rank, part, table_bytes(cols)).status_code == 200
            eventually(lambda: len(get(c, "/api/jobs/job-w")["windows"]) == 1, what="window 0")
            for rank, part, cols in parts:
                if part == 1:
                    wild = {k: v.copy() for k, v in cols.items()}
                    wild["step"][wild["step"] == 9] = 2**63 - 1
                    r = put_part(c, "job-w", rank, part, table_bytes(wild))
                    assert r.status_code == 422 and "step" in r.json()["error"], r.text
                    alone = {k: v[-3:] for k, v in wild.items()}
                    alone["step"][:] = 2**63 - 1
                    r = put_part(c, "job-w", rank, part, table_bytes(alone))
                    assert r.status_code == 422 and "step" in r.json()["error"], r.text
            for rank, part, cols in parts:
                if part >= 1:
                    assert put_part(c, "job-w", rank, part, table_bytes(cols)).status_code == 200
            wins = eventually(lambda: len(get(c, "/api/jobs/job-w")["windows"]) == 3
                              and get(c, "/api/jobs/job-w")["windows"], what="3 windows")
            assert [w["first_step"] for w in wins] == [0, 5, 10]
    finally:
        s.stop()


@pytest.mark.slow
def test_a_wild_step_in_a_job_s_first_part_is_refused_too(tmp_path):
    # with no earlier step to judge it by, 2**63-1 as the first part's step would have become
    # the job's first window and its last analysed step
    trace = slow_job(steps=10)
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            job_with_meta(c, "job-v", trace)
            rank, part, cols = parts_of(trace, 5)[0]
            wild = {k: v.copy() for k, v in cols.items()}
            wild["step"][:] = 2**63 - 1
            r = put_part(c, "job-v", rank, part, table_bytes(wild))
            assert r.status_code == 422 and "2**53-1" in r.json()["error"], r.text
    finally:
        s.stop()


@pytest.mark.slow
def test_a_part_numbered_999999_is_one_log_line_not_a_million(tmp_path, caplog):
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    s = serve(tmp_path, config=CFG.replace(gap_wait_s=0.2))
    try:
        with caplog.at_level(logging.WARNING), httpx.Client(base_url=s.url, timeout=60) as c:
            job_with_meta(c, "job-n", trace)
            rank, _, cols = parts[0]
            assert put_part(c, "job-n", rank, 0, table_bytes(cols)).status_code == 200
            later = next(p for p in parts if p[0] == rank and p[1] == 1)[2]
            assert put_part(c, "job-n", rank, 999_999, table_bytes(later)).status_code == 200
            eventually(lambda: get(c, "/api/jobs/job-n")["skipped_parts"] == 999_998,
                       what="the gap given up")
            assert c.get("/health").status_code == 200
        lines = [r for r in caplog.records if "never arrived" in r.getMessage()]
        assert 1 <= len(lines) <= 2, len(lines)
    finally:
        s.stop()


@pytest.mark.slow
def test_a_wild_part_number_does_not_hold_the_job_s_windows(tmp_path):
    # after part 999999 the rank skipped ahead to part 1,000,000: its real parts 2 and 3,
    # numbered below, never moved its frontier, and no window after them closed
    trace = slow_job(steps=20)
    parts = parts_of(trace, 5)
    wild = parts[0][0]
    s = serve(tmp_path, config=CFG.replace(gap_wait_s=0.2))
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            job_with_meta(c, "job-g", trace)
            for rank, part, cols in parts:
                if rank != wild:
                    assert put_part(c, "job-g", rank, part, table_bytes(cols)).status_code == 200
                elif part == 0:
                    assert put_part(c, "job-g", rank, 0, table_bytes(cols)).status_code == 200
                elif part == 1:
                    assert put_part(c, "job-g", rank, 999_999,
                                    table_bytes(cols)).status_code == 200
            eventually(lambda: get(c, "/api/jobs/job-g")["skipped_parts"] == 999_998,
                       what="the gap given up")
            for rank, part, cols in parts:
                if rank == wild and part >= 2:
                    assert put_part(c, "job-g", rank, part, table_bytes(cols)).status_code == 200
            wins = eventually(lambda: len(get(c, "/api/jobs/job-g")["windows"]) == 4
                              and get(c, "/api/jobs/job-g")["windows"], what="4 windows")
            assert [get(c, f"/api/jobs/job-g/windows/{w['idx']}")["missing_ranks"]
                    for w in wins] == [[], [], [], []]
    finally:
        s.stop()


# ---- connections ------------------------------------------------------------------------------

def open_stream(port: int, source: str) -> tuple[socket.socket, bytes]:
    """GET /api/events from `source`; (socket, what came until the first event or the end)."""
    k = socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(source, 0))
    k.sendall(f"GET /api/events HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
              f"{TOKEN}\r\n\r\n".encode())
    got = b""
    while b"event: change" not in got and not _refused_whole(got):
        chunk = k.recv(65536)
        if not chunk:
            break
        got += chunk
    return k, got


def _refused_whole(got: bytes) -> bool:
    """A response other than 200 has come whole (its Content-Length of body): the server may
    keep the connection open for another request, so waiting for its end would wait on that."""
    head, sep, body = got.partition(b"\r\n\r\n")
    if not sep or b" 200 " in head.split(b"\r\n", 1)[0]:
        return False
    length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
    return length is not None and len(body) >= int(length.group(1))


def ended(k: socket.socket) -> bool:
    """Whether the server ended this (chunked) stream: its last chunk came, or the socket closed."""
    k.settimeout(60)
    got = b""
    while True:
        chunk = k.recv(65536)
        got += chunk
        if not chunk or got.endswith(b"0\r\n\r\n"):
            return True


def test_one_client_cannot_take_every_event_stream(tmp_path):
    # 64 subscriber slots and no share per client: one client took them all, and every other
    # dashboard was answered 503
    s = serve(tmp_path)
    hogs = []
    try:
        for _ in range(64):
            k, got = open_stream(s.port, "127.0.0.2")
            assert b" 200 " in got.split(b"\r\n", 1)[0], got[:300]
            hogs.append(k)
        k, got = open_stream(s.port, "127.0.0.2")   # the one holding all: refused, in JSON
        head, _, body = got.partition(b"\r\n\r\n")
        assert b" 503 " in head.split(b"\r\n", 1)[0] and b"event streams" in body, got[:300]
        k.close()
        mine, got = open_stream(s.port, "127.0.0.1")   # another client: served
        assert b" 200 " in got.split(b"\r\n", 1)[0] and b"event: change" in got, got[:300]
        assert ended(hogs[0])   # the oldest stream of the client holding the most made room
        mine.close()
    finally:
        for k in hogs:
            k.close()
        s.stop()



@pytest.mark.slow
def test_a_thousand_idle_connections_do_not_lock_the_monitor(tmp_path):
    # they once answered everyone 503, and none was closed after 75 s
    s = serve(tmp_path, config=CFG.replace(header_timeout_s=2.0))
    idle = []
    try:
        for _ in range(1000):
            idle.append(socket.create_connection(("127.0.0.1", s.port), timeout=30))
        trace = slow_job(steps=5)
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            job_with_meta(c, "job-i", trace)
        idle[-1].settimeout(60)
        assert idle[-1].recv(10) == b""   # closed by the head timeout
    finally:
        for k in idle:
            k.close()
        s.stop()


@pytest.mark.slow
def test_slow_bodies_declaring_64_mib_do_not_hold_the_upload_budget(tmp_path):
    trace = slow_job(steps=5)
    s = serve(tmp_path, config=CFG.replace(max_part_bytes=64 * 2**20))
    slow = []
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            job_with_meta(c, "job-s", trace)
            for i in range(6):
                k = socket.create_connection(("127.0.0.1", s.port), timeout=30)
                k.sendall(f"PUT /api/jobs/job-s/ranks/0/parts/{100 + i} HTTP/1.1\r\n"
                          f"Host: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}\r\n"
                          f"Content-Length: {64 * 2**20}\r\n\r\nPAR1".encode())
                slow.append(k)
            time.sleep(0.5)
            rank, part, cols = parts_of(trace, 5)[0]
            r = put_part(c, "job-s", rank, part, table_bytes(cols))
            assert r.status_code == 200 and r.json()["status"] == "stored", r.text
    finally:
        for k in slow:
            k.close()
        s.stop()


def test_pages_carry_security_headers_and_refuse_other_host_names(tmp_path):
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for path in ("/", "/jobs/x", "/api/jobs"):
                h = c.get(path).headers
                assert "frame-ancestors 'none'" in h["content-security-policy"]
                assert h["x-frame-options"] == "DENY" and h["x-content-type-options"] == "nosniff"
            r = c.put("/api/jobs/j/meta", json={}, headers={**AUTH, "Host": "rebound.example"})
            assert r.status_code == 400 and "Host" in r.json()["error"]
    finally:
        s.stop()


# ---- a full disk ------------------------------------------------------------------------------

@pytest.mark.slow
def test_uploads_stop_before_the_disk_is_full_not_when_it_is(tmp_path):
    # a client needing no token (a loopback monitor) could fill the disk at the new-job rate;
    # the monitor now keeps room for the uploads it may hold at once: here more than the disk
    import shutil
    trace = slow_job(steps=5)
    rank, part, cols = parts_of(trace, 5)[0]
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            job_with_meta(c, "job-d", trace)
    finally:
        s.stop()
    beyond = CFG.replace(max_upload_bytes_held=shutil.disk_usage(tmp_path).free + 2**40)
    s = serve(tmp_path, config=beyond)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for r in (put_part(c, "job-d", rank, part, table_bytes(cols)),
                      c.put("/api/jobs/job-n/meta", json=meta_of(trace), headers=AUTH)):
                assert r.status_code == 507 and r.headers["content-type"] == "application/json"
                assert "disk" in r.json()["error"], r.text
            assert c.get("/health").status_code == 200
            assert get(c, "/api/stats")["by_way"] == {}
            assert [j["job"] for j in get(c, "/api/jobs")["jobs"]] == ["job-d"]
    finally:
        s.stop()
    s = serve(tmp_path)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert put_part(c, "job-d", rank, part, table_bytes(cols)).status_code == 200
    finally:
        s.stop()



SERVE_LIMITED = """
import resource, signal, sys
from pathlib import Path
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])   # taken by sigwait below
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails (EFBIG), no kill
limit = int(sys.argv[3])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)
s = MonitorServer(Path(sys.argv[1]), port=0, token=sys.argv[4], config=cfg).start()
print(s.port, flush=True)
signal.sigwait([signal.SIGTERM])
s.stop()
"""


@pytest.mark.slow
def test_a_part_the_disk_cannot_take_is_a_json_507_with_nothing_left_behind(tmp_path):
    # (a file-size limit stands in for a full disk: the write fails the same way, with no
    # privileges needed) — it was a plain-text 500 with two tracebacks and .tmp files left
    trace = slow_job(steps=5)
    rank, part, cols = parts_of(trace, 5)[0]
    rng = np.random.default_rng(0)
    n = 450_000
    big = {k: np.resize(v, n) for k, v in cols.items()}
    big["start_ts"] = np.sort(rng.random(n) * 100)   # in seq_id order (a part whose starts
    # go back against it is refused before the disk is tried)
    big["duration"] = rng.random(n)
    big["step"] = np.sort(rng.integers(0, 4, n)).astype(np.int64)
    big["seq_id"] = np.arange(n, dtype=np.int32)   # one row per op (two of one are refused)
    body = table_bytes(big)
    limit = 6 * 2**20
    assert len(body) > limit
    proc = subprocess.Popen([sys.executable, "-c", SERVE_LIMITED, str(tmp_path / "mon.db"),
                             "0", str(limit), TOKEN], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), proc.stderr.read()[-3000:]
        with httpx.Client(base_url=f"http://127.0.0.1:{int(line)}", timeout=60) as c:
            eventually(lambda: c.get("/health").status_code == 200, what="monitor up")
            job_with_meta(c, "job-f", trace)
            r = put_part(c, "job-f", rank, part, body)
            assert r.status_code == 507 and r.headers["content-type"] == "application/json"
            assert "disk" in r.json()["error"] and "Traceback" not in r.text
            assert c.get("/health").status_code == 200
            assert put_part(c, "job-f", rank, part, table_bytes(cols)).status_code == 200
        left = [p for p in tmp_path.rglob("*") if p.name.endswith(".tmp")]
        assert not left, left
        # and what a killed service left behind goes at the next start
        stale = tmp_path / "mon.db.uploads" / "job-f" / "rank-00000.part-000001.parquet.9.ab.tmp"
        stale.write_bytes(b"half")
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    assert err.count("Traceback") <= 1, err[-3000:]
    MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start().stop()
    assert not stale.exists()
