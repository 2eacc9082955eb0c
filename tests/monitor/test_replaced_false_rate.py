"""A job's replaced runs are kept so that a new run is read as replaced at most FALSE_BOUND
(1e-4) of the time at any count up to MAX_REPLACED (issue 34): the Bloom filter of fixed size
(2 KiB) read 2.3% of new runs as replaced after 2,000 replaced ones, nearly all after 20,000 —
and a new run read as replaced is refused (409 superseded_run), its uploader stopped."""

from __future__ import annotations

import sqlite3

import httpx

from monitor_jobs import slow_job
from stragglers.monitor.replaced import FALSE_BOUND, read, with_replaced
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig

TOKEN = "replaced-false-rate-token-0123456789abcdef"
FRESH = 10_000   # new tokens tried at each count: FALSE_BOUND allows 1 of them


def false_hits(text: str) -> int:
    r = read(text)
    return sum(r.has(f"fresh-{n}") for n in range(FRESH))


def test_new_tokens_read_as_replaced_stay_within_the_bound_at_2000_and_20000_runs():
    text = None
    for n in range(2_000):   # one replaced run at a time, as a store adds them
        text = with_replaced(text, f"run-{n}")
    r = read(text)
    assert all(r.has(f"run-{n}") for n in range(2_000))
    assert false_hits(text) <= FALSE_BOUND * FRESH   # (the old filter: 205 of 10,000)
    for start in range(2_000, 20_000, 1_000):
        text = with_replaced(text, *(f"run-{n}" for n in range(start, start + 1_000)))
    r = read(text)
    assert all(r.has(f"run-{n}") for n in range(0, 20_000, 19))
    assert r.last == [f"run-{n}" for n in range(19_984, 20_000)]
    assert false_hits(text) <= FALSE_BOUND * FRESH   # (the old filter: nearly all)
    assert len(text) < 20_000 * 4 * 4 / 3 + 1_000, len(text)   # (4 bytes a run, base64)


def test_new_runs_of_a_job_with_2000_replaced_ones_are_all_taken(tmp_path):
    trace = slow_job(steps=5, slow=None)

    def meta(run: str) -> dict:   # an old recorder's: a run token, no extra.started
        out = trace.meta.to_dict()
        out["extra"]["run"] = run
        out["extra"].pop("started", None)
        return out

    db = tmp_path / "mon.db"
    s = MonitorServer(db, port=0, token=TOKEN, config=MonitorConfig(
        window_steps=5, stall_after_s=600, tick_s=0.05)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            assert c.put("/api/jobs/t/meta", json=meta("current")).status_code == 200
            text = None
            for n in range(2_000):
                text = with_replaced(text, f"old-{n}")
            con = sqlite3.connect(db)
            with con:
                con.execute("UPDATE jobs SET superseded = ? WHERE job = 't'", (text,))
            con.close()
            # a replaced run is still refused, by its hash (past the last 16 named)
            r = c.put("/api/jobs/t/meta", json=meta("old-7"))
            assert r.status_code == 409 and r.json()["kind"] == "superseded_run", r.text
            # 100 new runs in turn, each replacing the one before: none refused (before,
            # 5 of them were 409 superseded_run, their data lost)
            refused = [n for n in range(100)
                       if c.put("/api/jobs/t/meta", json=meta(f"new-{n}")).status_code != 200]
            assert refused == [], refused
            assert s.monitor.store.job("t").meta["extra"]["run"] == "new-99"
    finally:
        s.stop()
