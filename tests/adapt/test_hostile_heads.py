"""The shared serving layer against request heads over ConnectionLimits.max_head_bytes,
however they are cut into reads (real uvicorn servers on 127.0.0.1, raw sockets)."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from stragglers.serving import ConnectionLimits, listen_socket, serve_in_thread, uvicorn_server

SERVED: list[str] = []


async def health(request: Request):
    SERVED.append(request.url.path)
    return JSONResponse({"ok": True})


APP = Starlette(routes=[Route("/health", health)])
LIMIT = 64 * 1024


@pytest.fixture(params=["httptools", "h11"])
def port(request):
    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn_server(APP, max_connections=100, keep_alive_s=30, http=request.param,
                            limits=ConnectionLimits(max_connections=100, max_head_bytes=LIMIT))
    serve_in_thread(server, sock, "test-heads", "test server")
    SERVED.clear()
    yield sock.getsockname()[1]
    server.should_exit = True


def exchange(port: int, data: bytes, half_close: bool = True) -> bytes:
    """Everything the server sends for `data` (sent in one sendall) until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as k:
        k.sendall(data)
        if half_close:
            k.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := k.recv(65536):
            got += chunk
    return got


def statuses(raw: bytes) -> list[int]:
    """The status of each response in `raw` (one may follow another's body directly)."""
    return [int(m) for m in re.findall(rb"HTTP/1\.1 (\d{3}) ", raw)]


def json_body(raw: bytes) -> dict:
    return json.loads(raw.rsplit(b"\r\n\r\n", 1)[1])


