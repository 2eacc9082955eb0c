"""Red team round fourteen (issue 34): the shard service's incarnations (a launcher's release
of a name that never joined) and the shared serving layer's own refusals (security headers),
against real servers on loopback and real SQLite.

Each test is one defect, marked xfail(strict=True) until its fix lands (then the mark goes): a
pass before the fix fails the suite. Nothing is timed.
"""

from __future__ import annotations

import httpx
import pytest

OWNER = "owner-round14-token-0123456789"


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def _service(tmp_path):
    from stragglers.adapt.service import EmbeddedServer

    return EmbeddedServer(tmp_path / "s.db", durable=False).start()


def test_a_name_that_never_joined_leases_nothing_after_a_launchers_release(tmp_path):
    """A launcher's release without a fence (it saw the worker die) of a worker name that never
    joined the data set (a typo, a pod of another job) is answered 200 {"released": []} — and
    stores a workers row for the name with fence 1 (ShardStore.release -> join(leaving=True)).
    A lease by that name with fence 1, which no join ever handed out, is then served shards;
    before the release it is 409 "has not joined (POST .../join first)". The release "fences
    off every incarnation" of the name: it must leave none current (or refuse a name unknown)."""
    server = _service(tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=_bearer(OWNER)) as c:
            assert c.post("/datasets", json={"name": "d", "num_samples": 64,
                                             "shard_size": 8}).status_code == 200
            lease = {"worker": "ghost", "fence": 1}
            before = c.post("/datasets/d/lease", json=lease)
            assert before.status_code == 409, before.text
            r = c.post("/datasets/d/release", json={"worker": "ghost", "failure": True,
                                                    "error": "pod gone"})
            assert r.status_code in (200, 404), r.text
            after = c.post("/datasets/d/lease", json=lease)
            assert after.status_code == 409, (
                f"a name that never joined leased after a launcher's release: {after.text[:160]}")
            assert c.get("/datasets/d/status").json()["epochs"]["0"]["DOING"] == 0
    finally:
        server.stop()


def _raw_head(server, data: bytes) -> dict[str, str]:
    """Send `data` on a connection of its own; the answer's status line and headers."""
    import socket

    with socket.create_connection((server.host, server.port), timeout=30) as s:
        s.sendall(data)
        out = b""
        while b"\r\n\r\n" not in out:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
    lines = out.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    head = {"status": lines[0]}
    head.update((k.strip().lower(), v.strip()) for k, _, v in (ln.partition(":") for ln in lines[1:]))
    return head


@pytest.mark.parametrize("request_bytes,status", [
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 70_000 + b"\r\n\r\n", "431"),
    (b"G@T /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", "400"),
], ids=["head-431", "parser-400"])
def test_refusals_below_the_app_carry_the_security_headers(tmp_path, request_bytes, status):
    """Every answer of the app and of ServiceGuard carries serving.SECURITY_HEADERS
    (X-Frame-Options DENY, Referrer-Policy, Content-Security-Policy, nosniff) — a 404, a 405, a
    Host refused (400), a 417, a 501. The answers the connection guard writes itself
    (serving_guard.json_response_bytes: a head over 64 KiB 431, bytes the parser refuses 400,
    a head or body too slow 408, a connection evicted at the cap 503) carry only nosniff: the
    same service answers with and without its frame/CSP policy depending on which layer
    refused. Every response, whoever writes it, must carry the same security headers."""
    server = _service(tmp_path)
    try:
        head = _raw_head(server, request_bytes)
        assert head["status"].split()[1] == status, head
        assert head.get("x-content-type-options") == "nosniff", head
        missing = [h for h in ("x-frame-options", "referrer-policy", "content-security-policy")
                   if h not in head]
        assert not missing, f"a {status} written below the app lacks {missing}: {head}"
    finally:
        server.stop()
