"""Alerts that do not wait for a window, end to end: a real monitor server on loopback, parts
uploaded as recorders upload them, a real webhook receiver. A rank that turns 1.5× slower is
alerted by the fast detector a few steps after the onset (steps counted in the data, not wall
time), before its window's what-if attribution follows; a rank that stops sending, and then a
whole job, are alerted and resolved; the monitor's health is on /metrics."""

from __future__ import annotations

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, rank_of, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.trace.model import Trace
from stragglers.trace.runformat import table_bytes

pytestmark = pytest.mark.slow
ONSET = 30


class Receiver:
    """A webhook receiver on loopback that keeps every JSON body it is sent."""

    def __init__(self):
        bodies = self.bodies = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/api/v2/alerts"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def alerts(self, name: str, status: str | None = None) -> list[dict]:
        """The alerts of that name (and status) received so far, in order."""
        return [a for b in list(self.bodies) for a in b["alerts"]
                if a["labels"]["alertname"] == name and status in (None, a["status"])]

    def close(self):
        self.http.shutdown()


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


def serve(tmp_path, receiver, settings: str, rules: str = "") -> MonitorServer:
    config = tmp_path / "monitor.yaml"
    config.write_text(f"settings: {{{settings}}}\n{rules}webhooks: [\"{receiver.url}\"]\n")
    return MonitorServer(tmp_path / "mon.db", port=0, config_file=config).start()


def upload(c, job: str, parts) -> None:
    for rank, part, cols in parts:
        r = c.put(f"/api/jobs/{job}/ranks/{rank}/parts/{part}", content=table_bytes(cols))
        assert r.status_code == 200, r.text


def slowed_job() -> tuple[Trace, int]:
    """A dp 4 × pp 2 job whose worker (dp 2, stage 1) turns 1.5× slower at step ONSET (the
    same seed before and after: the same noise)."""
    clean = slow_job(steps=50, dp=4, pp=2, slow=None, seed=5)
    slowed = slow_job(steps=50, dp=4, pp=2, slow=(2, 1, 1.5), seed=5)
    before, after = clean.ops["step"] < ONSET, slowed.ops["step"] >= ONSET
    ops = {k: np.concatenate([clean.ops[k][before], slowed.ops[k][after]]) for k in clean.ops}
    return Trace(ops, clean.meta), rank_of(clean, 2, 1)


def test_a_rank_turning_slower_is_alerted_within_steps_then_attributed(tmp_path, receiver):
    trace, slow_rank = slowed_job()
    parts = parts_of(trace, steps_per_part=2)         # as flushed every second at 2 steps/s
    server = serve(tmp_path, receiver, "window_steps: 10, stall_after_s: 600, tick_s: 0.05, "
                   "change_warmup_steps: 10, change_baseline_steps: 30",
                   "rules:\n  - {name: worker_fault, when: \"cause == worker_fault\", "
                   "severity: critical}\n")
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict()).status_code == 200
            # the steps up to ONSET + 7: the window of steps 30-39 is not closed yet
            upload(c, "j", [p for p in parts if 2 * p[1] + 1 <= ONSET + 7])
            fast = eventually(lambda: receiver.alerts("rank_slowdown"), timeout=60,
                              what="the fast detector's alert")
            assert get(c, "/api/jobs/j")["windows_total"] == 3   # steps 0-29 only
            upload(c, "j", [p for p in parts if 2 * p[1] + 1 > ONSET + 7])
            attributed = eventually(lambda: receiver.alerts("worker_fault"), timeout=120,
                                    what="the window's attribution")
            text = c.get("/metrics").text
    finally:
        server.stop()
    assert len(fast) == 1 and fast[0]["status"] == "firing"
    labels, note = fast[0]["labels"], fast[0]["annotations"]
    assert (labels["rank"], labels["detector"], labels["dp"], labels["pp"]) == \
        (str(slow_rank), "fast", "2", "1")
    decided = int(re.search(r"decided at step (\d+)", note["description"])[1])
    since = int(re.search(r"since step (\d+)", note["summary"])[1])
    assert ONSET <= decided <= ONSET + 7 and abs(since - ONSET) <= 2, note
    assert attributed[0]["labels"]["rank"] == str(slow_rank)
    assert re.search(r'stragglers_alert_changes_total\{alertname="rank_slowdown",'
                     r'status="firing"\} 1\.0', text)
    for name in ("stragglers_ingest_lag_seconds", "stragglers_queue_depth{queue=\"analysis\"}",
                 "stragglers_alert_notifications_total{outcome=\"sent\"}",
                 "stragglers_last_analysis_timestamp_seconds",
                 "stragglers_store_errors_total{operation=\"ingest\"} 0.0",
                 "stragglers_window_analysis_seconds_bucket",
                 "stragglers_job_last_part_timestamp_seconds{job=\"j\"}"):
        assert name in text, name


