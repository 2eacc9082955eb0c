"""Run identity (session 47, red team round 9 F7/F8/F8b): a part is acknowledged only under its
own run, 409 superseded_run only for a run the job's row lists as replaced, and a reset deletes
nothing when the new run's registration is refused. Real monitor on loopback, real SQLite, the
recorder's own uploader."""

from __future__ import annotations

import sys

import httpx
import pytest

from conftest import REPO, eventually
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import JobConflict, open_store
from stragglers.monitor.store_base import superseded_tokens
from stragglers.record.upload import PartUploader
from stragglers.trace.runformat import table_bytes

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import parts_of, slow_job  # noqa: E402

TOKEN = "run-identity-round47-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CONFIG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


def run_meta(trace, start: float, token: bool = True) -> dict:
    """`trace`'s meta.json as a run started at `start` sends it (its run token: run-START)."""
    meta = trace.meta.to_dict()
    meta["extra"]["clock"] = {"start": [start] * meta["world_size"]}
    if token:
        meta["extra"]["run"] = f"run-{start:.0f}"
    return meta


@pytest.fixture
def monitor(tmp_path):
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CONFIG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=AUTH) as c:
            yield s, c
    finally:
        s.stop()


def test_the_uploader_keeps_a_new_runs_part_sent_before_its_meta_and_stops_for_a_replaced_one(
        monitor):
    # (it was answered 409 superseded_run, on which the uploader dropped its buffer for good)
    s, c = monitor
    trace = slow_job(steps=6, slow=None)
    rank, n, cols = parts_of(trace, 6)[1]
    assert c.put("/api/jobs/t/meta", json=run_meta(trace, 1000)).status_code == 200
    up = PartUploader(s.url, TOKEN, "t", rank, run="run-2000", backoff_s=0.05,
                      max_backoff_s=0.2)
    try:
        up.submit(n, table_bytes(cols))
        # answered 503 while run-2000 is not announced: kept, sent again
        eventually(lambda: up.stats().retries >= 1 or up.superseded, what="an answer")
        assert not up.superseded and up.pending == 1 and up.stats().rejected == 0
        assert "503" in (up.stats().last_error or "")
        assert c.put("/api/jobs/t/meta", json=run_meta(trace, 2000)).status_code == 200
        assert up.drain(timeout=30.0), up.stats()
        assert up.stats().sent == 1 and up.stats().rejected == 0
    finally:
        up.close(timeout=1.0)
    # a part of the replaced run (run-1000, now in the job's row) is definitely refused
    old = PartUploader(s.url, TOKEN, "t", rank, run="run-1000", backoff_s=0.05)
    try:
        old.submit(n + 1, table_bytes(cols))
        old.drain(timeout=30.0)
        assert old.superseded and old.stats().rejected == 1
    finally:
        old.close(timeout=1.0)


def test_a_tokenless_rewrite_of_the_current_run_keeps_its_token(monitor):
    # (stored without it, the run's own parts, which carry it, would be taken as another run's)
    _, c = monitor
    trace = slow_job(steps=6, slow=None)
    rank, n, cols = parts_of(trace, 6)[1]
    assert c.put("/api/jobs/t/meta", json=run_meta(trace, 2000)).status_code == 200
    r = c.put("/api/jobs/t/meta", json=run_meta(trace, 2000, token=False))
    assert r.status_code == 200, r.text
    r = c.put(f"/api/jobs/t/ranks/{rank}/parts/{n}", content=table_bytes(cols),
              headers={"X-Stragglers-Run": "run-2000"})
    assert r.status_code == 200, r.text
    # a tokenless meta.json of another start clock cannot replace it: refused, nothing changed
    r = c.put("/api/jobs/t/meta", json=run_meta(trace, 1000, token=False))
    assert r.status_code == 409 and r.json()["kind"] == "superseded_run", r.text
    r = c.put(f"/api/jobs/t/ranks/{rank}/parts/{n}", content=table_bytes(cols),
              headers={"X-Stragglers-Run": "run-2000"})
    assert r.status_code == 200 and r.json()["status"] == "duplicate", r.text


def test_a_reset_refused_at_registration_deletes_nothing(tmp_path):
    # (the old run's deletion was committed in its own transaction before the registration,
    # which could then be refused: the PUT refused, the old run's parts already gone)
    store = open_store(str(tmp_path / "mon.db"))
    store.register_job("j", "/runs/j", "files", {"extra": {"run": "r0"}})
    store.add_parts([("j", 0, 0, 5, 0, 4, 100, "files")])
    with pytest.raises(JobConflict):
        store.reset_job("j", {"extra": {"run": "r1"}}, [], [],
                        token_of=lambda m: m["extra"]["run"], directory="/elsewhere/j",
                        way="files")
    assert store.has_part("j", 0, 0)
    row = store.job("j")
    assert row.meta == {"extra": {"run": "r0"}} and superseded_tokens(row.superseded) == []
    assert store.reset_job("j", {"extra": {"run": "r1"}}, [], [],
                           token_of=lambda m: m["extra"]["run"], directory="/runs/j",
                           way="files")
    assert not store.has_part("j", 0, 0) and store.superseded("j") == ["r0"]
