"""A request waiting its turn (serving_guard.park) gives its wait up at once when its client
half-closes or closes the connection: a client's FIN kept the connection open (a half-close is
answered), so a read abandoned while it waited held its place in the queue, and its turn, for
up to four turns of the per-address pace. Real uvicorn servers on 127.0.0.1, raw sockets.

The waits are 300 s: a request that does not give up fails the test (its socket's timeout,
the in-progress count that does not fall); one that does is answered at once."""

from __future__ import annotations

import json
import socket

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from conftest import eventually
from stragglers.serving import listen_socket, serve_in_thread, uvicorn_server
from stragglers.serving_guard import park

WAIT_S = 300.0


async def waits_its_turn(request: Request):
    if not await park(request.scope, WAIT_S):
        return JSONResponse({"error": "gave up its turn"}, status_code=503)
    return JSONResponse({"served": True})


APP = Starlette(routes=[Route("/turn", waits_its_turn)])


@pytest.fixture(params=["httptools", "h11"])
def server(request):
    sock = listen_socket("127.0.0.1", 0)
    served = uvicorn_server(APP, max_connections=100, keep_alive_s=30, http=request.param)
    serve_in_thread(served, sock, "test-parked", "test server")
    try:
        yield served, sock.getsockname()[1]
    finally:
        served.should_exit = True


def answers(k: socket.socket) -> list[tuple[int, dict]]:
    """Every response the server sends before it closes (status, JSON body)."""
    got = b""
    while chunk := k.recv(65536):
        got += chunk
    out = []
    while got:
        head, _, rest = got.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")))
        out.append((int(head.split()[1]), json.loads(rest[:length])))
        got = rest[length:]
    return out


REQUEST = b"GET /turn HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"


@pytest.mark.slow
def test_a_half_closed_clients_waiting_request_gives_up_at_once(server):
    _, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=60) as k:
        k.sendall(REQUEST)
        k.shutdown(socket.SHUT_WR)
        assert answers(k) == [(503, {"error": "gave up its turn"})]


@pytest.mark.slow
def test_pipelined_requests_behind_a_half_close_give_up_too(server):
    # the second is parsed (or started) only after the FIN was read: it must not wait either
    _, port = server
    with socket.create_connection(("127.0.0.1", port), timeout=60) as k:
        k.sendall(REQUEST * 3)
        k.shutdown(socket.SHUT_WR)
        assert answers(k) == [(503, {"error": "gave up its turn"})] * 3


@pytest.mark.slow
def test_a_closed_clients_waiting_request_leaves_at_once(server):
    served, port = server
    guard = served.config.app
    for _ in range(5):
        k = socket.create_connection(("127.0.0.1", port), timeout=60)
        k.sendall(REQUEST)
        k.close()
    # nobody is left to answer: none of them stays in progress (waited out, 300 s)
    eventually(lambda: guard.requests == 0, timeout=60, what="abandoned requests gone")
