"""Every request without the token passes one pace per client address before anything is done
of it, whatever its route: /health, a 404, the dashboard's files, a read refused 422, a Host the
service refuses. 8 processes looping on /health (no token needed) were answered ~560 times a
second and slowed another job's uploads 2.3x; a 404 loop 2.2x, the dashboard page 3.5x.

Counted, not timed: the pace here is one turn per 600 s after a burst of 2, so exactly three
of a flood of anonymous requests are answered (GCRA lets burst + 1 through), the rest wait; a
request with the token is answered meanwhile, and so is another address's. A loop asking one
request at a time is paced past its burst too: a cheap handler never yields, so a pace of
requests in progress let every request of a flood go free. Real monitor on 127.0.0.1 /
127.0.0.2."""

from __future__ import annotations

import socket

import httpx
import pytest
from conftest import eventually, raw_request, readable

import stragglers.monitor.app as monitor_app
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig

TOKEN = "cheap-routes-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)
# (method, target, extra head lines): cheap routes, an unknown one, refusals of the app and of
# the serving layer below it, a wrong token
FLOOD = [("GET", "/health", ""), ("GET", "/no/such/path", ""), ("GET", "/", ""),
         ("GET", "/static/app.js", ""), ("GET", "/api/alerts?limit=0", ""),
         ("GET", "/api/jobs?a=1&a=2", ""), ("GET", "/health", "X-Other: 1\r\n"),
         ("POST", "/health", ""), ("GET", "/favicon.ico", ""),
         ("GET", "/health", "Authorization: Bearer wrong-token-0123456789\r\n"),
         ("GET", "/api/jobs/x/windows/00", ""), ("GET", "/health", "Host: evil.example\r\n")]


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setattr(monitor_app, "ANONYMOUS_PER_S", 1 / 600, raising=False)
    monkeypatch.setattr(monitor_app, "ANONYMOUS_BURST", 2.0, raising=False)
    monkeypatch.setattr(monitor_app, "ANONYMOUS_MAX_WAIT_S", 86400.0, raising=False)
    # (the pace of all addresses together: not what is counted here)
    monkeypatch.setattr(monitor_app, "ANONYMOUS_PER_S_IN_ALL", 1000.0, raising=False)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        yield s
    finally:
        s.stop()




def test_a_flood_of_anonymous_requests_of_any_route_is_paced_and_the_token_served(server):
    flood = [raw_request(server.port, *request) for request in FLOOD]
    try:
        got: list[socket.socket] = []
        while len(got) < 3:   # the burst's three turns, whichever requests came first
            ready = readable([k for k in flood if k not in got], 60)
            assert ready, f"{len(got)} of the flood answered; expected 3"
            got += ready
        assert len(got) == 3, [k.recv(200) for k in got]
        for k in got:
            assert k.recv(4096).startswith(b"HTTP/1.1 "), "an answer"
        # the token's requests wait for no turn of the address's
        with httpx.Client(base_url=server.url, timeout=60) as c:
            assert c.get("/health", headers=AUTH).status_code == 200
            assert c.put("/api/jobs/cheap/meta", headers=AUTH,
                         content=b'{"job": "cheap", "world_size": 1}').status_code in (200, 422)
        # another address's request is not this one's flood
        other = raw_request(server.port, "GET", "/health", source="127.0.0.2")
        with other:
            assert readable([other], 60), "another address's request answered"
            assert other.recv(4096).startswith(b"HTTP/1.1 200")
        # the rest still wait their turns (600 s apart): none answered
        waiting = [k for k in flood if k not in got]
        assert len(waiting) == len(FLOOD) - 3
        assert readable(waiting, 0) == []
        assert server.app.state.anonymous_pace.pressure.requests == {"127.0.0.1": len(waiting)}
    finally:
        for k in flood:
            k.close()


def test_a_loop_of_one_anonymous_request_at_a_time_is_paced_past_its_burst(server):
    pressure = server.app.state.anonymous_pace.pressure
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert [c.get(path).status_code for path in ("/health", "/no/such", "/")] == \
            [200, 404, 200]
    with raw_request(server.port, "GET", "/health") as k:   # the fourth: 600 s off
        eventually(lambda: pressure.requests == {"127.0.0.1": 1}, timeout=60,
                   what="the fourth request waiting its turn")
        assert readable([k], 0) == []
