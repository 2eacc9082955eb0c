"""A restore of a quarantined data set is refused from its head, as every other write to it
(session 51): it was refused only at its switch, after its body (up to 64 MiB) was read, parsed
in the child and its reserve allocated on the disk."""

from __future__ import annotations

import json
import socket
import sqlite3

import httpx

from stragglers.adapt.service import EmbeddedServer

OWNER = "owner-s51-quarantined-token-0123456789"


def test_a_restore_of_a_quarantined_data_set_is_refused_before_its_body_is_read(tmp_path):
    db = tmp_path / "s.db"
    server = EmbeddedServer(db, durable=False).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {OWNER}"}) as c:
            assert c.post("/datasets", json={"name": "d", "num_samples": 64,
                                             "shard_size": 8}).status_code == 200
            snap = c.get("/datasets/d/snapshot").content
    finally:
        server.stop()
    with sqlite3.connect(db) as conn:   # (another process damages a row)
        conn.execute("UPDATE shards SET consumed=-5 WHERE dataset='d' AND shard=3")
    server = EmbeddedServer(db, durable=False).start()
    k = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    try:
        r = httpx.get(f"{server.url}/datasets/d/status", timeout=60)
        assert r.status_code == 503 and r.json()["kind"] == "Quarantined", r.text
        k.sendall(f"POST /datasets/d/restore HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization:"
                  f" Bearer {OWNER}\r\nContent-Type: application/json\r\nContent-Length:"
                  f" {len(snap)}\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n".encode())
        reply = b""
        while chunk := k.recv(65536):
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 503"), reply[:200]   # (before: 100 Continue)
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["kind"] == "Quarantined"
    finally:
        k.close()
        server.stop()
