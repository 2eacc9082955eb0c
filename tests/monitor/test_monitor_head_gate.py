"""A request is judged from its head — token, job, sizes — before `100 Continue` is sent or any
of its body is read (the serving layer's head gate), and a refused new job gives its place in
new_jobs_per_minute back; a real monitor on loopback, raw sockets."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import continued_write, head_only
from monitor_jobs import slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig

TOKEN = "head-gate-test-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600)

# every write route of the monitor, with the job the fixture makes
WRITES = ["/api/jobs/j/meta", "/api/jobs/j/ranks/0/parts/0"]


@pytest.fixture(scope="module")
def mon(tmp_path_factory):
    s = MonitorServer(tmp_path_factory.mktemp("head-gate") / "mon.db", port=0, token=TOKEN,
                      config=CFG).start()
    try:
        r = httpx.put(s.url + "/api/jobs/j/meta", json=slow_job(steps=5).meta.to_dict(),
                      headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        yield s
    finally:
        s.stop()


def status_and_body(raw: bytes) -> tuple[int, dict]:
    """A refusal's status and JSON body; it closes the connection (its body was not read: read
    as the next request's head it would desynchronise the connection)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    assert b"\r\nconnection: close\r\n" in head.lower(), head
    return int(head.split()[1]), json.loads(body)


def test_every_write_route_is_listed_here(mon):
    # a route added later without its head checks would otherwise escape the tests below
    paths = {r.path.replace("{job}", "j").replace("{rank}", "0").replace("{part}", "0")
             for r in mon.app.app.routes
             if {"PUT", "POST", "PATCH", "DELETE"} & set(getattr(r, "methods", None) or ())}
    assert paths == set(WRITES)


@pytest.mark.parametrize("path", WRITES)
@pytest.mark.parametrize("auth", [None, "Bearer wrong-token-0123456789", f"Basic {TOKEN}"])
def test_a_write_without_the_token_is_refused_from_its_head(mon, path, auth):
    got, reply = status_and_body(head_only(mon.port, "PUT", path, auth, 2 << 20))
    assert got == 401, reply
    assert set(reply) == {"error"} and "Authorization" in reply["error"], reply


@pytest.mark.parametrize("path,status", [
    ("/api/jobs/j/meta", 413),                 # over max_meta_bytes + 1 KiB a rank possible
    ("/api/jobs/j/ranks/0/parts/0", 413),      # over max_part_bytes
    ("/api/jobs/nope/ranks/0/parts/0", 404),   # no such job
    ("/api/jobs/j/ranks/99/parts/0", 422),     # no such rank
])
def test_a_write_the_head_refuses_is_answered_before_its_body(mon, path, status):
    # (fails before for 404 and 422: answered from the head but the connection kept open, its
    # unread body next in line as the following request)
    # (a meta.json may hold 64 KiB + 1 KiB per rank of the world; 65,536 ranks at most)
    length = 128 << 20
    got, reply = status_and_body(head_only(mon.port, "PUT", path, f"Bearer {TOKEN}", length))
    assert got == status, reply
    assert "error" in reply, reply


@pytest.mark.parametrize("path,ctype", [
    ("/api/jobs/j/meta", "text/plain"),
    ("/api/jobs/j/meta", "application/x-www-form-urlencoded"),
    ("/api/jobs/j/meta", "multipart/form-data; boundary=x"),
    ("/api/jobs/j/meta", "application/json; charset=latin-1"),
    ("/api/jobs/j/meta", "application/vnd.apache.parquet"),
    ("/api/jobs/j/ranks/0/parts/0", "application/json"),
    ("/api/jobs/j/ranks/0/parts/0", "text/plain; charset=utf-8"),
    ("/api/jobs/j/ranks/0/parts/0", "application/x-www-form-urlencoded"),
    ("/api/jobs/j/ranks/0/parts/0", ""),
])
def test_a_write_declaring_another_media_type_is_415_from_its_head(mon, path, ctype):
    # (fails before: any declared type was taken, a form or text body read as JSON or Parquet)
    got, reply = status_and_body(head_only(mon.port, "PUT", path, f"Bearer {TOKEN}", 1000,
                                           f"Content-Type: {ctype}\r\n"))
    assert got == 415, reply
    assert "Content-Type" in reply["error"], reply


@pytest.mark.parametrize("path", ["/api/jobs/j/meta", "/api/jobs/j/ranks/0/parts/0"])
@pytest.mark.parametrize("coding", ["gzip", "deflate, identity", "br"])
def test_a_write_in_a_content_coding_is_415_from_its_head(mon, path, coding):
    # (fails before: the coding was ignored, a body declared gzip read as it came)
    got, reply = status_and_body(head_only(mon.port, "PUT", path, f"Bearer {TOKEN}", 1000,
                                           f"Content-Encoding: {coding}\r\n"))
    assert got == 415, reply
    assert "Content-Encoding" in reply["error"], reply


