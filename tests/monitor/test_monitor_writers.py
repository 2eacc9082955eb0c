"""One writer (a bearer token and a client address; from loopback, where every local process is
127.0.0.0/8, a token and a job) cannot hold the monitor's whole upload budget: uploads in
progress and bytes held per writer are bounded (429, one line of JSON, the recorder retries),
and another writer's uploads go on meanwhile; new jobs are rate-limited."""

from __future__ import annotations

import socket

import httpx
import pytest

from conftest import eventually
from monitor_jobs import parts_of, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

TOKEN = "writers-test-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def serve(tmp_path, **settings):
    config = MonitorConfig(window_steps=5, tick_s=0.05, stall_after_s=600, **settings)
    return MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=config).start()


def busy_upload(port: int, part: int, length: int, send: bytes = b"",
                job: str = "j") -> socket.socket:
    """An upload whose body the monitor has started to read (100 Continue), left unfinished."""
    k = socket.create_connection(("127.0.0.1", port), timeout=30)
    k.sendall(f"PUT /api/jobs/{job}/ranks/0/parts/{part} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              f"Authorization: Bearer {TOKEN}\r\nContent-Length: {length}\r\n"
              "Expect: 100-continue\r\n\r\n".encode())
    got = b""
    while b"100 Continue" not in got:
        chunk = k.recv(100)
        assert chunk, got
        got += chunk
    k.sendall(send)
    return k


def client_from(url: str, address: str) -> httpx.Client:
    return httpx.Client(base_url=url, timeout=60,
                        transport=httpx.HTTPTransport(local_address=address))


