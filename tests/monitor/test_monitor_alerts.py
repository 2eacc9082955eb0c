"""Alert rules: parsing, k consecutive windows, per-worker identity, dedup, resolve, payload."""

from __future__ import annotations

import pytest

from stragglers.errors import InputError
from stragglers.monitor.alerts import AlertEngine, parse_rules
from stragglers.monitor.store import Store

RULES = parse_rules([
    {"name": "straggling", "when": "slowdown >= 1.1", "for_windows": 2},
    {"name": "fault", "when": "cause == worker_fault", "severity": "critical"},
    {"name": "new", "when": "new_cause", "severity": "info"},
    {"name": "stalled", "when": "state == stalled"},
])


def window(idx, s, causes=()):
    diag = [{"cause": c, "where": {"dp": [d], "pp": [p]}, "ranks": [r], "hosts": ["h"],
             "evidence": f"{c} at rank {r}", "headline": f"{c} at rank {r}"}
            for c, d, p, r in causes] or [{"cause": "none", "where": {}}]
    return {"job": "j", "idx": idx, "first_step": idx * 10, "last_step": idx * 10 + 9,
            "steps": list(range(idx * 10, idx * 10 + 10)), "slowdown": s, "waste": 1 - 1 / s,
            "t_base": 1.0, "t_ideal": 1.0, "sim_error": 0.0, "m_w": None, "m_s": None,
            "scores": [], "diagnosis": diag, "missing_ranks": [], "error": None,
            "reason": "complete", "closed_at": 0.0, "analysed_at": 0.0, "analysis_s": 0.0}


def feed(engine, store, w, now):
    alerts, log, msgs = engine.on_window("j", w, now)
    store.add_window(w, alerts, log)
    return msgs


def test_rules_fire_after_k_windows_once_and_resolve(tmp_path):
    store = Store(tmp_path / "a.db")
    store.register_job("j", str(tmp_path), "files", None)
    engine = AlertEngine(RULES, store, repeat_s=3600, external_url="http://mon:8150")
    fault = [("worker_fault", 1, 0, 2)]
    assert [m["alerts"][0]["labels"]["alertname"] for m in
            feed(engine, store, window(0, 1.4, fault), 1.0)] == ["fault", "new"]
    msgs = feed(engine, store, window(1, 1.4, fault), 2.0)    # 2nd window: straggling fires
    assert [(m["status"], m["alerts"][0]["labels"]["alertname"]) for m in msgs] == \
        [("firing", "straggling"), ("resolved", "new")]
    assert feed(engine, store, window(2, 1.4, fault), 3.0) == []      # no duplicates
    msgs = feed(engine, store, window(3, 1.01), 4.0)                  # all clear: resolves
    assert sorted((m["status"], m["alerts"][0]["labels"]["alertname"]) for m in msgs) == \
        [("resolved", "fault"), ("resolved", "straggling")]
    m = msgs[0]
    assert m["version"] == "4" and m["receiver"] and m["externalURL"] == "http://mon:8150"
    a = m["alerts"][0]
    assert set(a) == {"status", "labels", "annotations", "startsAt", "endsAt", "generatorURL",
                      "fingerprint"}
    assert a["endsAt"].endswith("Z") and a["generatorURL"] == "http://mon:8150/jobs/j"
    fault_alert = next(x for x in store.alerts(job="j") if x["rule"] == "fault")
    assert fault_alert["labels"]["rank"] == "2" and fault_alert["status"] == "resolved"
    log = [(e["rule"], e["status"]) for e in store.alert_log(job="j")][::-1]
    assert log == [("fault", "firing"), ("new", "firing"), ("straggling", "firing"),
                   ("new", "resolved"), ("fault", "resolved"), ("straggling", "resolved")]


def test_a_second_faulty_worker_is_its_own_alert_and_state_rules_follow_states(tmp_path):
    store = Store(tmp_path / "a.db")
    store.register_job("j", str(tmp_path), "files", None)
    engine = AlertEngine(RULES, store, repeat_s=3600)
    feed(engine, store, window(0, 1.3, [("worker_fault", 0, 0, 0)]), 1.0)
    msgs = feed(engine, store, window(1, 1.3, [("worker_fault", 0, 0, 0),
                                               ("worker_fault", 1, 1, 3)]), 2.0)
    fired = [m["alerts"][0]["labels"] for m in msgs if m["status"] == "firing"
             and m["alerts"][0]["labels"]["alertname"] == "fault"]
    assert [x["rank"] for x in fired] == ["3"]
    a, log, msgs = engine.on_state("j", "stalled", 3.0)
    store.add_alert_changes(a, log)
    assert [(m["status"], m["alerts"][0]["labels"]["alertname"]) for m in msgs] == \
        [("firing", "stalled")]
    a, log, msgs = engine.on_state("j", "running", 4.0)
    assert [(m["status"], m["alerts"][0]["labels"]["alertname"]) for m in msgs] == \
        [("resolved", "stalled")]


@pytest.mark.parametrize("rules, field", [
    ([{"name": "a", "when": "slowdown >= x"}], "rules[0].when"),
    ([{"name": "a", "when": "new_cause", "for_windows": 0}], "rules[0].for_windows"),
    ([{"name": "a", "when": "new_cause", "colour": "red"}], "rules[0].colour"),
    ([{"name": "a b", "when": "new_cause"}], "rules[0].name"),
    ([{"name": "a", "when": "cause == gc and speedup >= much"}], "rules[0].when"),
    ([{"name": "a", "when": "new_cause"}, {"name": "a", "when": "new_cause"}], "rules[1].name"),
    ([{"name": "a", "when": "new_cause", "severity": "loud"}], "rules[0].severity"),
    ({"name": "a"}, "rules"),
])
def test_bad_rules_name_the_field(rules, field):
    with pytest.raises(InputError) as err:
        parse_rules(rules, "rules.yaml")
    assert err.value.field == field and "rules.yaml" in str(err.value)
