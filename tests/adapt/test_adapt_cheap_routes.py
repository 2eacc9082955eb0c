"""The shard service paces every request without a token per client address, whatever its
route, as the monitor does (serving_quota.AnonymousPace): its token pace let 4 of an address's
requests in progress go free, and a cheap handler (/health, a 404) never yields, so each
request of a flood found none in progress. Counted, not timed: one turn per 600 s after a
burst of 2 (GCRA lets three through: one creates a data set, two of the flood are answered)
and the rest wait — a made-up token's among them — while its owner's request and another
address's are served. A real service on 127.0.0.1 / 127.0.0.2."""

from __future__ import annotations

import socket

import httpx
import pytest
from conftest import eventually, raw_request, readable

import stragglers.adapt.service as adapt_service
from stragglers.adapt.service import EmbeddedServer

TOKEN = "cheap-routes-adapt-token-0123"
FLOOD = [("GET", "/health"), ("GET", "/no/such/path"), ("GET", "/health"),
         ("POST", "/health"), ("GET", "/datasets/none/status"), ("GET", "/health")]


@pytest.fixture
def server(tmp_path, monkeypatch):
    monkeypatch.setattr(adapt_service, "ANONYMOUS_PER_S", 1 / 600)
    monkeypatch.setattr(adapt_service, "ANONYMOUS_BURST", 2.0)
    monkeypatch.setattr(adapt_service, "ANONYMOUS_MAX_WAIT_S", 86400.0)
    monkeypatch.setattr(adapt_service, "ANONYMOUS_PER_S_IN_ALL", 1000.0)
    s = EmbeddedServer(tmp_path / "s.db").start()
    try:
        yield s
    finally:
        s.stop()



def test_a_flood_of_anonymous_requests_is_paced_and_a_tokens_request_served(server):
    owner = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=server.url, timeout=60) as c:   # the first turn
        r = c.post("/datasets", json={"name": "d", "num_samples": 8, "shard_size": 4},
                   headers=owner)
        assert r.status_code == 200, r.text
    flood = [raw_request(server.port, *request) for request in FLOOD]
    # a well-formed token that owns nothing is no credential (a new one each request went free)
    flood.append(raw_request(server.port, "GET", "/health",
                             extra="Authorization: Bearer made-up-token-0123456789\r\n"))
    try:
        got: list[socket.socket] = []
        while len(got) < 2:   # the burst's two turns left, whichever came first
            ready = readable([k for k in flood if k not in got], 60)
            assert ready, f"{len(got)} of the flood answered; expected 2"
            got += ready
        assert len(got) == 2
        # the owner's request waits for no turn of the address's
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.get("/health", headers=owner)
            assert r.status_code == 200, r.text
        other = raw_request(server.port, "GET", "/health", source="127.0.0.2")
        with other:
            ready = readable([other], 60)
            assert ready and other.recv(4096).startswith(b"HTTP/1.1 200")
        waiting = [k for k in flood if k not in got]
        assert readable(waiting, 0) == []   # still waiting their turns
        pressure = server.app.state.anonymous_pace.pressure
        # (127.0.0.2's turn is given back after its answer was sent: its client may read the
        # 200 first, and on a loaded machine it did; the flood's count is the check)
        eventually(lambda: "127.0.0.2" not in pressure.requests, 30,
                   what="the other address's turn given back after its answer")
        assert pressure.requests == {"127.0.0.1": len(waiting)}
    finally:
        for k in flood:
            k.close()
