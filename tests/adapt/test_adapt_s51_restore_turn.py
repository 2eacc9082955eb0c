"""A restore whose head found the service's restore slot free, and whose body came after another
restore took it, waits its turn (bounded by restore_wait_s) instead of a 503 (session 51)."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import pytest

from conftest import readable
from stragglers.adapt.errors import Busy
from stragglers.adapt.paced import PacedWriter
from stragglers.adapt.service import EmbeddedServer

A, B = "restore-turn-token-a-0123456789", "restore-turn-token-b-0123456789"


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _created(url: str, token: str, name: str) -> bytes:
    """Data set `name` of `token`, its snapshot (a restore body)."""
    with httpx.Client(base_url=url, timeout=60, headers=_bearer(token)) as c:
        r = c.post("/datasets", json={"name": name, "num_samples": 64, "shard_size": 8})
        assert r.status_code == 200, r.text
        return c.get(f"/datasets/{name}/snapshot").content


def _head(port: int, name: str, token: str, size: int) -> socket.socket:
    """A restore's head, admitted (its 100 Continue read): its checks passed, body not sent."""
    k = socket.create_connection(("127.0.0.1", port), timeout=60)
    k.sendall(f"POST /datasets/{name}/restore HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization:"
              f" Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n"
              "Expect: 100-continue\r\nConnection: close\r\n\r\n".encode())
    assert k.recv(64).startswith(b"HTTP/1.1 100"), "the restore's head was not admitted"
    return k


def _reply(k: socket.socket) -> bytes:
    data = b""
    while chunk := k.recv(65536):
        data += chunk
    return data


def test_a_restore_whose_slot_was_taken_after_its_head_waits_its_turn(tmp_path):
    # (fails before: A's restore was 503 Busy "a restore is under way", its body thrown away)
    srv = EmbeddedServer(tmp_path / "s.db", durable=False).start()
    paced = srv.app.state.paced
    gate, held = threading.Event(), threading.Event()
    k = None
    try:
        snap_a, snap_b = _created(srv.url, A, "a"), _created(srv.url, B, "b")
        k = _head(srv.port, "a", A, len(snap_a))   # (the slot free: its head passes)
        # B's restore takes the slot and is held in it: its reserve waits on the reserve's
        # thread behind this gate
        paced.space.submit(lambda: (held.set(), gate.wait(60)))
        assert held.wait(30)
        result: list[httpx.Response] = []
        t = threading.Thread(target=lambda: result.append(httpx.post(
            f"{srv.url}/datasets/b/restore", content=snap_b, timeout=120,
            headers={**_bearer(B), "Content-Type": "application/json"})))
        t.start()
        try:
            for _ in range(600):   # (a bound against a hang: B's call takes the slot)
                if paced.in_all.requests or not t.is_alive():
                    break
                t.join(0.05)
            assert paced.in_all.requests == {None: 1}, "B's restore did not take the slot"
            k.sendall(snap_a)   # A's body comes while B holds the slot
            for _ in range(600):   # until A waits for its turn, or is answered
                if getattr(paced, "_waiting", None) or readable([k], 0.05):
                    break
            assert not readable([k], 0), \
                f"A was answered while B held the slot: {_reply(k)[:200]!r}"
        finally:
            gate.set()
            t.join(120)
        assert result and result[0].status_code == 200, result and result[0].text
        reply = _reply(k)
        assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
        assert paced.in_all.requests == {} and not paced._waiting
    finally:
        gate.set()
        if k is not None:
            k.close()
        srv.stop()


def test_restores_wait_for_the_slot_in_turn_and_at_most_their_bound():
    # the writer's slots alone (PacedWriter.writing): first come, first served, a slot given
    # back goes straight to the restore that waited longest (a head meanwhile finds none
    # free), and one that waited its bound is Busy naming it, its place given up
    async def run() -> None:
        w = PacedWriter(None, None, in_all=1)
        try:
            first = await w.writing(0)
            with pytest.raises(Busy, match="restore_wait_s"):
                await w.writing(0)
            assert not w._waiting
            order: list[str] = []

            async def waits(who: str) -> None:
                slot = await w.writing(60)
                order.append(who)
                slot.close()
            second = asyncio.create_task(waits("second"))
            await asyncio.sleep(0)
            third = asyncio.create_task(waits("third"))
            await asyncio.sleep(0)
            assert len(w._waiting) == 2
            first.close()
            with pytest.raises(Busy):   # (handed on: not free for a head in between)
                w.check_writing()
            await asyncio.gather(second, third)
            assert order == ["second", "third"]
            assert w.in_all.requests == {} and not w._waiting
            w.check_writing()
        finally:
            w.close()
    asyncio.run(asyncio.wait_for(run(), 30))
