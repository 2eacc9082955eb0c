"""Test helpers: a shard service on loopback with its reader thread held, slow snapshot readers."""

from __future__ import annotations

import contextlib
import socket
import sqlite3
import threading

import httpx


class HeldReader:
    """A shard service whose reader thread runs one read held until `held` is set: job V
    (`v`, its token) with data set v (worker w joined at `fence`), an anonymous client, and
    calls started on threads (their answers in `out` by name)."""

    def __init__(self, server, v: httpx.Client, anyone: httpx.Client):
        self.server, self.v, self.anyone = server, v, anyone
        self.reader = server.app.state.reader
        self.held = threading.Event()
        self.threads: list[threading.Thread] = []
        self.out: dict = {}
        self.fence = None
        self.blocker = None

    def start(self, name: str, call) -> None:
        """call() on a thread of its own, its answer kept as out[name]."""
        self.threads.append(threading.Thread(target=lambda: self.out.setdefault(name, call())))
        self.threads[-1].start()

    def release(self):
        """The held read let go, every started call joined: the held read's result."""
        self.held.set()
        for t in self.threads:
            t.join(60)
        return self.blocker.result(60)


@contextlib.contextmanager
def held_reader(tmp_path, token: str, config=None, verified: bool = True):
    """A HeldReader on a service storing tmp_path/s.db; `verified`: v's status read once before
    the thread is held (so that v's check is done, a read only). Everything stopped after."""
    from stragglers.adapt.service import EmbeddedServer

    server = EmbeddedServer(tmp_path / "s.db", durable=False, config=config).start()
    h = HeldReader(server, httpx.Client(base_url=server.url, timeout=60,
                                        headers={"Authorization": f"Bearer {token}"}),
                   httpx.Client(base_url=server.url, timeout=60))
    try:
        r = h.v.post("/datasets", json={"name": "v", "num_samples": 4096, "shard_size": 64})
        assert r.status_code == 200, r.text
        h.fence = h.v.post("/datasets/v/join", json={"worker": "w"}).json()["fence"]
        if verified:
            assert h.anyone.get("/datasets/v/status").status_code == 200
        h.blocker = h.reader.submit(lambda conn: h.held.wait(60))   # (the thread held)
        yield h
    finally:
        h.held.set()
        for t in h.threads:
            t.join(60)
        h.v.close()
        h.anyone.close()
        server.stop()


def with_errors(db, name: str, shards: int) -> None:
    """`name`'s shard rows with an error text of 1,000 characters each (~1 KB a shard, as
    retried ones carry: snapshots bigger than the loopback socket buffers)."""
    with sqlite3.connect(db) as conn:
        conn.execute("DELETE FROM shards WHERE dataset=?", (name,))
        conn.executemany(
            "INSERT INTO shards VALUES (?,0,?,?,?,'TODO',NULL,NULL,NULL,0,1,?,?)",
            ((name, s, 2 * s, 2 * s + 2, 1 + s, "e" * 1000) for s in range(shards)))
        conn.execute("UPDATE datasets SET materialized=NULL WHERE name=?", (name,))


def snapshot_head(slow: socket.socket, server, name: str, token: str) -> bytes:
    """GET `name`'s snapshot on `slow` (a 4 KiB receive buffer), reading its first 64 bytes
    only: the head sent, the body then not read."""
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect((server.host, server.port))
    slow.sendall(f"GET /datasets/{name}/snapshot HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"Authorization: Bearer {token}\r\n\r\n".encode())
    slow.settimeout(30)
    return slow.recv(64)


@contextlib.contextmanager
def two_workers(db, config, token_sha256: str):
    """A ShardStore of `db` on a clock of its own (now[0], from 1,000 s) with at most 2 workers
    a data set, data set `config` created and workers a and b joined: (store, now, a's fence,
    b's fence); the store closed after."""
    from stragglers.adapt.shards import ShardStore

    now = [1000.0]
    store = ShardStore(db, clock=lambda: now[0], max_workers_per_dataset=2)
    try:
        store.create_dataset(config, token_sha256)
        a = store.join(config.name, "a", token_sha256).fence
        yield store, now, a, store.join(config.name, "b", token_sha256).fence
    finally:
        store.close()
