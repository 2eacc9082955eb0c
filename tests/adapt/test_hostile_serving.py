"""The shared serving layer at its cap of connections: when a body sent in part may be closed to
admit a newcomer is `ConnectionLimits.cap_grace_s`, not a fixed second (real uvicorn servers on
127.0.0.1, raw sockets)."""

from __future__ import annotations

import json
import socket
import time

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from stragglers.serving import ConnectionLimits, listen_socket, serve_in_thread, uvicorn_server


async def health(request: Request):
    return JSONResponse({"ok": True})


async def upload(request: Request):
    return JSONResponse({"got": len(await request.body())})


APP = Starlette(routes=[Route("/health", health), Route("/upload", upload, methods=["PUT"])])


@pytest.fixture
def serve():
    servers = []

    def make(limits: ConnectionLimits) -> int:
        sock = listen_socket("127.0.0.1", 0)
        server = uvicorn_server(APP, max_connections=limits.max_connections, keep_alive_s=30,
                                limits=limits)
        serve_in_thread(server, sock, "test-cap-grace", "test server")
        servers.append(server)
        return sock.getsockname()[1]

    yield make
    for server in servers:
        server.should_exit = True


def part_bodies(port: int, n: int) -> list[socket.socket]:
    """`n` connections, each with a request head announcing 100,000 bytes and 10 of them sent."""
    out = []
    for _ in range(n):
        k = socket.create_connection(("127.0.0.1", port), timeout=60)
        k.sendall(b"PUT /upload HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\n\r\n"
                  + b"x" * 10)
        out.append(k)
    return out


def answer(k: socket.socket) -> tuple[int, dict]:
    """The status and JSON body the server sends before it closes `k` (60 s at most)."""
    got = b""
    try:
        while chunk := k.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def untouched(k: socket.socket) -> bool:
    """Whether the server has neither written to `k` nor closed it."""
    k.setblocking(False)
    try:
        return k.recv(1) == b"x"   # (b"": closed)
    except BlockingIOError:
        return True
    finally:
        k.setblocking(True)


@pytest.mark.slow
def test_at_the_cap_a_body_younger_than_cap_grace_s_is_not_closed_for_a_newcomer(serve):
    # A body sent in part counted as slow once a second old, whatever the settings said: the
    # newcomer is refused (503) while the bodies are within cap_grace_s.
    port = serve(ConnectionLimits(max_connections=4, per_client=4, header_timeout_s=600,
                                  body_grace_s=600, cap_grace_s=600, sweep_s=0.05))
    bodies = part_bodies(port, 4)
    time.sleep(1.5)   # past the fixed second (a slower machine only makes them older)
    new = socket.create_connection(("127.0.0.1", port), timeout=60)
    status, body = answer(new)
    assert status == 503 and "busy" in body["error"], body
    assert all(untouched(k) for k in bodies)
    for k in bodies:
        k.close()


def test_at_the_cap_a_body_past_cap_grace_s_makes_room_with_a_503(serve):
    port = serve(ConnectionLimits(max_connections=4, per_client=4, header_timeout_s=600,
                                  body_grace_s=600, cap_grace_s=0.0, sweep_s=0.05))
    bodies = part_bodies(port, 4)
    deadline = time.monotonic() + 120
    while True:   # (until the guard's sweep has seen the bodies: then one makes room)
        new = socket.create_connection(("127.0.0.1", port), timeout=60)
        new.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        status, _ = answer(new)
        if status == 200:
            break
        assert time.monotonic() < deadline, "no body was closed to make room"
        time.sleep(0.05)
    cut = [k for k in bodies if not untouched(k)]
    assert len(cut) >= 1
    status, body = answer(cut[0])
    assert status == 503 and "too slow" in body["error"], body
    for k in bodies:
        k.close()
