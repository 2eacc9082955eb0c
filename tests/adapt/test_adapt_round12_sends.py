"""Red team round 12, finding 5: snapshot send slots are per owner's token (strangers' in all),
and a body of one chunk takes none: one owner reading its big snapshot slowly holds only its
own token's slot, never another owner's snapshot (was 503 Busy: one slot for all owners)."""

from __future__ import annotations

import socket

import httpx

from adapt_jobs import snapshot_head, with_errors
from stragglers.adapt.service import EmbeddedServer, ServiceConfig, _SharedSend

S = "s-round12-sends-token-0123456789"
V = "v-round12-sends-token-0123456789"


def _create(url: str, token: str, name: str, shards: int) -> None:
    with httpx.Client(base_url=url, timeout=60,
                      headers={"Authorization": f"Bearer {token}"}) as c:
        r = c.post("/datasets", json={"name": name, "num_samples": 2 * shards, "shard_size": 2})
        assert r.status_code == 200, r.text


def test_a_slow_owner_holds_only_its_own_tokens_snapshot_slot(tmp_path):
    """S's 8 MB snapshot read by a client that takes nothing after the head: V's snapshot of
    its own (about 0.5 MB, two chunks: a slot needed) is sent whole; S's second big snapshot
    waits for S's slot and is 503 Busy after max_read_wait_s; S's small one (one chunk) is
    sent without a slot."""
    db = tmp_path / "s.db"
    config = ServiceConfig(max_read_wait_s=0.5)
    server = EmbeddedServer(db, durable=False, config=config).start()
    try:
        _create(server.url, S, "s", 1 << 13)
        _create(server.url, S, "s2", 1 << 13)
        _create(server.url, S, "small", 8)
        _create(server.url, V, "v", 512)
    finally:
        server.stop()
    for name, shards in (("s", 1 << 13), ("s2", 1 << 13), ("v", 512)):
        with_errors(db, name, shards)
    server = EmbeddedServer(db, durable=False, config=config).start()
    slow = socket.socket()
    try:
        assert snapshot_head(slow, server, "s", S).startswith(b"HTTP/1.1 200")   # (S's slot)
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {V}"}) as v:
            r = v.get("/datasets/v/snapshot")
        assert r.status_code == 200, r.text[:160]
        assert len(r.content) > _SharedSend.CHUNK and len(r.json()["shards"]) == 512
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {S}"}) as s:
            small = s.get("/datasets/small/snapshot")
            again = s.get("/datasets/s2/snapshot")
        assert small.status_code == 200, small.text[:160]
        assert len(small.content) <= _SharedSend.CHUNK
        assert again.status_code == 503 and again.json()["kind"] == "Busy", again.text[:160]
    finally:
        slow.close()
        server.stop()
