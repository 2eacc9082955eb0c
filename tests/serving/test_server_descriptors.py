"""A service stopped in-process gives back every descriptor it opened: its listening socket and
each connection to its store. A pytest worker starts hundreds of them; the monitor's store
closed only its writing connection, and the reading one of each thread still alive (the one
that started and stopped it among them) kept the store's file and its WAL open: 4 descriptors a
service, past 1,024 in a long worker (select.select refused them in CI). Real servers on
127.0.0.1, real SQLite files; the descriptors are read from /proc/self/fd."""

from __future__ import annotations

import gc
import os
import socket
from pathlib import Path

import httpx
import pytest

from stragglers.adapt.service import EmbeddedServer
from stragglers.monitor.server import MonitorServer

if not os.path.isdir("/proc/self/fd"):
    pytest.skip("needs /proc/self/fd", allow_module_level=True)


def open_under(folder: Path) -> list[str]:
    """The files under `folder` this process holds a descriptor of."""
    gc.collect()   # (a connection only unreachable is closed by the collector, not leaked)
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:   # (closed meanwhile: the listing's own descriptor among them)
            continue
        if target.startswith(str(folder) + os.sep):
            found.append(target)
    return sorted(found)


def refused(port: int) -> bool:
    """Nothing listens on 127.0.0.1:port any more."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=30).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.parametrize("kind", ["monitor", "shard service"])
def test_a_stopped_service_holds_no_descriptor_of_its_store_nor_its_port(tmp_path, kind):
    store = tmp_path / "store"
    store.mkdir()
    server = (MonitorServer(store / "mon.db", port=0) if kind == "monitor"
              else EmbeddedServer(store / "shards.db")).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            for _ in range(3):
                assert c.get("/health").status_code == 200
        assert open_under(store)   # (it serves from there: the check can see them)
    finally:
        server.stop()
    assert open_under(store) == [], f"the stopped {kind} still holds its store's files open"
    assert refused(server.port), f"the stopped {kind} still listens"