def idle(monitor) -> None:
    """Until no part is queued or being stored: a tick while the ingest is behind by half
    stall_after_s (its last batch still closing windows, the reply sent) decides no silence,
    and no later tick comes here to decide it."""
    eventually(lambda: monitor.watchdog.ingest_lag() == 0.0, what="the ingest idle")


def test_a_silent_rank_then_a_silent_job_alert_and_resolve(tmp_path, receiver):
    trace = slow_job(steps=12, dp=2, pp=2, slow=None)
    parts = parts_of(trace, steps_per_part=1)
    # the test moves time itself (monitor.tick(now)), to the parts' arrivals; each tick comes
    # right after the ranks it must not find silent sent a part, and once the ingest is idle.
    # The tick thread ticks nothing: it wakes at dead-man deadlines and when a part takes an
    # overdue job's ranks past another's steps, and read the wall clock, which under load ran
    # past stall_after_s between the uploads (rank 1 was alerted silent so, load 13-30)
    server = serve(tmp_path, receiver, "window_steps: 4, stall_after_s: 1.0, "
                   "finish_after_s: 600, tick_s: 30")
    monitor = server.monitor
    tick = monitor.tick
    monitor.tick = lambda now=None: None if now is None else tick(now)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict()).status_code == 200
            upload(c, "j", [p for p in parts if p[1] < 3])
            heard = monitor.trackers["j"].ranks[3].last_arrival
            time.sleep(max(0.0, heard + 1.1 - time.time()))
            upload(c, "j", [p for p in parts if p[1] == 3 and p[0] != 3])
            # the job was quiet 1.1 s as a whole (its own silence: `stalled`), so its ranks'
            # silence counts from when it sent again (rank 0's part): the others' parts,
            # a moment after rank 0's, were not a silence of theirs
            tr = monitor.trackers["j"]
            assert tr.resumed_at is not None and tr.resumed_at >= heard + 1.0
            idle(monitor)
            monitor.tick(tr.resumed_at + 1.0)   # rank 3 quiet >= 1 s since, the job not
            silent = eventually(lambda: receiver.alerts("rank_silent"),
                                what="rank_silent")
            job = get(c, "/api/jobs/j")
            assert job["state"] == "running"
            assert [a["labels"]["rank"] for a in job["alerts"] if a["rule"] == "rank_silent"] \
                == ["3"]
            assert 'stragglers_silent_ranks{job="j"} 1.0' in c.get("/metrics").text
            upload(c, "j", [p for p in parts if p[1] == 3 and p[0] == 3]
                   + [p for p in parts if p[1] == 4])
            idle(monitor)
            monitor.tick(monitor.trackers["j"].last_arrival)
            eventually(lambda: receiver.alerts("rank_silent", "resolved"),
                       what="rank_silent resolved")
            # a job's ranks' last parts (of one step) come over a moment: none is silent
            tr = monitor.trackers["j"]
            idle(monitor)
            monitor.tick(min(tr.ranks[r].last_arrival for r in range(4)) + 1.0)
            assert not [a for a in monitor.store.alerts(job="j", status="firing")
                        if a.rule == "rank_silent"], \
                {r: tr.ranks[r].last_arrival for r in range(4)}
            # a monitor behind on its ingest (a batch queued 1 s ago still being stored) does
            # not take quiet for silence
            idle(monitor)
            monitor._ingest_started = time.monotonic() - 1.0
            monitor.tick(tr.last_arrival + 1.1)
            monitor._ingest_started = None
            assert monitor.states["j"] == "running"
            # the whole job falls silent: stalled, said by the API, /metrics and an alert
            idle(monitor)
            monitor.tick(monitor.trackers["j"].last_arrival + 1.1)
            eventually(lambda: receiver.alerts("stalled", "firing"), what="stalled")
            assert get(c, "/api/jobs/j")["state"] == "stalled"
            text = c.get("/metrics").text
            assert 'stragglers_job_state{job="j",state="stalled"} 1.0' in text
            assert re.search(r'stragglers_job_silence_seconds\{job="j"\} \d', text)
            upload(c, "j", [p for p in parts if p[1] == 5])      # parts come again
            eventually(lambda: receiver.alerts("stalled", "resolved"),
                       what="stalled resolved")
            assert get(c, "/api/jobs/j")["state"] == "running"
    finally:
        server.stop()
    assert [a["labels"]["rank"] for a in silent] == ["3"]
    assert [a["status"] for a in receiver.alerts("rank_silent")] == ["firing", "resolved"]
