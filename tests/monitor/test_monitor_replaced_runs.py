"""A job's row remembers every run newer runs replaced (replaced.py: the last 16 by name, all of
them in a Bloom filter of fixed size), so an old recorder's stale run (no `extra.started` to
order it by) whose token is past the last 16 cannot reset the current run: it was taken as a
new run and the current run's parts and windows were deleted."""

from __future__ import annotations

import httpx

from monitor_jobs import slow_job
from stragglers.monitor.replaced import MAX_SUPERSEDED, SEEN_BITS, read, was_replaced, \
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


def test_the_filter_is_of_fixed_size_reads_a_list_from_before_and_rarely_errs():
    text = '["old-a", "old-b"]'   # (a store before the filter: a JSON list)
    assert was_replaced(text, "old-a") and not was_replaced(text, "new")
    for n in range(1000):
        text = with_replaced(text, f"run-{n}")
    assert len(text) < 3000 and read(text).last[-1] == "run-999"
    assert len(read(text).last) == MAX_SUPERSEDED and len(read(text).seen) == SEEN_BITS // 8
    assert all(was_replaced(text, t) for t in ["old-a", "old-b", "run-0", "run-500"])
    # tokens never replaced that read as replaced after 1,000 runs: expected 5e-4 of them
    wrong = sum(was_replaced(text, f"fresh-{n}") for n in range(20_000))
    assert wrong <= 40, wrong
    assert not was_replaced("{damaged", "x") and read("{damaged").last == []
