"""Uploads over HTTP: idempotent parts, the same analysis as watched files, hostile input refused."""

from __future__ import annotations

import io
import re
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, rank_of, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.columns import columns_to_table
from stragglers.trace.runformat import table_bytes

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, max_part_bytes=256 * 1024)


def parquet_bytes(cols, codec: str | None = None) -> bytes:
    """A part as the recorder uploads it, or written with another Parquet codec."""
    if codec is None:
        return table_bytes(cols)
    buf = io.BytesIO()
    pq.write_table(columns_to_table(cols), buf, compression=codec)
    return buf.getvalue()


@pytest.fixture
def server(tmp_path):
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    yield s
    s.stop()


def put_meta(c, job, trace, headers=AUTH):
    return c.put(f"/api/jobs/{job}/meta", json=trace.meta.to_dict(), headers=headers)


def test_uploaded_parts_are_stored_once_land_in_the_run_format_and_are_analysed(server):
    trace = slow_job(steps=10, slow=(0, 1, 3.0))
    parts = parts_of(trace, steps_per_part=5)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert put_meta(c, "job-h", trace).status_code == 200
        # some as recorders before the LZ4 run format wrote them: any codec is taken
        bodies = [parquet_bytes(cols, "zstd" if i % 2 else None)
                  for i, (_, _, cols) in enumerate(parts)]
        for (rank, part, _), body in reversed(list(zip(parts, bodies))):   # out of order
            r = c.put(f"/api/jobs/job-h/ranks/{rank}/parts/{part}", content=body,
                      headers={**AUTH, "X-Stragglers-Dropped": "2"})
            assert r.status_code == 200 and r.json()["status"] == "stored", r.text
        rank, part, cols = parts[0]
        again = c.put(f"/api/jobs/job-h/ranks/{rank}/parts/{part}", content=bodies[0],
                      headers=AUTH)
        assert again.json() == {"status": "duplicate"}
        wins = eventually(lambda: len(get(c, "/api/jobs/job-h")["windows"]) == 2
                          and get(c, "/api/jobs/job-h"), what="2 windows")
        assert (wins["windows_total"], wins["first_window"]) == (2, 0)
        recent = get(c, "/api/jobs/job-h?history=1")      # the last window only; the first
        assert [w["idx"] for w in recent["windows"]] == [1] and recent["windows_total"] == 2
        assert get(c, "/api/jobs/job-h/windows/0")["idx"] == 0   # still there by index
        for bad in ("0", "100001", "x"):
            assert c.get(f"/api/jobs/job-h?history={bad}").status_code == 422
        hot = max(wins["window"]["scores"], key=lambda s: s["score"])
        assert hot["rank"] == rank_of(trace, 0, 1)
        assert wins["upload_dropped"] == {str(r): 2 for r in range(4)}
        assert get(c, "/api/stats")["by_way"]["http"] == {"parts": len(parts),
                                                          "records": len(trace)}
    run = server.monitor.data_dir / "job-h"
    from stragglers.trace.runformat import read_run
    back = read_run(run)                                   # the run format, readable as is
    assert len(back) == len(trace) and back.meta.dp_size == 2


