"""Requests the HTTP parser refuses (a malformed request line or header, refused before any
route) wait their client address's turn of the service's anonymous pace, as requests without
a credential do: a flood of malformed requests, a connection each, was answered as fast as
connections came (after the 0.25 s refusal pause only), each an accept, a parse and a close of
the event loop's, with no turn taken, and a flood's address could go on asking /health
unpaced. Real uvicorn servers on 127.0.0.1 (httptools and h11), raw sockets.

The pace gives 2 turns at once (burst 1) and the next only after 1,000 s: the malformed
requests take both, so the address's next anonymous request is refused 429 (it was served
200 when refusals took no turn). Bounds are only against a hang."""

from __future__ import annotations

import json
import socket

import pytest
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from conftest import eventually, readable
from stragglers.serving import listen_socket, serve_in_thread, uvicorn_server
from stragglers.serving_guard import ConnectionLimits
from stragglers.serving_quota import AnonymousPace


async def health(request):
    return JSONResponse({"ok": True})


@pytest.fixture(params=["httptools", "h11"])
def served(request):
    app = Starlette(routes=[Route("/health", health)])
    app.state.anonymous_pace = pace = AnonymousPace(
        lambda scope: False, per_s=0.001, burst=1, max_wait_s=0.05, per_s_in_all=1000.0)
    sock = listen_socket("127.0.0.1", 0)
    server = uvicorn_server(app, max_connections=64, keep_alive_s=30, http=request.param,
                            limits=ConnectionLimits(max_connections=64, per_client=64,
                                                    refusal_delay_s=0.01, linger_s=0.2))
    serve_in_thread(server, sock, "test-refusal-pace", "test server")
    try:
        yield pace, sock.getsockname()[1]
    finally:
        server.should_exit = True


def answer(port: int, request: bytes) -> tuple[int, dict]:
    """The status and JSON body of the answer to `request` sent on a new connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as k:
        k.sendall(request)
        got = b""
        while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
            assert readable([k], 30), f"no answer: {got!r}"
            chunk = k.recv(65536)
            if not chunk:
                break
            got += chunk
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


BAD = b"GET /he\x01lth HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
GOOD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


def test_malformed_requests_take_their_address_turns(served):
    pace, port = served
    for _ in range(2):
        status, body = answer(port, BAD)
        assert status == 400 and body["error"].startswith("request: ")
    # both turns taken: the address's next anonymous request waits past the longest wait
    status, body = answer(port, GOOD)
    assert status == 429, body
    # a malformed one past the pace is still answered 400 (after the longest wait), its turn
    # not taken, and nothing is left counted in progress
    status, _ = answer(port, BAD)
    assert status == 400
    assert pace.pressure.requests == {} and pace.in_all.requests == {}


def test_a_refusal_waiting_its_turn_is_counted_in_progress(served):
    """A refusal whose turn is far off waits for it counted as the address's request in
    progress, and lets go of it once its client leaves."""
    pace, port = served
    pace.pressure.max_wait_s = 2000.0   # (the third turn, 1,000 s off, is waited for)
    for _ in range(2):
        assert answer(port, BAD)[0] == 400
    with socket.create_connection(("127.0.0.1", port), timeout=30) as k:
        k.sendall(BAD)
        eventually(lambda: pace.pressure.requests.get("127.0.0.1") == 1, timeout=30,
                   interval=0.01, what="the refusal counted in progress")
        assert pace.in_all.requests == {"all": 1}
    eventually(lambda: pace.pressure.requests == {} and pace.in_all.requests == {},
               timeout=30, interval=0.01, what="the refusal's count let go")
