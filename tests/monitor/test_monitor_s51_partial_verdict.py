"""`partial` (a window that holds only some of the job's ranks) is the diagnosis's verdict, not a
cause: new_cause does not fire for it, and one stored firing for it resolves."""

from __future__ import annotations

import msgspec

from stragglers.monitor.alerts import AlertEngine, Annotations, _Active, fingerprint, parse_rules
from stragglers.monitor.records import Labels, WindowRow
from stragglers.monitor.store import Store

RULES = parse_rules([{"name": "new", "when": "new_cause", "severity": "info"}])
PARTIAL = {"cause": "partial", "evidence": "only 3 of 4 ranks were traced"}


def _window(idx: int, *findings: dict) -> WindowRow:
    return msgspec.convert({
        "job": "j", "idx": idx, "first_step": idx * 10, "last_step": idx * 10 + 9,
        "steps": list(range(idx * 10, idx * 10 + 10)), "slowdown": 1.01, "waste": 0.01,
        "diagnosis": list(findings), "missing_ranks": [3]}, WindowRow)


def _feed(engine: AlertEngine, store: Store, w: WindowRow, now: float) -> list:
    alerts, log, msgs = engine.on_window("j", w, now)
    store.add_window(w, alerts, log)
    return msgs


def _firing(store: Store) -> list[str | None]:
    return sorted(str(a.labels.cause) for a in store.alerts(job="j", status="firing"))


def test_partial_windows_fire_no_new_cause_and_a_real_cause_still_does(tmp_path):
    store = Store(tmp_path / "a.db")
    store.register_job("j", str(tmp_path), "files", None)
    engine = AlertEngine(RULES, store, repeat_s=3600)
    for i in range(3):   # (was: new_cause{cause="partial"} firing from the first, for good)
        assert _feed(engine, store, _window(i, PARTIAL), float(i)) == []
    assert _firing(store) == []
    fault = {"cause": "worker_fault", "where": {"dp": [1], "pp": [0]}, "ranks": [1],
             "speedup_if_fixed": 1.6}
    msgs = _feed(engine, store, _window(3, fault, PARTIAL), 3.0)
    assert [m["alerts"][0]["labels"]["cause"] for m in msgs] == ["worker_fault"]
    assert _firing(store) == ["worker_fault"]


def test_a_new_cause_alert_stored_firing_for_partial_resolves_at_the_next_window(tmp_path):
    store = Store(tmp_path / "a.db")
    store.register_job("j", str(tmp_path), "files", None)
    engine = AlertEngine(RULES, store, repeat_s=3600)
    _feed(engine, store, _window(0, PARTIAL), 0.0)
    # as a monitor before this change stored it (partial taken for a new cause)
    labels = Labels(alertname="new", job="j", severity="info", cause="partial")
    rows, log, _ = engine._apply("j", {fingerprint(labels): _Active(
        RULES[0], labels, Annotations(summary="job j: new cause partial"))}, {"new"}, 0.5, 0)
    store.add_alert_changes(rows, log)
    assert _firing(store) == ["partial"]
    msgs = _feed(engine, store, _window(1, PARTIAL), 1.0)   # still partial: it resolves
    assert [(m["status"], m["alerts"][0]["labels"]["cause"]) for m in msgs] == \
        [("resolved", "partial")]
    assert _firing(store) == []
