"""A writer's changed meta.json bodies are paced while another job uploads parts: 4 at once,
then meta_changes_per_minute, a change further off than META_CHANGE_MAX_WAIT_S answered 429
with Retry-After (nothing stored). Two clients each changing their job's 48 KB meta.json
before every part made another job's uploads 3.9x slower (benchmarks/monitor_dos.py case
16): each change is a check of every value, a rewrite and fsync of the file, the store's row
and the monitor's lock. Alone (no other job uploading) and unchanged bodies are not paced.
Counted, not timed: the pace is one change per 10 minutes here. Real monitor on loopback."""

from __future__ import annotations

import httpx
import pytest

import stragglers.monitor.ingest_http as ingest_http
from monitor_jobs import get, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes
from monitor_jobs import parts_of

TOKEN = "round47-meta-pace-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05,
                    meta_changes_per_minute=0.1)


@pytest.fixture
def server(tmp_path, monkeypatch):
    # (a refusal waits this long before it is answered; another job counts as uploading
    # for this long after its part: the test does not depend on how fast it runs)
    monkeypatch.setattr(ingest_http, "META_CHANGE_MAX_WAIT_S", 0.05)
    monkeypatch.setattr(ingest_http, "META_ACTIVE_S", 3600.0)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        yield s
    finally:
        s.stop()


def test_meta_changes_are_paced_while_another_job_uploads(server):
    trace = slow_job(steps=5)
    meta = trace.meta.to_dict()
    with httpx.Client(base_url=server.url, timeout=60, headers=AUTH) as c:
        # alone: a writer changing its job's meta.json is not paced (a run's own rewrites,
        # a test filling a disk with them)
        for i in range(6):
            meta["extra"]["note"] = f"alone {i}"
            assert c.put("/api/jobs/a/meta", json=meta).status_code == 200
        # another job uploads a part: from now on a's changes are paced
        assert c.put("/api/jobs/b/meta", json=trace.meta.to_dict()).status_code == 200
        rank, part, cols = parts_of(trace, 5)[0]
        r = c.put(f"/api/jobs/b/ranks/{rank}/parts/{part}", content=table_bytes(cols))
        assert r.status_code == 200, r.text
        answers = []
        for i in range(6):
            meta["extra"]["note"] = f"paced {i}"
            r = c.put("/api/jobs/a/meta", json=meta)
            answers.append(r.status_code)
        assert answers == [200] * 4 + [429] * 2, answers   # (fails before: 200 each time)
        assert int(r.headers["retry-after"]) >= 60, r.headers
        assert "meta_changes_per_minute" in r.json()["error"]
        # the refused change stored nothing: the job keeps the last one taken
        assert get(c, "/api/jobs/a")["job"] == "a"
        assert server.store.job("a").meta["extra"]["note"] == "paced 3"
        # the same body again is not a change: answered, not paced
        meta["extra"]["note"] = "paced 3"
        assert c.put("/api/jobs/a/meta", json=meta).status_code == 200