@pytest.mark.slow
def test_uploads_in_progress_are_bounded_per_writer(tmp_path):
    trace = slow_job(steps=5)
    rank, part, cols = parts_of(trace, 5)[0]
    s = serve(tmp_path, max_uploads_per_writer=2)
    held = []
    try:
        with client_from(s.url, "127.0.0.1") as mine, client_from(s.url, "127.0.0.2") as other:
            assert mine.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                            headers=AUTH).status_code == 200
            held = [busy_upload(s.port, 100 + i, 10_000) for i in range(2)]
            r = mine.put(f"/api/jobs/j/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                         headers=AUTH)
            assert r.status_code == 429, r.text
            assert "max_uploads_per_writer" in r.json()["error"]
            assert "\n" not in r.json()["error"]
            # another loopback address is no other writer (any local process may take one)
            r = other.put(f"/api/jobs/j/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                          headers=AUTH)
            assert r.status_code == 429, r.text
            # another local job is: its upload is stored (a local process at its limit once
            # held every local job's uploads, all from 127.0.0.1)
            assert mine.put("/api/jobs/k/meta", json=trace.meta.to_dict(),
                            headers=AUTH).status_code == 200
            r = mine.put(f"/api/jobs/k/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                         headers=AUTH)
            assert r.status_code == 200 and r.json()["status"] == "stored", r.text
            for k in held:
                k.close()
            # the writer's uploads ended with their connections: it may upload again
            eventually(lambda: mine.put(f"/api/jobs/j/ranks/{rank}/parts/{part + 1}",
                                        content=table_bytes(cols),
                                        headers=AUTH).status_code == 200,
                       what="the writer's slots given back")
    finally:
        for k in held:
            k.close()
        s.stop()


@pytest.mark.slow
def test_bytes_held_are_bounded_per_writer(tmp_path):
    trace = slow_job(steps=5)
    rank, part, cols = parts_of(trace, 5)[0]
    body = table_bytes(cols)
    s = serve(tmp_path, max_upload_bytes_per_writer=64 * 1024)
    held = []
    try:
        with client_from(s.url, "127.0.0.1") as mine, client_from(s.url, "127.0.0.2") as other:
            assert mine.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                            headers=AUTH).status_code == 200
            held = [busy_upload(s.port, 100, 1 << 20, b"x" * 60_000)]
            attempt = iter(range(200, 10_000))

            def refused():
                r = mine.put(f"/api/jobs/j/ranks/{rank}/parts/{next(attempt)}", content=body,
                             headers=AUTH)
                return r if r.status_code == 429 else None

            r = eventually(refused, what="the writer's bytes counted")
            assert "max_upload_bytes_per_writer" in r.json()["error"], r.text
            assert other.put("/api/jobs/k/meta", json=trace.meta.to_dict(),
                             headers=AUTH).status_code == 200
            r = other.put(f"/api/jobs/k/ranks/{rank}/parts/{part}", content=body, headers=AUTH)
            assert r.status_code == 200 and r.json()["status"] == "stored", r.text
    finally:
        for k in held:
            k.close()
        s.stop()


@pytest.mark.slow
def test_a_big_body_that_is_no_parquet_is_refused_before_it_is_read_whole(tmp_path):
    # 4 of a declared 64 MiB sent, then the client waits: the monitor judges the first bytes
    # and answers while 60 MiB are still to come (were it to wait for the whole body, no answer
    # would come). What it then reads of the rest is discarded (the serving layer's linger, so
    # that a client sending its whole body first gets the answer and not a reset).
    trace = slow_job(steps=5)
    s = serve(tmp_path, max_part_bytes=64 * 2**20)
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
        host, port = s.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(f"PUT /api/jobs/j/ranks/0/parts/0 HTTP/1.1\r\nHost: {host}\r\n"
                         f"Authorization: {AUTH['Authorization']}\r\n"
                         f"Content-Length: {64 * 2**20}\r\n\r\n".encode())
            sock.sendall(b"\0" * (4 * 2**20))
            answer = b""
            while b"\r\n\r\n" not in answer:
                chunk = sock.recv(65536)
                assert chunk, answer   # closed without an answer
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 422"), answer[:200]
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            job = c.get("/api/jobs/j", headers=AUTH).json()
            assert job["last_part_at"] is None and not job["pending_rows"], job
    finally:
        s.stop()


@pytest.mark.slow
def test_new_jobs_are_rate_limited(tmp_path):
    trace = slow_job(steps=5)
    s = serve(tmp_path, new_jobs_per_minute=3)
    try:
        with client_from(s.url, "127.0.0.1") as c, client_from(s.url, "127.0.0.3") as c3:
            meta = trace.meta.to_dict()
            codes = [c.put(f"/api/jobs/j{i}/meta", json=meta, headers=AUTH).status_code
                     for i in range(3)]
            assert codes == [200, 200, 200], codes
            # another loopback address is no other client
            r = c3.put("/api/jobs/j3/meta", json=meta, headers=AUTH)
            assert r.status_code == 429 and "new_jobs_per_minute" in r.json()["error"], r.text
            assert int(r.headers["retry-after"]) >= 1 and "\n" not in r.json()["error"]
            # a job it has is no new one: its meta may be sent again, its parts uploaded
            assert c.put("/api/jobs/j0/meta", json=meta, headers=AUTH).status_code == 200
            rank, part, cols = parts_of(trace, 5)[0]
            r = c.put(f"/api/jobs/j0/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                      headers=AUTH)
            assert r.status_code == 200, r.text
            assert c.get("/health").status_code == 200
    finally:
        s.stop()


def test_a_loopback_address_is_no_client_of_its_own():
    from stragglers.serving_quota import quota_client

    assert [quota_client(a) for a in ("127.0.0.1", "127.0.0.9", "::1", "::ffff:127.0.0.1",
                                      None)] == [None] * 5
    assert quota_client("192.0.2.7") == "192.0.2.7"


@pytest.mark.slow
def test_writers_holding_the_whole_budget_leave_another_writer_its_share(tmp_path):
    # two writers (jobs a and b) whose bodies keep coming just fast enough not to be cut hold
    # the monitor's whole upload budget between them: another job's upload was answered 503
    # until they stopped; now it is let in at its fair share, and theirs are cut back
    trace = slow_job(steps=5)
    rank, part, cols = parts_of(trace, 5)[0]
    body = table_bytes(cols)
    limit = 256 * 1024
    assert len(body) < limit // 3
    # (their bodies are never cut for slowness here: a loaded machine must not end them early)
    s = serve(tmp_path, max_upload_bytes_held=limit, max_upload_bytes_per_writer=limit // 2,
              body_min_bytes_per_s=1.0)
    held = []
    attempt = iter(range(200, 10_000))

    def refused(status):
        r = c.put(f"/api/jobs/a/ranks/{rank}/parts/{next(attempt)}", content=body,
                  headers=AUTH)
        return r.status_code == status

    try:
        with client_from(s.url, "127.0.0.1") as c:
            for job in "abk":
                assert c.put(f"/api/jobs/{job}/meta", json=trace.meta.to_dict(),
                             headers=AUTH).status_code == 200
            # (each declares what still fits, and leaves 4 KiB of it unsent)
            held = [busy_upload(s.port, 100, 1 << 20, b"x" * (limit // 2), "a")]
            # (job k's junk body of more than the budget has left once a's bytes are counted:
            # 503 then; no upload of job a meanwhile, whose own body could be refused for it)
            junk = b"x" * (limit // 2 + 1024)
            eventually(lambda: c.put(f"/api/jobs/k/ranks/{rank}/parts/900", content=junk,
                                     headers=AUTH).status_code == 503,
                       what="writer a's bytes counted")
            held.append(busy_upload(s.port, 100, limit // 2, b"x" * (limit // 2 - 4096), "b"))
            eventually(lambda: refused(503), what="the budget full")
            r = c.put(f"/api/jobs/k/ranks/{rank}/parts/{part}", content=body, headers=AUTH)
            assert r.status_code == 200 and r.json()["status"] == "stored", r.text
            # a writer over its share is refused its next bytes, its connection closed
            held[0].sendall(b"x" * 65536)
            held[0].settimeout(30)
            answer = held[0].recv(4096)
            assert answer.startswith(b"HTTP/1.1 503") or answer == b"", answer[:200]
            assert c.get("/health").status_code == 200
    finally:
        for k in held:
            k.close()
        s.stop()
