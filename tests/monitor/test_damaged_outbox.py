"""A damaged alert_outbox row (a column of another type: a torn page, a bad restore, another
tool) is set aside on its own: the other jobs' messages are claimed and sent (one such row
raised out of every claim, whose rollback held every job's alerts, across restarts)."""

from __future__ import annotations

import sqlite3

import msgspec
import pytest

from stragglers.monitor.alerts import AlertEngine, parse_rules
from stragglers.monitor.records import WindowRow
from stragglers.monitor.store import open_store

RULES = parse_rules([{"name": "straggling", "when": "slowdown >= 1.1", "for_windows": 1}])
DAMAGE = {"alert a blob": "X'00ff'", "job a blob": "X'00'"}


def _window(job: str, idx: int, s: float) -> WindowRow:
    return msgspec.convert({
        "job": job, "idx": idx, "first_step": idx * 10, "last_step": idx * 10 + 9,
        "steps": list(range(idx * 10, idx * 10 + 10)), "slowdown": s, "waste": 1 - 1 / s,
        "scores": [{"dp": 0, "pp": 0, "rank": 0, "host": "h", "score": s}],
        "diagnosis": [{"cause": "none"}], "closed_at": 1.0, "analysed_at": 2.0}, WindowRow)


def _damaged_row(path, what: str) -> None:
    """An undelivered message of job A, older than any other, its `what` of another type."""
    alert, job = (DAMAGE[what], "'jobA'") if what == "alert a blob" else ("'{}'", DAMAGE[what])
    with sqlite3.connect(path) as db:
        db.execute(f"INSERT INTO alert_outbox (job, fingerprint, status, sent_at, alert, "
                   f"created_at) VALUES ({job}, 'deadbeefdeadbeef', 'firing', 1.0, {alert}, 1.0)")
    db.close()


@pytest.mark.parametrize("what", sorted(DAMAGE))
def test_a_damaged_message_is_set_aside_and_the_others_are_claimed(tmp_path, what):
    path = tmp_path / "mon.db"
    store = open_store(str(path))
    try:
        store.register_job("jobB", "/runs/jobB", "http", None)
        _damaged_row(path, what)
        engine = AlertEngine(RULES, store, repeat_s=3600)
        rows, log, _ = engine.on_window("jobB", _window("jobB", 0, 1.5), now=5.0)
        store.add_window(_window("jobB", 0, 1.5), rows, log)
        claimed = store.claim_messages("A", 10, claim_s=60.0)
        assert [(m.job, m.status) for m in claimed] == [("jobB", "firing")]
        store.message_sent(claimed[0].id, "A")
        # the damaged one is given up on (failed), not claimed again at the next poll
        with sqlite3.connect(path) as db:
            failed = db.execute("SELECT failed_at FROM alert_outbox WHERE fingerprint = "
                                "'deadbeefdeadbeef'").fetchone()[0]
        db.close()
        assert failed is not None
        assert store.damaged_messages == 1
        assert store.claim_messages("A", 10, claim_s=60.0) == []
    finally:
        store.close()
    again = open_store(str(path))   # and after a restart: nothing held back
    try:
        engine = AlertEngine(RULES, again, repeat_s=3600)
        rows, log, _ = engine.on_window("jobB", _window("jobB", 1, 1.0), now=6.0)
        again.add_window(_window("jobB", 1, 1.0), rows, log)
        assert [m.status for m in again.claim_messages("A", 10, claim_s=60.0)] == ["resolved"]
    finally:
        again.close()


def test_a_dead_man_message_behind_a_damaged_row_of_its_own_is_left_to_the_outbox(tmp_path):
    """add_dead_man claims what it decided; a damaged row in that message's place (its
    fingerprint, status and time) does not fail the silence's transaction."""
    path = tmp_path / "mon.db"
    store = open_store(str(path))
    try:
        store.register_job("jobB", "/runs/jobB", "http", None)
        engine = AlertEngine(RULES, store, repeat_s=3600)
        rows, log, _ = engine.on_window("jobB", _window("jobB", 0, 1.5), now=5.0)
        a = rows[0]
        # the message add_dead_man will queue is there already, its alert a blob
        with sqlite3.connect(path) as db:
            db.execute("INSERT INTO alert_outbox (job, fingerprint, status, sent_at, alert, "
                       "created_at) VALUES ('jobB', ?, ?, ?, X'00ff', 1.0)",
                       (a.fingerprint, a.status, a.last_sent))
        db.close()
        got = store.add_dead_man("jobB", "stalled", rows, log, None, "A", 60.0)
        assert got == []   # stored, nothing claimed to send now
        assert store.job("jobB").state == "stalled"
        store.message_failed(store.outbox("jobB")[0].id, -1.0)   # its claim handed back
        assert store.claim_messages("A", 10, claim_s=60.0) == []   # set aside, not sent
        assert store.damaged_messages == 1
    finally:
        store.close()


def test_the_monitors_sender_delivers_past_a_damaged_row_and_counts_it(tmp_path):
    """Through the monitor's own outbox sender to a real receiver on loopback: the other
    job's message is posted and marked delivered, the damaged one counted in /metrics."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from stragglers.monitor.service import Monitor
    from stragglers.monitor.settings import MonitorConfig

    got = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    path = tmp_path / "mon.db"
    store = open_store(str(path))
    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    mon = Monitor(store, MonitorConfig(change_detector=False), data_dir=tmp_path / "up")
    try:
        store.register_job("jobB", "/runs/jobB", "http", None)
        _damaged_row(path, "alert a blob")
        rows, log, _ = mon.alerts.on_window("jobB", _window("jobB", 0, 1.5), now=5.0)
        store.add_window(_window("jobB", 0, 1.5), rows, log)
        mon.outbox.webhooks = [f"http://127.0.0.1:{http.server_address[1]}/"]
        mon.outbox.poll()   # (what the sender thread does at each poll)
        assert [[a["labels"]["job"] for a in p["alerts"]] for p in got] == [["jobB"]]
        assert [r.delivered_at is not None for r in store.outbox("jobB")] == [True]
        assert 'stragglers_alert_notifications_total{outcome="damaged"} 1.0' in \
            mon.metrics.render().decode()
    finally:
        mon.stop()
        http.shutdown()
        store.close()