@pytest.mark.parametrize("shape", ["one header", "many headers", "long target"])
def test_a_head_over_the_bound_in_one_read_is_431(port, shape):
    # (fails before: a head that arrived whole in one read was parsed and served, 200)
    if shape == "one header":
        head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (LIMIT + 10)
    elif shape == "many headers":
        head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1" + b"".join(
            b"\r\nX-%d: %s" % (i, b"b" * 60) for i in range(LIMIT // 60))
    else:
        head = b"GET /health?" + b"q" * (LIMIT + 10) + b" HTTP/1.1\r\nHost: 127.0.0.1"
    raw = exchange(port, head + b"\r\n\r\n")
    assert statuses(raw) == [431], raw[:200]
    assert "more than 65536 bytes" in json_body(raw)["error"]
    assert SERVED == []
    assert statuses(exchange(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")) == [200]


def test_a_pipelined_head_over_the_bound_is_431_after_the_first_is_answered(port):
    small = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    big = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"c" * (LIMIT + 10) + \
        b"\r\n\r\n"
    raw = exchange(port, small + big, half_close=False)   # (the 431 closes it)
    assert statuses(raw)[-1] == 431 and 200 not in statuses(raw)[1:], raw[:300]
    assert len(SERVED) <= 1


def exchange_cut(port: int, data: bytes, cut: int) -> bytes:
    """As exchange, `data` sent in two parts with a pause between (so the server may read the
    first alone); the answer must not depend on whether it does."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as k:
        k.sendall(data[:cut])
        time.sleep(0.2)
        k.sendall(data[cut:])
        # nothing more to send: the server closes after its answers (else a kept-alive
        # connection ran into keep_alive_s, and the read's own 30 s timeout raced it)
        k.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := k.recv(65536):
            got += chunk
    return got


def test_a_head_far_over_the_bound_is_answered_not_reset(port):
    # (fails before: the server closed with the rest of the head unread, so the kernel reset
    # the connection and the client lost the 431 — ConnectionResetError, 20 of 20)
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"e" * (16 * LIMIT)
    raw = exchange(port, head + b"\r\n\r\n", half_close=False)
    assert statuses(raw) == [431], raw[:200]
    assert "more than 65536 bytes" in json_body(raw)["error"]
    assert SERVED == []


def test_a_head_cut_into_reads_is_bounded_at_the_limit(port):
    # (fails before with h11: its own 16 KB bound on a head still incomplete answered 400)
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"f" * (LIMIT - 200) + \
        b"\r\n\r\n"
    assert statuses(exchange_cut(port, head, 20_000)) == [200]
    small = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    big = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"g" * (LIMIT + 10) + \
        b"\r\n\r\n"
    raw = exchange_cut(port, small + big, 20_000)
    assert statuses(raw) == [200, 431], raw[-300:]


def test_a_refused_connection_lingers_only_linger_s():
    # the drained bytes of a refused head are bounded in time: a client still sending after
    # the 431 is cut (not held for ever by a connection that only discards)
    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn_server(APP, max_connections=10, keep_alive_s=30, http="h11",
                            limits=ConnectionLimits(max_connections=10, max_head_bytes=LIMIT,
                                                    linger_s=0.2))
    serve_in_thread(server, sock, "test-linger", "test server")
    try:
        with socket.create_connection(("127.0.0.1", sock.getsockname()[1]), timeout=30) as k:
            k.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"h" * (2 * LIMIT))
            got = b""
            while chunk := k.recv(65536):
                got += chunk
            assert statuses(got) == [431]
            deadline = time.monotonic() + 30
            with pytest.raises(OSError):   # a reset once the server has closed
                while time.monotonic() < deadline:
                    k.sendall(b"h" * 4096)
                    time.sleep(0.05)
    finally:
        server.should_exit = True


def test_a_head_just_under_the_bound_is_served(port):
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"d" * (LIMIT - 200)
    assert statuses(exchange(port, head + b"\r\n\r\n")) == [200]


MALFORMED = [
    b"GARBAGE\r\n\r\n",
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nNo colon here\r\n\r\n",
    b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + b"\x00" * 40,   # a TLS ClientHello
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: -5\r\n\r\n",
]


@pytest.mark.slow
@pytest.mark.parametrize("data", MALFORMED, ids=["no-method", "no-colon", "tls", "length"])
def test_a_request_the_parser_refuses_is_answered_after_the_refusal_pause(port, data):
    # (fails before: the parser's 400 was written at once, so a client looping on malformed
    # requests was answered as fast as it sent them; the app's refusals wait refusal_delay_s)
    start = time.monotonic()
    raw = exchange(port, data, half_close=False)
    assert time.monotonic() - start >= ConnectionLimits().refusal_delay_s, raw[:200]
    assert statuses(raw) == [400], raw[:200]
    assert "error" in json_body(raw)
    assert SERVED == []
    assert statuses(exchange(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")) == [200]


@pytest.mark.slow
def test_a_head_over_the_bound_is_answered_after_the_refusal_pause(port):
    start = time.monotonic()
    raw = exchange(port, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " +
                   b"i" * (2 * LIMIT) + b"\r\n\r\n", half_close=False)
    assert time.monotonic() - start >= ConnectionLimits().refusal_delay_s
    assert statuses(raw) == [431], raw[:200]


@pytest.mark.slow
def test_a_client_looping_on_refused_requests_is_logged_once_not_per_request():
    # (fails before: uvicorn logged "Invalid HTTP request received." for every malformed
    # request, and two lines for every upgrade it does not serve: thousands a second)
    import logging
    import threading

    logger = logging.getLogger("uvicorn.error")
    for f in [f for f in logger.filters if type(f).__name__ == "RepeatedLines"]:
        logger.removeFilter(f)   # (a filter of an earlier server has seen these already)
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn_server(APP, max_connections=100, keep_alive_s=30,
                            limits=ConnectionLimits(max_connections=100))
    keep = Keep(logging.WARNING)
    logger.addHandler(keep)   # (after the server's logging config, which drops handlers)
    serve_in_thread(server, sock, "test-log", "test server")
    try:
        port = sock.getsockname()[1]
        threads = [threading.Thread(target=exchange, args=(port, b"GARBAGE\r\n\r\n", False))
                   for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        upgrade = (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: Upgrade\r\n"
                   b"Upgrade: h2c\r\n\r\n")
        for _ in range(6):
            assert statuses(exchange(port, upgrade)) == [200]
    finally:
        server.should_exit = True
        logger.removeHandler(keep)
    assert sum("Invalid HTTP request" in line for line in lines) == 1, lines
    assert sum("Unsupported upgrade" in line for line in lines) == 1, lines
