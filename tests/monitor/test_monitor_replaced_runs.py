"""A job's row remembers every run newer runs replaced (replaced.py: the last 16 by name, all of
them by hash), so an old recorder's stale run (no `extra.started` to
order it by) whose token is past the last 16 cannot reset the current run: it was taken as a
new run and the current run's parts and windows were deleted."""

from __future__ import annotations

import base64
import json

import httpx

from monitor_jobs import slow_job
from stragglers.monitor.replaced import MAX_SUPERSEDED, SEEN_BITS, _bits, read, was_replaced, \
    with_replaced
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

TOKEN = "replaced-runs-token-0123456789abcdef"


def test_a_stale_run_without_started_past_the_last_16_cannot_reset_the_current_run(tmp_path):
    trace = slow_job(steps=5, slow=None)

    def meta(n: int) -> dict:   # an old recorder's: a run token, no extra.started
        out = trace.meta.to_dict()
        out["extra"]["run"] = f"run-{n}"
        out["extra"].pop("started", None)
        return out

    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN,
                      config=MonitorConfig(window_steps=5, stall_after_s=600,
                                           tick_s=0.05)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            for n in range(MAX_SUPERSEDED + 2):
                assert c.put("/api/jobs/t/meta", json=meta(n)).status_code == 200
            current = f"run-{MAX_SUPERSEDED + 1}"
            mine = trace.ops["rank"] == 0
            r = c.put("/api/jobs/t/ranks/0/parts/0", headers={"X-Stragglers-Run": current},
                      content=table_bytes({k: v[mine] for k, v in trace.ops.items()}))
            assert r.status_code == 200, r.text
            assert "run-0" not in s.monitor.store.superseded("t")   # (past the last 16)
            # (before: 200, the job reset to run-0, run-17's part deleted)
            r = c.put("/api/jobs/t/meta", json=meta(0))
            assert r.status_code == 409 and r.json()["kind"] == "superseded_run", r.text
            assert s.monitor.store.job("t").meta["extra"]["run"] == current
            assert s.monitor.store.has_part("t", 0, 0)
            # its parts are told so too (before: 503 "not known yet", retried for good)
            r = c.put("/api/jobs/t/ranks/1/parts/0", content=b"x",
                      headers={"X-Stragglers-Run": "run-0"})
            assert r.status_code == 409 and r.json()["kind"] == "superseded_run", r.text
            # a new run of an old recorder still replaces the current one
            assert c.put("/api/jobs/t/meta", json=meta(99)).status_code == 200
            assert s.monitor.store.job("t").meta["extra"]["run"] == "run-99"
            assert not s.monitor.store.has_part("t", 0, 0)
    finally:
        s.stop()


def test_the_hashes_read_a_list_from_before_and_a_row_with_the_old_filter_keeps_it():
    text = '["old-a", "old-b"]'   # (a store before the filter: a JSON list)
    assert was_replaced(text, "old-a") and not was_replaced(text, "new")
    for n in range(1000):
        text = with_replaced(text, f"run-{n}")
    assert read(text).last[-1] == "run-999" and len(read(text).last) == MAX_SUPERSEDED
    assert len(read(text).hashes) == 1002 * 4 and read(text).seen is None
    assert all(was_replaced(text, t) for t in ["old-a", "old-b", "run-0", "run-500"])
    # (tokens never replaced read as replaced: tests/monitor/test_replaced_false_rate.py)
    assert not was_replaced("{damaged", "x") and read("{damaged").last == []
    # a row of the 2 KiB Bloom filter before the hashes: its tokens are still replaced
    seen = bytearray(SEEN_BITS // 8)
    for b in _bits("bloom-run"):
        seen[b >> 3] |= 1 << (b & 7)
    old = json.dumps({"last": [], "seen": base64.b64encode(bytes(seen)).decode()})
    text = with_replaced(old, "run-new")
    assert was_replaced(text, "bloom-run") and was_replaced(text, "run-new")
    assert read(text).seen == bytes(seen) and not was_replaced(text, "other")