@pytest.mark.slow
def test_hostile_requests_get_a_4xx_naming_the_problem_and_change_nothing(server, tmp_path):
    trace = slow_job(steps=10)
    rank, part, cols = parts_of(trace, steps_per_part=5)[0]
    good = parquet_bytes(cols)
    url = f"/api/jobs/job-x/ranks/{rank}/parts/{part}"
    with httpx.Client(base_url=server.url, timeout=60) as c:
        # no token, wrong token
        r = put_meta(c, "job-x", trace, headers={})
        assert r.status_code == 401 and "Authorization" in r.json()["error"]
        r = put_meta(c, "job-x", trace, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        # unknown job
        r = c.put(url, content=good, headers=AUTH)
        assert r.status_code == 404 and "unknown job 'job-x'" in r.json()["error"]
        # bad JSON, wrong types, unknown fields, inconsistent sizes
        r = c.put("/api/jobs/job-x/meta", content=b"{not json", headers=AUTH)
        assert r.status_code == 422 and "request body" in r.json()["error"]
        bad = {**trace.meta.to_dict(), "dp_size": "two"}
        r = c.put("/api/jobs/job-x/meta", json=bad, headers=AUTH)
        assert r.status_code == 422 and "dp_size" in r.json()["error"]
        r = c.put("/api/jobs/job-x/meta", json={**trace.meta.to_dict(), "colour": 1},
                  headers=AUTH)
        assert r.status_code == 422 and "colour" in r.json()["error"]
        r = c.put("/api/jobs/job-x/meta", json={**trace.meta.to_dict(), "world_size": 5},
                  headers=AUTH)
        # (named as the request body's field: the server's own paths are not the client's)
        assert r.status_code == 422 and r.json()["error"].startswith(
            "request body: field 'world_size'"), r.json()
        # path tricks in the job name (a %2F makes a path no route matches: 404, in the API's
        # own error format)
        for name in ("..", ".hidden", "a..b", "a%2Fb", "x" * 200, "..%2F..%2Fetc"):
            r = c.put(f"/api/jobs/{name}/meta", json=trace.meta.to_dict(), headers=AUTH)
            assert 400 <= r.status_code < 500, (name, r.status_code)
            assert "error" in r.json(), (name, r.json())
        assert get(c, "/api/jobs")["jobs"] == []
        assert put_meta(c, "job-x", trace).status_code == 200
        # parts: not Parquet, wrong columns, another rank's rows, rank out of range, huge body
        r = c.put(url, content=b"PAR1 garbage", headers=AUTH)
        assert r.status_code == 422 and "not a readable Parquet file" in r.json()["error"]
        wrong = io.BytesIO()
        pq.write_table(pa.table({"rank": [rank], "step": [0]}), wrong)
        r = c.put(url, content=wrong.getvalue(), headers=AUTH)
        assert r.status_code == 422 and "missing column" in r.json()["error"]
        other = parts_of(trace, 5)[1]
        r = c.put(url.replace(f"/ranks/{rank}/", f"/ranks/{other[0]}/"), content=good,
                  headers=AUTH)
        assert r.status_code == 422 and "rank" in r.json()["error"]
        r = c.put("/api/jobs/job-x/ranks/99/parts/0", content=good, headers=AUTH)
        assert r.status_code == 422 and "world size 4" in r.json()["error"]
        r = c.put("/api/jobs/job-x/ranks/-1/parts/0", content=good, headers=AUTH)
        assert r.status_code == 422 and "rank" in r.json()["error"]
        r = c.put(url, content=b"\0" * (CFG.max_part_bytes + 1), headers=AUTH)
        assert r.status_code == 413 and str(CFG.max_part_bytes) in r.json()["error"]

        def chunked():
            for _ in range(CFG.max_part_bytes // 65536 + 2):
                yield b"\0" * 65536

        r = c.put(url, content=chunked(), headers=AUTH)       # no Content-Length: still capped
        assert r.status_code == 413
        r = c.put(url, content=good)                           # no token
        assert r.status_code == 401
        # a drop count past SQLite's integers, or not a count, in the uploader's header
        for count in ("9" * 25, "-1", "two", "१२".encode()):
            r = c.put(url, content=good, headers={**AUTH, "X-Stragglers-Dropped": count})
            assert r.status_code == 422 and "X-Stragglers-Dropped" in r.json()["error"], r.text
        # window indices: negative, past any window, past SQLite's integers, not a number
        for path in ("/api/jobs/job-x/windows/-1", "/api/jobs/job-x/windows/" + "9" * 25,
                     "/api/jobs/job-x?window=-1", "/api/jobs/job-x?window=" + "9" * 25,
                     "/api/jobs/job-x/windows/abc"):
            r = c.get(path)
            assert r.status_code == 422 and ("'idx'" in r.json()["error"]
                                             or "'window'" in r.json()["error"]), (path, r.text)
        r = c.get("/api/jobs/job-x/windows/7")
        assert r.status_code == 404 and "no window 7" in r.json()["error"]
        # nothing of all that was stored or written
        assert get(c, "/api/stats")["by_way"] == {}
        files = sorted(p.name for p in (server.monitor.data_dir / "job-x").iterdir())
        assert files == ["meta.json"]
        # rows at a stage or DP rank the job does not have (pp 2, dp 2)
        for column in ("stage", "dp_rank"):
            moved = {k: v.copy() for k, v in cols.items()}
            moved[column][:] = 2
            r = c.put(url, content=parquet_bytes(moved), headers=AUTH)
            assert r.status_code == 422 and f"'{column}'" in r.json()["error"], r.text
            assert "expected < 2" in r.json()["error"]
        assert get(c, "/api/stats")["by_way"] == {}
        assert c.put(url, content=good, headers=AUTH).json()["status"] == "stored"
        # the same number again: the same bytes are a retry, other bytes a conflict (409) that
        # replaces nothing (a restarted job numbering its parts from 0 again)
        assert c.put(url, content=good, headers=AUTH).json()["status"] == "duplicate"
        later = {k: v.copy() for k, v in cols.items()}
        later["duration"] = later["duration"] * 2
        r = c.put(url, content=parquet_bytes(later), headers=AUTH)
        assert r.status_code == 409 and "different content" in r.json()["error"], r.text
        stored = sorted((server.monitor.data_dir / "job-x").glob("rank-*"))
        assert len(stored) == 1 and stored[0].read_bytes() == good
        assert get(c, "/api/stats")["by_way"]["http"]["parts"] == 1
        text = c.get("/metrics").text
        for reason in ("unauthorized", "unknown_job", "bad_part", "too_large", "bad_rank",
                       "conflict"):
            assert f'stragglers_ingest_rejected_total{{reason="{reason}"}}' in text


@pytest.mark.slow
def test_private_mode_guards_reads(tmp_path):
    s = MonitorServer(tmp_path / "p.db", port=0, token=TOKEN, private=True, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=30) as c:
            assert c.get("/api/jobs").status_code == 401
            assert c.get("/metrics").status_code == 401
            assert c.get("/api/jobs", headers=AUTH).status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        s.stop()


def test_the_event_stream_tells_a_page_when_something_is_stored_and_ends_at_shutdown(tmp_path):
    s = MonitorServer(tmp_path / "ev.db", port=0, token=TOKEN, config=CFG).start()
    trace = slow_job(steps=5, slow=(0, 1, 3.0))
    events = []
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c, \
                c.stream("GET", "/api/events") as stream:
            assert stream.status_code == 200
            assert stream.headers["content-type"].startswith("text/event-stream")
            lines = stream.iter_lines()

            def next_version():
                for line in lines:
                    if line.startswith("data: "):
                        return int(line.split('"version": ')[1].rstrip("}"))
            events.append(next_version())              # where the store stands now
            assert put_meta(c, "job-e", trace).status_code == 200   # a write: the job row
            events.append(next_version())
            assert events[1] > events[0]
            rank, part, cols = parts_of(trace, steps_per_part=5)[0]
            assert c.put(f"/api/jobs/job-e/ranks/{rank}/parts/{part}",
                         content=parquet_bytes(cols), headers=AUTH).status_code == 200
            events.append(next_version())
            assert events[2] > events[1] and events[2] <= s.store.version
            s.stop()   # with the stream open: the feed ends it, the body completes cleanly
            assert not s._thread.is_alive()
            rest = list(lines)   # ends without a protocol error: the body was completed
            assert not any(line.startswith("data:") for line in rest)
    finally:
        s.stop()


def test_one_part_number_raced_with_two_contents_keeps_one_and_refuses_the_other(server):
    trace = slow_job(steps=10)
    rank, part, cols = parts_of(trace, steps_per_part=5)[0]
    other = {k: v.copy() for k, v in cols.items()}
    other["duration"] = other["duration"] * 3
    bodies = [parquet_bytes(cols), parquet_bytes(other)] * 4
    url = f"/api/jobs/race/ranks/{rank}/parts/{part}"
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert put_meta(c, "race", trace).status_code == 200

        def send(body):
            with httpx.Client(base_url=server.url, timeout=60) as own:
                r = own.put(url, content=body, headers=AUTH)
                return body, r.status_code, (r.json().get("status") if r.status_code == 200
                                             else r.json()["error"])

        with ThreadPoolExecutor(len(bodies)) as pool:
            replies = list(pool.map(send, bodies))
        stored = [body for body, code, what in replies if what == "stored"]
        assert len(stored) == 1, replies
        for body, code, what in replies:
            if body == stored[0]:
                assert what in ("stored", "duplicate"), what
            else:
                assert code == 409 and "different content" in what, what
        files = sorted((server.monitor.data_dir / "race").glob("rank-*"))
        assert len(files) == 1 and files[0].read_bytes() == stored[0]


def test_a_store_from_before_fingerprints_opens_and_takes_parts(tmp_path):
    import sqlite3

    from stragglers.monitor.store import Store

    db = sqlite3.connect(tmp_path / "old.db")
    db.execute("CREATE TABLE parts (job TEXT NOT NULL, rank INTEGER NOT NULL, part INTEGER NOT "
               "NULL, records INTEGER NOT NULL, first_step INTEGER NOT NULL, last_step INTEGER "
               "NOT NULL, bytes INTEGER NOT NULL, way TEXT NOT NULL, ingested_at REAL NOT NULL, "
               "PRIMARY KEY (job, rank, part)) WITHOUT ROWID")
    db.execute("INSERT INTO parts VALUES ('j', 0, 0, 5, 0, 4, 100, 'http', 1.0)")
    db.commit()
    db.close()
    store = Store(tmp_path / "old.db")
    try:
        assert store.part_digest("j", 0, 0) is None          # stored before: not known
        store.register_job("j", str(tmp_path / "j"), "http", None)
        assert store.add_parts([("j", 0, 1, 5, 5, 9, 100, "http", "abc")]) == [True]
        assert store.part_digest("j", 0, 1) == "abc"
    finally:
        store.close()


@pytest.mark.slow
def test_the_upload_fast_path_answers_every_request_as_the_route_does(tmp_path):
    # Two real servers: the app as served (uploads take the fast path in front of FastAPI) and
    # the FastAPI app alone (every upload through its route). The same requests, in the same
    # order, must get the same status and body from both, and store the same parts.
    trace = slow_job(steps=10)
    parts = parts_of(trace, steps_per_part=5)
    rank, part, cols = parts[0]
    good = parquet_bytes(cols)
    wrong = io.BytesIO()
    pq.write_table(pa.table({"rank": [rank], "step": [0]}), wrong)
    requests = [
        ("unknown job", f"/api/jobs/job-f/ranks/{rank}/parts/{part}", good, AUTH),
        ("meta", "/api/jobs/job-f/meta", None, AUTH),
        ("no token", f"/api/jobs/job-f/ranks/{rank}/parts/{part}", good, {}),
        ("wrong token", f"/api/jobs/job-f/ranks/{rank}/parts/{part}", good,
         {"Authorization": "Bearer nope"}),
        ("not parquet", f"/api/jobs/job-f/ranks/{rank}/parts/{part}", b"PAR1 junk", AUTH),
        ("wrong columns", f"/api/jobs/job-f/ranks/{rank}/parts/{part}", wrong.getvalue(), AUTH),
        ("rank outside", "/api/jobs/job-f/ranks/99/parts/0", good, AUTH),
        ("rank too big", "/api/jobs/job-f/ranks/99999999999/parts/0", good, AUTH),
        ("part not a number", f"/api/jobs/job-f/ranks/{rank}/parts/x1", good, AUTH),
        ("leading zeros", f"/api/jobs/job-f/ranks/{rank}/parts/000{part}", good, AUTH),
        ("duplicate", f"/api/jobs/job-f/ranks/{rank}/parts/{part}", good, AUTH),
        ("other bytes", f"/api/jobs/job-f/ranks/{rank}/parts/{part}", parquet_bytes(
            parts[2][2]), AUTH),
        ("bad job name", f"/api/jobs/a..b/ranks/{rank}/parts/{part}", good, AUTH),
        ("too large", f"/api/jobs/job-f/ranks/{rank}/parts/7", b"x" * (300 * 1024), AUTH),
    ]
    answers = []
    for fast in (True, False):
        s = MonitorServer(tmp_path / f"mon-{fast}.db", port=0, token=TOKEN, config=CFG)
        assert type(s.app).__name__ == "UploadFastPath"
        if not fast:
            s.app = s.app.app          # the FastAPI app alone
        s.start()
        try:
            got = []
            with httpx.Client(base_url=s.url, timeout=60) as c:
                for what, url, body, headers in requests:
                    r = put_meta(c, "job-f", trace, headers) if body is None else \
                        c.put(url, content=body, headers=headers)
                    got.append((what, r.status_code, r.json()))
                got.append(("stored", get(c, "/api/stats")["by_way"]))
            answers.append(got)
        finally:
            s.stop()
    for fast, plain in zip(*answers):
        assert fast == plain
    statuses = {a[0]: a[1] for a in answers[0][:-1]}
    assert statuses == {"unknown job": 404, "meta": 200, "no token": 401, "wrong token": 401,
                        "not parquet": 422, "wrong columns": 422, "rank outside": 422,
                        "rank too big": 422, "part not a number": 422, "leading zeros": 422,
                        "duplicate": 200, "other bytes": 409, "bad job name": 422,
                        "too large": 413}


@pytest.mark.slow
def test_bad_values_in_an_upload_are_refused_before_the_reply(server):
    # Values a Parquet footer cannot vouch for (NaN — min/max leave it out —, unknown op type
    # names) are refused before the part is acknowledged, naming the column, and nothing is
    # stored; a part written without statistics is stored and analysed like the others.
    import numpy as np

    trace = slow_job(steps=10)
    parts = parts_of(trace, steps_per_part=5)
    rank, part, cols = parts[0]
    n = len(cols["step"])

    def with_(name, values):
        return parquet_bytes({**cols, name: values})

    nan_start = with_("start_ts", np.where(np.arange(n) == 2, np.nan, cols["start_ts"]))
    nan_dur = with_("duration", np.where(np.arange(n) == n - 1, np.nan, cols["duration"]))
    table = columns_to_table(cols)
    names = pa.array(["forward-compute"] * (n - 1) + ["warp-drive"])
    unknown = io.BytesIO()
    pq.write_table(table.set_column(table.schema.get_field_index("optype"), "optype", names),
                   unknown)
    no_stats = io.BytesIO()
    pq.write_table(table, no_stats, write_statistics=False)
    url = f"/api/jobs/job-v/ranks/{rank}/parts/{part}"
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert put_meta(c, "job-v", trace).status_code == 200
        for body, column, words in ((nan_start, "start_ts", "NaN"), (nan_dur, "duration", "NaN"),
                                    (unknown.getvalue(), "optype", "warp-drive")):
            r = c.put(url, content=body, headers=AUTH)
            error = r.json()["error"]
            assert r.status_code == 422 and f"field '{column}'" in error and words in error, error
        assert get(c, "/api/stats")["by_way"].get("http", {}).get("parts", 0) == 0
        assert not list((server.monitor.data_dir / "job-v").glob("rank-*.parquet"))
        r = c.put(url, content=no_stats.getvalue(), headers=AUTH)
        assert r.status_code == 200 and r.json() == {"status": "stored", "records": n}, r.text
        for rk, pt, cs in parts[1:]:
            r = c.put(f"/api/jobs/job-v/ranks/{rk}/parts/{pt}", content=parquet_bytes(cs),
                      headers=AUTH)
            assert r.status_code == 200 and r.json()["status"] == "stored", r.text
        # the parts taken by their footers are analysed like the others: both windows, every
        # rank present, every record counted once
        job = eventually(lambda: len(get(c, "/api/jobs/job-v")["windows"]) == 2
                         and get(c, "/api/jobs/job-v"), what="2 windows")
        for w in job["windows"]:
            full = get(c, f"/api/jobs/job-v/windows/{w['idx']}")
            assert full["missing_ranks"] == [] and full["error"] is None, full
        assert get(c, "/api/stats")["by_way"]["http"] == {"parts": len(parts),
                                                          "records": len(trace)}


def refused_before_its_body(port: int, path: str, length: int) -> bool:
    """Whether an upload declaring `length` bytes is answered 503 before its body is read; it
    sends none (Expect: 100-continue, and hangs up on 100 Continue), so it holds no budget."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as k:
        k.sendall(f"PUT {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {TOKEN}"
                  f"\r\nContent-Length: {length}\r\nExpect: 100-continue\r\n\r\n".encode())
        got = b""
        while b"\r\n" not in got:
            chunk = k.recv(100)
            assert chunk, got
            got += chunk
    return got.startswith(b"HTTP/1.1 503 ")


@pytest.mark.slow
def test_a_flood_of_uploads_holds_at_most_the_budget_and_is_stored_on_retry(tmp_path):
    # One upload is held open half-sent: it holds the bytes it sent (not the ones it declared:
    # four slow bodies declaring 64 MiB once held the whole budget). A second whose
    # Content-Length does not fit in what is left of max_upload_bytes_held gets 503 naming the
    # budget and changes nothing, as does one sent chunked once its bytes do not fit; a small
    # one still fits; once the first is stored, the second's retry is stored too.
    import threading

    trace = slow_job(steps=10)
    parts = parts_of(trace, steps_per_part=5)
    (r0, p0, c0), (r1, p1, c1) = parts[0], parts[1]
    first = parquet_bytes(c0)
    half = len(first) // 2
    limit = len(first) + 1024     # the first fits; the first and the second do not
    second = b"\0" * (limit - half + 1)
    # (a body is cut for slowness after a 10 s grace: at 1 byte/s the half-sent one is not,
    # however long a loaded machine takes to get to the release)
    cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05,
                        max_part_bytes=256 * 1024, max_upload_bytes_held=limit,
                        body_min_bytes_per_s=1.0)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=cfg).start()
    release = threading.Event()
    got = {}

    def slow_body():
        yield first[:half]
        release.wait(60)
        yield first[half:]

    def send_first():
        with httpx.Client(base_url=s.url, timeout=60) as c:
            got["first"] = c.put(f"/api/jobs/job-b/ranks/{r0}/parts/{p0}", content=slow_body(),
                                 headers={**AUTH, "Content-Length": str(len(first))})

    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert put_meta(c, "job-b", trace).status_code == 200
            t = threading.Thread(target=send_first)
            t.start()
            # wait until the first upload's first chunk is counted, asking with a head alone:
            # a probe that sent its body held it while the first's chunk came in (a loaded
            # machine), and the first was refused 503 for it, every probe after read (422)
            eventually(lambda: refused_before_its_body(s.port, f"/api/jobs/job-b/ranks/{r1}/"
                                                       f"parts/{p1}", len(second)),
                       what="budget taken")
            r = c.put(f"/api/jobs/job-b/ranks/{r1}/parts/{p1}", content=second, headers=AUTH)
            assert r.status_code == 503 and f"at most {limit}" in r.json()["error"], r.text
            # sent without a Content-Length (chunked): refused once its bytes do not fit
            r = c.put(f"/api/jobs/job-b/ranks/{r1}/parts/{p1}", content=iter([second]),
                      headers=AUTH)
            assert r.status_code == 503, r.text
            # what fits beside the half-sent body is read (and refused for what it is)
            r = c.put(f"/api/jobs/job-b/ranks/{r1}/parts/{p1}", content=b"\0" * 100,
                      headers=AUTH)
            assert r.status_code == 422 and "not a readable Parquet" in r.text, r.text
            assert get(c, "/api/stats")["by_way"] == {}
            release.set()
            t.join(60)
            assert got["first"].status_code == 200, got["first"].text
            r = c.put(f"/api/jobs/job-b/ranks/{r1}/parts/{p1}", content=parquet_bytes(c1),
                      headers=AUTH)
            assert r.status_code == 200 and r.json()["status"] == "stored", r.text
    finally:
        release.set()
        s.stop()


def test_a_part_of_more_rows_than_a_part_may_hold_is_refused_before_it_is_decoded(server):
    # 1,000,001 identical rows compress to a few kB of Parquet but decode to ~60 MB: the row
    # count in the footer refuses it first (parts.MAX_PART_ROWS).
    import numpy as np

    from stragglers.monitor.parts import MAX_PART_ROWS

    trace = slow_job(steps=10)
    rank, part, cols = parts_of(trace, steps_per_part=5)[0]
    n = MAX_PART_ROWS + 1
    big = {k: np.repeat(v[:1], n) for k, v in cols.items()}
    body = parquet_bytes(big)
    assert len(body) < 200 * 1024
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert put_meta(c, "job-r", trace).status_code == 200
        r = c.put(f"/api/jobs/job-r/ranks/{rank}/parts/{part}", content=body, headers=AUTH)
        # (refused by the footer screen's row budget, before pyarrow parses the footer)
        assert r.status_code == 422 and f"declares {n} rows" in r.json()["error"], r.text
        assert get(c, "/api/stats")["by_way"] == {}


def test_idle_connections_past_the_limit_get_503_and_a_hang_up_mid_body_is_one_line(tmp_path,
                                                                                   caplog):
    # Connections that send a request head and then nothing hold the server's slots: past
    # max_connections new requests are answered 503 (not left to exhaust file descriptors);
    # when the clients hang up, each half-read body is one refusal ("client_gone") in the
    # stats and the log, with no traceback, and the service answers again.
    import logging
    import socket

    cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, max_connections=8)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=cfg).start()
    held = []
    try:
        with caplog.at_level(logging.WARNING), httpx.Client(base_url=s.url, timeout=30) as c:
            for _ in range(12):
                k = socket.create_connection(("127.0.0.1", s.port))
                k.sendall(b"PUT /api/jobs/x/meta HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
                          + TOKEN.encode() + b"\r\nContent-Length: 100\r\n\r\n{")
                held.append(k)
            eventually(lambda: c.get("/health").status_code == 503, what="503 past the limit")
            for k in held:
                k.close()
            eventually(lambda: c.get("/health").status_code == 200, what="served again")
            gone = eventually(lambda: [r for r in get(c, "/api/stats")["rejects"]
                                       if r["reason"] == "client_gone"], what="hang-ups counted")
            # (the server reads the 1 byte sent if it reaches the body before the hang-up; on
            # a loaded machine uvicorn may see the hang-up first and drop the byte unread)
            for r in gone:
                assert re.fullmatch(r"request body: the client hung up after [01] bytes of "
                                    r"meta\.json", r["problem"]), r
        assert not [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    finally:
        for k in held:
            k.close()
        s.stop()


def test_serving_beyond_loopback_needs_a_token(tmp_path):
    # Loopback by default; an address other machines reach is refused without a token (one
    # line naming --host), as the shard service does.
    from stragglers.errors import InputError

    with pytest.raises(InputError, match="--host: 0.0.0.0 is reachable from other machines"):
        MonitorServer(tmp_path / "mon.db", host="0.0.0.0", port=0, config=CFG)
    s = MonitorServer(tmp_path / "mon.db", host="127.0.0.1", port=0, config=CFG).start()
    s.stop()


@pytest.mark.slow
def test_a_store_that_is_not_a_database_is_one_line_exit_2(tmp_path):
    import subprocess
    import sys

    junk = tmp_path / "junk.db"
    junk.write_text("not a database\n")
    for cmd in (["monitor", "serve"], ["adapt", "serve"]):
        r = subprocess.run([sys.executable, "-m", "stragglers.cli", *cmd, "--db", str(junk),
                            "--port", "0"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2, (cmd, r.stderr)
        assert "not a usable SQLite database" in r.stderr and "Traceback" not in r.stderr
        assert "internal error" not in r.stderr


@pytest.mark.slow
def test_token_files_and_hosts_are_checked_alike_by_both_services(tmp_path):
    # one token reader and one host check for the monitor and the shard service (each had its
    # own: a 5-character token was taken, a non-UTF-8 file was an internal error, and an
    # address that does not resolve was called "reachable from other machines")
    import subprocess
    import sys

    good, short, binary = tmp_path / "good", tmp_path / "short", tmp_path / "binary"
    good.write_text("a-token-of-20-chars\n")
    short.write_text("short\n")
    binary.write_bytes(b"\xff\xfe" + b"a" * 20)
    for f in (good, short, binary):
        f.chmod(0o600)
    cases = [(["--token-file", str(short)], "short: --token-file: expected one line of 16-512"),
             (["--token-file", str(binary)], "binary: --token-file: expected one line of 16-512"),
             (["--token-file", str(tmp_path / "none")], "none: --token-file: "),
             (["--token-file", str(good), "--host", "999.1.1.1"],
              "--host: '999.1.1.1' is not an address or a host name this machine can resolve")]
    for cmd in (["monitor", "serve"], ["adapt", "serve"]):
        for args, words in cases:
            r = subprocess.run([sys.executable, "-m", "stragglers.cli", *cmd, "--db",
                                str(tmp_path / "s.db"), "--port", "0", *args],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 2 and words in r.stderr, (cmd, args, r.stderr)
            assert "internal error" not in r.stderr and "Traceback" not in r.stderr


def test_urls_of_ipv6_and_wildcard_hosts():
    from stragglers.serving import base_url

    assert base_url("::1", 8150) == "http://[::1]:8150"
    assert base_url("0.0.0.0", 1) == "http://127.0.0.1:1"
    assert base_url("127.0.0.1", 2) == "http://127.0.0.1:2"


@pytest.mark.slow
def test_a_data_dir_that_cannot_be_written_is_refused_at_start(tmp_path):
    # it was taken, and the first upload of a job would have failed instead
    import subprocess
    import sys

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    r = subprocess.run([sys.executable, "-m", "stragglers.cli", "monitor", "serve", "--db",
                        str(tmp_path / "m.db"), "--port", "0", "--data-dir", str(blocker / "up")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "--data-dir: uploads cannot be written there (Not a directory)" in r.stderr
    assert "stragglers monitor on" not in r.stdout and "Traceback" not in r.stderr


def test_a_meta_json_that_cannot_be_written_registers_nothing(tmp_path, monkeypatch):
    # put_meta registered the job, then wrote meta.json: a full disk answered 507 with the job's
    # row stored; now the file is written first, and a job the monitor refuses (max_jobs) leaves
    # no folder behind
    import errno

    from stragglers.monitor import ingest_http
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN,
                      config=CFG.replace(max_jobs=1)).start()
    trace = slow_job(steps=4)
    real = ingest_http._replace_file

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            monkeypatch.setattr(ingest_http, "_replace_file", full)
            r = put_meta(c, "full", trace)
            assert r.status_code == 507, r.text
            assert s.store.job("full") is None and "full" not in s.monitor.directories
            assert not (s.monitor.data_dir / "full").exists()
            monkeypatch.setattr(ingest_http, "_replace_file", real)
            assert put_meta(c, "full", trace).status_code == 200   # the retry, once there is room
            assert s.store.job("full") is not None
            r = put_meta(c, "second", trace)   # one job at most: refused after its write
            assert r.status_code == 409, r.text
            assert s.store.job("second") is None
            assert not (s.monitor.data_dir / "second").exists()
    finally:
        s.stop()
