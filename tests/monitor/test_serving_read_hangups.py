"""Reads waiting their turn of the per-address read pace (read_interval_s) give their wait up at
once when their client half-closes or closes the connection: its FIN kept the connection open
(a half-close is answered), so an abandoned /metrics or /api/stats stayed in its address's
queue, up to the pace's four turns, and took a turn nobody read. Real monitor on 127.0.0.1.

The pace is 60 s: a read that waits its turn fails the test (the socket's timeout, the
in-progress count that does not fall); one that gives up is answered at once."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from conftest import eventually
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig

READS = ("/api/stats", "/metrics", "/api/jobs")
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, read_interval_s=60.0)


@pytest.fixture
def server(tmp_path):
    s = MonitorServer(tmp_path / "mon.db", port=0, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for path in READS:   # each route's turn for the address: taken (paced apart)
                assert c.get(path).status_code == 200
        yield s
    finally:
        s.stop()


def ask(port: int, path: str, pipelined: int = 1) -> socket.socket:
    k = socket.create_connection(("127.0.0.1", port), timeout=60)
    k.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode() * pipelined)
    return k


def read_all(k: socket.socket) -> bytes:
    got = b""
    while chunk := k.recv(65536):
        got += chunk
    return got


@pytest.mark.slow
@pytest.mark.parametrize("path", READS)
def test_a_read_whose_client_half_closed_gives_up_its_wait(server, path):
    with ask(server.port, path, pipelined=2) as k:
        k.shutdown(socket.SHUT_WR)
        got = read_all(k)
    answers = got.split(b"HTTP/1.1 ")[1:]
    assert len(answers) == 2, got[:600]
    for answer in answers:
        assert answer.startswith(b"503 "), got[:600]
        body = json.loads(answer.partition(b"\r\n\r\n")[2].partition(b"HTTP/1.1")[0])
        assert "closed" in body["error"] and "turn" in body["error"], body


@pytest.mark.slow
def test_reads_whose_clients_closed_are_not_kept_waiting(server):
    guard = server._server.config.app
    for path in READS * 3:
        ask(server.port, path).close()
    # nobody is left to answer them: none stays in progress (each waited out its turn)
    eventually(lambda: guard.requests == 0, timeout=60, what="abandoned reads gone")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.get("/health").status_code == 200
