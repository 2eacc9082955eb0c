"""Snapshots sent to callers without the owner's token are paced (their CPU, and the
service's sends, on the same cores slowed other jobs' leases), and the owner's own snapshot
never waits for theirs."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from stragglers.adapt.service import EmbeddedServer, ServiceConfig

OWNER = {"Authorization": "Bearer owner-token-0123456789"}


@pytest.mark.slow
def test_a_strangers_snapshot_is_paced_and_the_owner_does_not_wait_for_it(tmp_path):
    rate = float(1 << 20)
    srv = EmbeddedServer(tmp_path / "s.db",
                         config=ServiceConfig(stranger_snapshot_bytes_per_s=rate)).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/datasets", headers=OWNER,
                       json={"name": "big", "num_samples": 65_536, "shard_size": 1})
            assert r.status_code == 200, r.text
            size = len(c.get("/datasets/big/snapshot", headers=OWNER).content)
            assert size > 1 << 20   # sent at the stranger's pace: 1 s or more
            started, stranger = threading.Event(), {}

            def anonymous():
                t0 = time.perf_counter()
                with httpx.stream("GET", f"{srv.url}/datasets/big/snapshot", timeout=60) as s:
                    got = 0
                    for chunk in s.iter_bytes():
                        got += len(chunk)
                        started.set()
                stranger.update(bytes=got, took=time.perf_counter() - t0,
                                done=time.perf_counter())

            t = threading.Thread(target=anonymous)
            t.start()
            assert started.wait(30)
            r = c.get("/datasets/big/snapshot", headers=OWNER)   # while the stranger's is sent
            owner_done = time.perf_counter()
            assert r.status_code == 200 and len(r.content) == size
            t.join(60)
            assert stranger["bytes"] == size
            assert stranger["took"] >= 0.8 * size / rate, stranger
            assert owner_done < stranger["done"], "the owner's snapshot waited for a stranger's"
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_client_that_stops_reading_a_snapshot_does_not_hold_the_send_slot(tmp_path):
    config = ServiceConfig(send_timeout_s=0.5, stranger_snapshot_bytes_per_s=float(1 << 30))
    srv = EmbeddedServer(tmp_path / "s.db", config=config).start()
    stalled = []
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.post("/datasets", headers=OWNER, json={
                "name": "big", "num_samples": 65_536, "shard_size": 1}).status_code == 200
            for _ in range(2):   # 2 × 20 snapshots asked, none read: more than socket buffers
                k = socket.socket()
                k.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                k.connect(("127.0.0.1", srv.port))
                k.sendall(b"GET /datasets/big/snapshot HTTP/1.1\r\nHost: localhost\r\n\r\n" * 20)
                stalled.append(k)
            time.sleep(1.0)
            # another stranger's snapshot waited for ever behind them
            r = httpx.get(f"{srv.url}/datasets/big/snapshot", timeout=30)
            assert r.status_code in (200, 503), r.text[:200]
            if r.status_code == 503:   # its turn came past max_read_wait_s: a clean refusal
                assert r.json()["kind"] == "Busy"
            assert c.get("/health").status_code == 200
    finally:
        for k in stalled:
            k.close()
        srv.stop()
