"""Red team round seventeen: the shard service's allowances multiplied by what one token may
create, its clients (ShardClient: the agent's, the controller's, the CLI's) facing a hostile or
broken server, and restores beside snapshots, each other and a kill -9 — real servers on
loopback (the service, and raw sockets playing a bad one), real SQLite, real processes.

Each hostile case must be refused (4xx/503) changing nothing, or answered cleanly; a client
facing a bad server fails in one line naming it, within its bounds, never hangs. Nothing is
timed but upper bounds that only a hang passes.
"""

from __future__ import annotations

import json
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest

OWNER = "owner-round17-token-0123456789"
OTHER = "other-round17-token-0123456789"
H = {"Authorization": f"Bearer {OWNER}"}


def _tables(db) -> dict:
    """Every row the service keeps of its data sets: what a refused request leaves as it was."""
    with sqlite3.connect(db) as c:
        return {t: sorted(map(repr, c.execute(f"SELECT * FROM {t}").fetchall()))
                for t in ("datasets", "shards", "workers", "lease_requests", "fence_floors")}


def _server(db, **settings):
    from stragglers.adapt.service import EmbeddedServer, ServiceConfig

    quick = ServiceConfig(refusal_delay_s=0.0, auth_failure_delay_s=0.0, **settings)
    return EmbeddedServer(db, durable=False, config=quick).start()


# --- allowances per token: worker names over all of a token's data sets ---------------------

def test_one_tokens_data_sets_keep_a_bounded_number_of_worker_names_in_all(tmp_path):
    # (fails before: each data set kept max_workers_per_dataset names of its own, so one token
    # kept 64 x 1,024, each name with its own allowances — held shards, 256 remembered replies,
    # work credit, two requests in progress of the token's allowance)
    db = tmp_path / "s.db"
    server = _server(db, max_workers_per_dataset=3, max_workers_per_token=4)
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=H) as c:
            for name in ("d1", "d2"):
                assert c.post("/datasets", json={"name": name, "num_samples": 40,
                                                 "shard_size": 4}).status_code == 200
            for ds, w in (("d1", "a"), ("d1", "b"), ("d1", "c"), ("d2", "a")):
                assert c.post(f"/datasets/{ds}/join", json={"worker": w}).status_code == 200
            before = _tables(db)
            r = c.post("/datasets/d2/join", json={"worker": "b"})
            assert r.status_code == 429, r.text
            body = r.json()
            assert body["kind"] == "QuotaExceeded" and "max_workers_per_token=4" in \
                body["error"], body
            assert _tables(db) == before, "a refused join changed the database"
            # a name joined before joins again; another token has places of its own
            assert c.post("/datasets/d2/join", json={"worker": "a"}).status_code == 200
            o = {"Authorization": f"Bearer {OTHER}"}
            assert c.post("/datasets", headers=o, json={"name": "o", "num_samples": 8,
                                                        "shard_size": 4}).status_code == 200
            assert c.post("/datasets/o/join", headers=o, json={"worker": "x"}
                          ).status_code == 200
            # a name of d2 that left holding nothing gives its place to a new one
            fence = c.post("/datasets/d2/join", json={"worker": "a"}).json()["fence"]
            assert c.post("/datasets/d2/release", json={"worker": "a", "fence": fence}
                          ).status_code == 200
            assert c.post("/datasets/d2/join", json={"worker": "b"}).status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        server.stop()


# --- clients facing a hostile or broken server -----------------------------------------------

class BadServer:
    """A loopback socket server answering every request with `reply(sock)`."""

    def __init__(self, reply):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.reply, self.stop = reply, threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                k, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._one, args=(k,), daemon=True).start()

    def _one(self, k: socket.socket) -> None:
        try:
            k.settimeout(5)
            k.recv(65536)
            self.reply(k, self.stop)
        except OSError:
            pass
        finally:
            k.close()

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


def _trickled_head(k, stop) -> None:
    k.sendall(b"HTTP/1.1 200 OK\r\n")
    while not stop.wait(0.2):   # a byte of header at a time, each read well inside its timeout
        k.sendall(b"X")


def _sent(data: bytes):
    def reply(k, stop) -> None:
        k.sendall(data)
        stop.wait(0.05)
    return reply


ERROR = b'{"error":"x","kind":"K","field":null}'
BROKEN = {
    "trickled head": (_trickled_head, "ServiceUnavailable", "timed out"),
    "redirect": (_sent(b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://10.0.0.1/\r\n"
                       b"Content-Length: 0\r\n\r\n"), "EnvironmentFailure", "never redirects"),
    "html": (_sent(b"HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: 6\r\n\r\n"
                   b"<html>"), "EnvironmentFailure", "not a Status reply"),
    "status line": (_sent(b"HTTQ/9 nonsense\r\n\r\n"), "ServiceUnavailable", "status line"),
    "reset": (lambda k, stop: k.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER,
                                           b"\x01\x00\x00\x00\x00\x00\x00\x00"),
              "ServiceUnavailable", "unreachable"),
    "short body": (_sent(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{\"s"),
                   "ServiceUnavailable", "complete message body"),
    "not the error shape": (_sent(b"HTTP/1.1 418 Teapot\r\nContent-Length: 4\r\n\r\n\x1b[2J"),
                            "InputError", r"\x1b"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_client_facing_a_broken_server_fails_in_one_line_within_its_bounds(case):
    # (the trickled head fails before: httpx bounds each read alone, and a head sent a byte
    # a read never ended — a worker's call hung for hours; the redirect: "not a Status
    # reply: Input data was truncated", its 3xx read as the reply)
    from stragglers.adapt.client import ShardClient

    reply, kind, words = BROKEN[case]
    bad = BadServer(reply)
    out: dict = {}
    client = ShardClient(bad.url, "d", "w", token=OWNER, retry_s=1, timeout_s=1)

    def call() -> None:
        try:
            out["r"] = client.status()
        except Exception as exc:  # noqa: BLE001 - what the test reads
            out["e"] = exc
    t = threading.Thread(target=call, daemon=True)
    try:
        t.start()
        t.join(30)   # (retry_s 1 + one timeout 1: a hang only fails this)
        assert not t.is_alive(), f"{case}: the client still waits after 30 s"
        exc = out.get("e")
        assert exc is not None, out
        line = str(exc)
        assert type(exc).__name__ == kind and words in line and "\n" not in line, \
            (case, type(exc).__name__, line)
        assert "\x1b" not in line   # (the server's bytes are escaped in the operator's line)
    finally:
        bad.close()
        client.close()
