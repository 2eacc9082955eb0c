"""Places shared across tokens are taken once a request's body is here (round 13, finding 2): a
control report or DELETE whose body never comes holds its token's place alone, and restore
bodies are counted in a budget of bytes as they arrive (uploads.UploadBytes)."""

from __future__ import annotations

import socket

import httpx
import pytest

from stragglers.adapt.errors import Busy
from stragglers.adapt.service import EmbeddedServer, ServiceConfig
from stragglers.adapt.uploads import UploadBytes

TOKENS = [f"places-round13-token-{i:04d}" for i in range(3)]


def _stalled_report(port: int, job: str, token: str) -> socket.socket:
    """A report head admitted (its 100 Continue read) whose body never comes."""
    k = socket.create_connection(("127.0.0.1", port), timeout=30)
    k.sendall(f"POST /jobs/{job}/control/report HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization:"
              f" Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n"
              "Expect: 100-continue\r\n\r\n".encode())
    assert k.recv(64).startswith(b"HTTP/1.1 100"), "the report's head was not admitted"
    return k


def test_control_bodies_that_never_come_hold_no_other_tokens_control_calls(tmp_path):
    # (fails before: each stalled head took a place of max_control_calls from the head, and
    # job V's config was 503 "too many control calls are waiting" until their bodies timed out)
    cfg = ServiceConfig(max_control_calls=2)
    srv = EmbeddedServer(tmp_path / "s.db", durable=False, config=cfg).start()
    stalled: list[socket.socket] = []
    clients = [httpx.Client(base_url=srv.url, timeout=60,
                            headers={"Authorization": f"Bearer {t}"}) for t in TOKENS]
    try:
        for i, c in enumerate(clients):
            r = c.post(f"/jobs/job{i}/control/config", json={
                "policy": "bsp", "world_size": 2, "global_batch": 8, "incarnation": 1})
            assert r.status_code == 200, r.text
        stalled = [_stalled_report(srv.port, f"job{i}", TOKENS[i]) for i in range(2)]
        r = clients[2].post("/jobs/job2/control/report", json={
            "rank": 0, "records": [[1, 0.1, 4]], "incarnation": 1})
        assert r.status_code == 200, r.text
        assert srv.app.state.controlling.in_all.requests == {}   # (answered: given back)
    finally:
        for k in stalled:
            k.close()
        for c in clients:
            c.close()
        srv.stop()


def test_restore_bytes_are_counted_as_they_arrive_and_shared_fairly():
    budget = UploadBytes(100)
    budget.check("a", 1000)   # (nothing held: a body alone is always let in)
    budget.take("a", 60)
    budget.take("b", 30)
    with pytest.raises(Busy, match="restore_bytes_held"):
        budget.take("a", 20)   # (past the bound, "a" holds over its share: 100 / 2)
    budget.check("c", 30)   # (a token holding nothing, within 100 / 3)
    budget.take("c", 30)
    with pytest.raises(Busy):
        budget.check("d", 30)   # (over 100 / 4)
    budget.give("a", 60)
    budget.give("b", 30)
    budget.give("c", 30)
    assert (budget.held, budget.by_token) == (0, {})
