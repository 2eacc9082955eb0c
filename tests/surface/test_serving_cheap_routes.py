"""The serving layer's pace of requests without a credential (serving_quota.AnonymousPace, given
by the app as `state.anonymous_pace`): every such request passes it before anything else is done
of it — a cheap route, an unknown path, a request the guard itself refuses — so that no route is
left unpaced by name. Counted, not timed: a pace of one turn per 600 s."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from conftest import eventually, readable
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from stragglers.serving import listen_socket, serve_in_thread, uvicorn_server
from stragglers.serving_quota import AnonymousPace

KEY = b"x-test-key"


async def health(request: Request):
    return JSONResponse({"ok": True})


async def big(request: Request):
    return Response(b"x" * (10 * 65536), media_type="application/octet-stream")


def credentialed(scope) -> bool:
    return (KEY, b"yes") in (scope.get("headers") or ())


def app_paced(**pace) -> Starlette:
    app = Starlette(routes=[Route("/health", health), Route("/big", big)])
    app.state.anonymous_pace = AnonymousPace(credentialed, 1 / 600, 1.0,
                                             **{"max_wait_s": 86400.0, **pace})
    return app


@pytest.fixture
def serve():
    started = []

    def make(**pace):
        app = app_paced(**pace)
        sock = listen_socket("127.0.0.1", 0)
        server = uvicorn_server(app, max_connections=1000, keep_alive_s=30)
        serve_in_thread(server, sock, "test-cheap-routes", "test server")
        started.append(server)
        return app, sock.getsockname()[1]

    yield make
    for server in started:
        server.should_exit = True


def send(port: int, head: str, source: str = "127.0.0.1") -> socket.socket:
    k = socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(source, 0))
    k.sendall(head.encode())
    return k


def get(path: str, extra: str = "", version: str = "1.1") -> str:
    return f"GET {path} HTTP/{version}\r\nHost: 127.0.0.1\r\n{extra}\r\n"


def answer(k: socket.socket) -> bytes:
    assert readable([k], 60), "answered (a bound against a hang)"
    return k.recv(65536)


def test_anonymous_requests_past_the_burst_wait_their_turns_whatever_they_ask(serve):
    app, port = serve(per_s_in_all=1000.0)
    pressure = app.state.anonymous_pace.pressure
    heads = [get("/health"), get("/no/such/path"), get("/health", "Host: evil.example\r\n"),
             get("/health", version="2.0"), get("/health?x=1", "X-Test-Key: no\r\n"),
             "POST /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\n\r\n"]
    flood = [send(port, h) for h in heads]
    try:
        got: list[socket.socket] = []
        while len(got) < 2:   # burst 1: GCRA lets two through at once
            ready = readable([k for k in flood if k not in got], 60)
            assert ready, f"{len(got)} answered; expected 2"
            got += ready
        assert len(got) == 2
        # a request with the credential waits for none of the address's turns
        with send(port, get("/health", "X-Test-Key: yes\r\n")) as k:
            assert answer(k).startswith(b"HTTP/1.1 200")
        # nor does another address's request
        with send(port, get("/health"), source="127.0.0.2") as k:
            assert answer(k).startswith(b"HTTP/1.1 200")
        waiting = [k for k in flood if k not in got]
        assert readable(waiting, 0) == []
        assert pressure.requests == {"127.0.0.1": len(waiting)}
    finally:
        for k in flood:
            k.close()


def test_one_request_at_a_time_is_paced_past_the_burst_too(serve):
    # (a cheap handler never yields: counted in progress, the next request of a loop found
    # none, and a loop of them on 8 connections was answered ~480 times a second)
    app, port = serve(per_s_in_all=1000.0)
    pressure = app.state.anonymous_pace.pressure
    with send(port, get("/health")) as k:
        for _ in range(2):
            assert answer(k).startswith(b"HTTP/1.1 200")
            k.sendall(get("/health").encode())
        eventually(lambda: pressure.requests == {"127.0.0.1": 1}, timeout=60,
                   what="the third request waiting its turn")
        assert readable([k], 0) == []


def test_a_request_whose_client_left_while_it_waited_gives_its_turn_back(serve):
    # (turns that stayed taken let a burst of connections closed at a cap while they waited
    # push a loopback /health probe's turn past the longest wait: 429)
    app, port = serve(per_s_in_all=1000.0)
    pressure = app.state.anonymous_pace.pressure
    first = [send(port, get("/health")) for _ in range(2)]   # the burst's two turns
    for k in first:
        assert answer(k).startswith(b"HTTP/1.1 200")
        k.close()
    third = send(port, get("/health"))
    eventually(lambda: pressure.requests == {"127.0.0.1": 1}, timeout=60, what="it waits")
    due = pressure._due["127.0.0.1"]
    third.close()
    eventually(lambda: pressure.requests == {}, timeout=60, what="its wait given up")
    assert pressure._due["127.0.0.1"] == pytest.approx(due - 600)


def test_a_big_answer_takes_a_turn_per_64_kib(serve):
    # (8 loops of plotly.min.js, 3.6 MB, answered 41 times a second slowed uploads 3.5x)
    app, port = serve(per_s_in_all=1000.0)
    pressure = app.state.anonymous_pace.pressure
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        assert c.get("/health").status_code == 200
        small = pressure._due["127.0.0.1"]
        assert len(c.get("/big").content) == 10 * 65536
    # its own turn and nine more, 600 s each
    assert pressure._due["127.0.0.1"] == pytest.approx(small + 10 * 600, abs=5)
    assert pressure.requests == {}


def test_a_turn_past_the_longest_wait_is_refused_429_after_it_taking_none(serve):
    app, port = serve(max_wait_s=0.2, per_s_in_all=1000.0)
    pressure = app.state.anonymous_pace.pressure
    first = [send(port, get("/health")) for _ in range(2)]   # the burst's two turns
    for k in first:
        assert answer(k).startswith(b"HTTP/1.1 200")
        k.close()
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
        refused = [c.get("/no/such/path") for _ in range(2)]
    for r in refused:
        assert r.status_code == 429, r.text
        assert 500 <= int(r.headers["retry-after"]) <= 1200
        assert "a second" in json.loads(r.text)["error"]
    # (refusals took no turn: the address's next one is still the third, 600 s off)
    assert pressure.requests == {}
    assert pressure._due["127.0.0.1"] - time.monotonic() < 1200


def test_anonymous_requests_of_many_addresses_are_paced_in_all(serve):
    app, port = serve(per_s_in_all=1 / 600)
    flood = [send(port, get("/health"), source=f"127.0.0.{i}") for i in range(1, 7)]
    try:
        got: list[socket.socket] = []
        while len(got) < 2:   # a burst of one in all: GCRA lets two through at once
            ready = readable([k for k in flood if k not in got], 60)
            assert ready, f"{len(got)} answered; expected 2"
            got += ready
        assert len(got) == 2
        for k in got:
            assert answer(k).startswith(b"HTTP/1.1 200")
        with send(port, get("/health", "X-Test-Key: yes\r\n")) as k:
            assert answer(k).startswith(b"HTTP/1.1 200")
        assert readable([k for k in flood if k not in got], 0) == []
        assert app.state.anonymous_pace.in_all.requests == {"all": len(flood) - 2}
    finally:
        for k in flood:
            k.close()


def test_an_address_is_paced_by_its_ipv4_form_or_its_ipv6_64():
    pace = AnonymousPace(credentialed, 1.0, 1.0)

    def key(host: str, headers=()):
        return pace.key({"client": (host, 1), "headers": list(headers)})
    assert key("2001:db8:1:2::1") == key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert key("2001:db8:1:3::1") != key("2001:db8:1:2::1")
    assert key("::ffff:10.0.0.1") == key("10.0.0.1") == "10.0.0.1"
    assert key("127.0.0.2") != key("127.0.0.1")
    assert key("10.0.0.1", [(KEY, b"yes")]) is None
