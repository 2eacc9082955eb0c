"""The default alert rules leave no cause unwatched (round 13, finding 2): S leaves launch
delays out, so every cause whose fix is a launch delay's has a default rule of its own, and
`new_cause` stays firing while its cause is found."""

from __future__ import annotations

import ast

import msgspec

from conftest import REPO
from stragglers.monitor.alerts import DEFAULT_RULES, LAUNCH_DELAY_CAUSES, AlertEngine, \
    parse_rules
from stragglers.monitor.records import WindowRow
from stragglers.monitor.store import Store


def _delay_causes() -> set[str]:
    """The causes whatif/causes/ build as a Candidate with a launch-delay fix (`delay=`)."""
    found = set()
    for path in (REPO / "src" / "stragglers" / "whatif" / "causes").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Candidate" \
                    and any(k.arg == "delay" for k in node.keywords):
                first = node.args[0]
                assert isinstance(first, ast.Constant), (path, ast.dump(first))
                found.add(first.value)
    return found


def test_every_launch_delay_cause_has_a_default_rule():
    assert _delay_causes() == set(LAUNCH_DELAY_CAUSES) == {"host_stall"}
    ruled = {r.subject for r in parse_rules(None) if r.kind == "cause"}
    assert set(LAUNCH_DELAY_CAUSES) <= ruled, ruled
    assert {r["name"] for r in DEFAULT_RULES} >= {"host_stall", "new_cause"}


def _window(idx: int, causes: list[tuple[str, float]]) -> WindowRow:
    """A window read S 1.005 (launch delays out) with these (cause, speedup) at rank 0."""
    diag = [{"cause": c, "where": {"dp": [0], "pp": [0], "workers": [
        {"dp": 0, "pp": 0, "rank": 0, "host": "h"}]}, "ranks": [0], "hosts": ["h"],
        "speedup_if_fixed": x, "evidence": f"{c} at rank 0", "headline": f"{c} at rank 0"}
        for c, x in causes] or [{"cause": "none", "where": {}}]
    return msgspec.convert({
        "job": "j", "idx": idx, "first_step": idx * 5, "last_step": idx * 5 + 4,
        "steps": list(range(idx * 5, idx * 5 + 5)), "slowdown": 1.005, "waste": 0.005,
        "t_base": 1.0, "t_ideal": 1.0, "sim_error": 0.0, "m_w": None, "m_s": None,
        "scores": [], "diagnosis": diag, "missing_ranks": [], "error": None,
        "reason": "complete", "closed_at": 0.0, "analysed_at": 0.0, "analysis_s": 0.0},
        WindowRow)


def test_a_lasting_host_stall_fires_and_new_cause_stays_while_it_lasts(tmp_path):
    store = Store(tmp_path / "a.db")
    store.register_job("j", str(tmp_path), "http", None)
    engine = AlertEngine(parse_rules(None), store, repeat_s=3600)
    firing = []
    for i, causes in enumerate([[("host_stall", 2.35)]] * 4 + [[]]):
        w = _window(i, causes)
        rows, log, _ = engine.on_window("j", w, now=float(i))
        store.add_window(w, rows, log)
        firing.append(sorted((a.rule, a.labels.rank) for a in store.alerts(job="j",
                                                                            status="firing")))
    # new_cause from window 0 to the last window with the stall (it resolved at window 1);
    # host_stall (warning, at rank 0) from the third window in a row; both resolve after
    assert firing == [[("new_cause", None)], [("new_cause", None)],
                      [("host_stall", "0"), ("new_cause", None)],
                      [("host_stall", "0"), ("new_cause", None)], []], firing
    # a stall that buys less than the straggling threshold is no warning
    engine2 = AlertEngine(parse_rules(None), store2 := Store(tmp_path / "b.db"), 3600)
    store2.register_job("j", str(tmp_path), "http", None)
    for i in range(4):
        w = _window(i, [("host_stall", 1.05)])
        rows, log, _ = engine2.on_window("j", w, now=float(i))
        store2.add_window(w, rows, log)
    assert {a.rule for a in store2.alerts(job="j", status="firing")} == {"new_cause"}
    store.close()
    store2.close()
