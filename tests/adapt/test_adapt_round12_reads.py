"""Red team round 12, findings 1 and 2: the reader thread's turns and its bound on queued reads
are by caller, a caller being a known token, else its client (made-up tokens are their
client's), and one caller's queued reads refuse only its own past its share of the bound."""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import httpx
import pytest

from stragglers.adapt import reads
from stragglers.adapt.errors import Busy

OWNER = "owner-round12-reads-token-0123456789"
SERVICE = "service-round12-reads-token-0123456789"


def test_a_read_key_is_a_known_token_else_the_client(tmp_path):
    """A data set owner's token and the service token are their own callers; a made-up token,
    a malformed one and none at all are the client's (its address; loopback's is shared)."""
    from stragglers.adapt.service import EmbeddedServer, _client_key, token_digest

    server = EmbeddedServer(tmp_path / "s.db", durable=False, service_token=SERVICE).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.post("/datasets", json={"name": "v", "num_samples": 64, "shard_size": 8},
                       headers={"Authorization": f"Bearer {OWNER}",
                                "X-Service-Token": SERVICE})
            assert r.status_code == 200, r.text

        def key(auth: bytes | None, host: str = "10.1.2.3"):
            headers = [] if auth is None else [(b"authorization", auth)]
            return server.app.read_key({"headers": headers, "client": (host, 4242)})

        client = _client_key({"client": ("10.1.2.3", 4242)})
        assert client[0] == "client"
        assert key(b"Bearer " + OWNER.encode()) == token_digest(OWNER)
        assert key(b"Bearer " + SERVICE.encode()) == token_digest(SERVICE)
        for made_up in (b"Bearer made-up-round12-0123456789", b"Bearer short", None):
            assert key(made_up) == client
        assert key(b"Bearer made-up-round12-0123456789", "10.9.9.9") != client
    finally:
        server.stop()


def test_one_callers_queued_reads_refuse_only_its_own_past_its_share(tmp_path):
    """max_queued 4, the reader held by a read: caller c queues 3 more (4 in all); callers v
    and x, with none queued, are admitted past the bound, c's next is Busy naming its own (its
    share 4 // callers), a fifth caller with none queued is admitted all the same (round 13:
    refused past twice the bound, a caller with none was refused for others' reads), and every
    admitted read runs once the thread is free."""
    db = str(tmp_path / "r.db")
    sqlite3.connect(db).close()
    side = reads.ReadSide(db, lambda name: 0, max_queued=4)
    held = threading.Event()
    try:
        blocker = side.submit(lambda conn: held.wait(60))

        async def main():
            def read(key, value):
                reads.READ_KEY.set(key)
                return asyncio.ensure_future(side.read(lambda conn: value))

            c_reads = [read("c", i) for i in range(3)]
            await asyncio.sleep(0)
            assert side._queued == 4 and not side.idle()
            v = read("v", "v")
            x = read("x", "x")
            await asyncio.sleep(0)
            assert side._queued == 6 and not v.done() and not x.done()
            with pytest.raises(Busy, match="3 of them this caller's"):
                await read("c", 99)
            new = read("new", "new")
            await asyncio.sleep(0)
            assert side._queued == 7 and not new.done()
            held.set()
            assert await asyncio.gather(*c_reads, v, x, new) == [0, 1, 2, "v", "x", "new"]
            assert side._queued == 0 and side._by_key == {} and side.idle()

        asyncio.run(main())
        assert blocker.result(60) is True
    finally:
        held.set()
        side.close()