def test_a_write_declaring_its_type_or_none_is_taken(mon):
    from monitor_jobs import parts_of
    from test_monitor_http import parquet_bytes
    trace = slow_job(steps=15)
    meta = json.dumps(trace.meta.to_dict()).encode()
    tables = [t for rank, _, t in parts_of(trace, 5) if rank == 0]
    with httpx.Client(base_url=mon.url, timeout=60, headers=AUTH) as c:
        for ctype in ("application/json", "Application/JSON; charset=UTF-8", None):
            headers = {"Content-Type": ctype} if ctype else {}
            r = c.put("/api/jobs/j/meta", content=meta, headers=headers)
            assert r.status_code == 200, (ctype, r.text)
        for n, ctype in enumerate(("application/vnd.apache.parquet",
                                   "application/octet-stream", None)):
            headers = {"Content-Type": ctype} if ctype else {}
            r = c.put(f"/api/jobs/j/ranks/0/parts/{n}", content=parquet_bytes(tables[n]),
                      headers=headers)
            assert r.status_code == 200 and r.json()["status"] in ("stored", "duplicate"), \
                (ctype, r.text)


@pytest.mark.parametrize("method,path", [
    ("GET", "/api/jobs/"), ("GET", "/api/alerts/?limit=5"), ("GET", "/api/jobs/j/"),
    ("PUT", "/api/jobs/j/meta/"), ("PUT", "/api/jobs/j/ranks/0/parts/0/"), ("GET", "/metrics/"),
])
def test_a_path_with_a_trailing_slash_is_a_json_404_not_a_redirect(mon, method, path):
    # (fails before: 307 with an empty body and a Location built from the client's Host,
    # answered to a write without its token too)
    got, reply = status_and_body(head_only(mon.port, method, path, None, 1000)) \
        if method == "PUT" else (None, None)
    if method == "GET":
        r = httpx.get(mon.url + path, timeout=60, follow_redirects=False)
        got, reply = r.status_code, r.json()
    assert got in (401, 404), (got, reply)
    assert "error" in reply, reply


@pytest.mark.parametrize("path", ["/api/events", "/", "/api/jobs", "/static/style.css"])
def test_a_read_declaring_a_body_is_refused_from_its_head(mon, path):
    # (fails before: the event stream and the dashboard's files listen for the client's
    # hang-up by reading: uvicorn said 100 Continue to anyone and read the body they sent)
    got, reply = status_and_body(head_only(mon.port, "GET", path, None, 2 << 20))
    assert got == 400, reply
    assert set(reply) == {"error"} and "GET" in reply["error"], reply


def test_a_read_without_a_body_is_still_answered(mon):
    with httpx.Client(base_url=mon.url, timeout=60) as c:
        assert c.get("/").status_code == 200
        assert c.get("/api/jobs", headers={"Content-Length": "0"}).status_code == 200
        with c.stream("GET", "/api/events") as r:
            assert r.status_code == 200


def test_a_writer_with_the_token_is_still_told_to_continue(mon):
    body = json.dumps(slow_job(steps=5).meta.to_dict()).encode()
    got = continued_write(mon.port, "PUT", "/api/jobs/j/meta", TOKEN, body)
    assert got.split()[1] == b"200", got


@pytest.mark.slow
def test_a_refused_new_job_gives_its_place_in_the_minute_back(tmp_path):
    # (fails before: a new job was counted against new_jobs_per_minute before its meta.json
    # was read, so bad or too large ones used up the minute and the next valid job was 429)
    cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600,
                        new_jobs_per_client_per_minute=1, new_jobs_per_minute=1)
    meta = slow_job(steps=5).meta.to_dict()
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=cfg).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=AUTH) as c:
            assert c.put("/api/jobs/bad/meta", content=b"{not json").status_code == 422
            assert c.put("/api/jobs/bad2/meta", json={**meta, "world_size": -1}
                         ).status_code == 422
            assert c.put("/api/jobs/big/meta", content=b" " * (2 << 20)).status_code == 413
            r = c.put("/api/jobs/good/meta", json=meta)
            assert r.status_code == 200, r.text
            r = c.put("/api/jobs/good/meta", json=meta)   # the same job again: no new one
            assert r.status_code == 200, r.text
            r = c.put("/api/jobs/other/meta", json=meta)   # the minute's one new job is used
            assert r.status_code == 429, r.text
            assert c.get("/api/jobs/bad").status_code == 404
    finally:
        s.stop()


@pytest.mark.parametrize("version", ["2.0", "0.9"])
def test_a_request_line_claiming_another_http_version_is_505(mon, version):
    # (fails before: served as HTTP/1.1, 200)
    from conftest import request_line_status
    status, reply = request_line_status(mon.port, version)
    assert status == 505 and b'"error"' in reply, reply
    assert request_line_status(mon.port, "1.1")[0] == 200
