"""Cases a hostile or unlucky client found (issue 34, red team): a job name ending in a
newline, sizes whose product is 10^16 ranks, a request with two Host headers, the same new
job's meta.json sent at once with different contents."""

from __future__ import annotations

import json
import socket
import threading

import httpx
import pytest

from monitor_jobs import slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig

TOKEN = "names-races-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def server(tmp_path):
    config = MonitorConfig(window_steps=5, tick_s=0.05, stall_after_s=600)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=config).start()
    yield s
    s.stop()


@pytest.mark.slow
def test_names_hosts_and_concurrent_metas(server):
    meta = slow_job(steps=5).meta.to_dict()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        # `$` of a pattern matches before a final newline: 'd\n' was a job (and a directory)
        r = c.put("/api/jobs/d%0A/meta", json=meta, headers=AUTH)
        assert r.status_code == 422 and "not a valid job name" in r.json()["error"], r.text
        r = c.put("/api/jobs/d%0A/ranks/0/parts/0", content=b"PAR1", headers=AUTH)
        assert r.status_code == 422, r.text
        assert not (server.monitor.data_dir / "d\n").exists()
        # sizes whose product is 10^16 ranks (each size within its bound): no upload could
        # ever complete such a job (ranks stop at 9,999,999)
        r = c.put("/api/jobs/huge/meta", json={**meta, "dp_size": 10**6, "pp_size": 10**5,
                                              "tp_size": 10**5, "world_size": 0}, headers=AUTH)
        assert r.status_code == 422 and "world_size" in r.json()["error"], r.text

        # two Host headers: one proxy reads the first, another the last (RFC 9112: 400)
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as k:
            k.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n\r\n")
            head = k.recv(4096)
        assert head.startswith(b"HTTP/1.1 400") and b"given more than once" in head, head[:300]

        # one new job's meta.json, nine at once with three contents: each answered (no 5xx:
        # they shared a temp file), and the file on disk is the one the store holds
        answers = []

        def put(dp: int) -> None:
            with httpx.Client(base_url=server.url, timeout=60) as mine:
                answers.append(mine.put("/api/jobs/cm/meta", json={**meta, "dp_size": dp,
                                        "world_size": 0}, headers=AUTH).status_code)

        threads = [threading.Thread(target=put, args=(dp,)) for dp in (1, 2, 4) * 3]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(a < 500 for a in answers) and 200 in answers, answers
        on_disk = json.loads((server.monitor.data_dir / "cm" / "meta.json").read_text())
        assert on_disk["dp_size"] == server.store.job("cm").meta["dp_size"]
        assert not list((server.monitor.data_dir / "cm").glob("*.tmp"))
        assert c.get("/health").status_code == 200
