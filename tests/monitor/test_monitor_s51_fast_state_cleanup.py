"""What a firing fast alert fired against (fast_state rows) goes when that alert resolves, however
it resolves — the job finishing, a new run — not only when the detector resolves it."""

from __future__ import annotations

from stragglers.monitor import fast_state
from stragglers.monitor.alerts import AlertEngine, parse_rules
from stragglers.monitor.changes import Change
from stragglers.monitor.store import Store

STATE = fast_state.FiredState(frozen=0.01, base=[0.0] * 20, ratio=3.0, since_step=40,
                              at_step=45)


def _firing_rank(tmp_path, job: str) -> tuple[Store, AlertEngine]:
    store = Store(tmp_path / "a.db")
    for name in (job, "other"):
        store.register_job(name, str(tmp_path / name), "files", None)
        fast_state.save(store, name, {3: STATE, 5: STATE})
        engine = AlertEngine(parse_rules([]), store, repeat_s=3600)
        rows, log, _ = engine.on_changes(name, {r: Change(r, "firing", 3.0, 40, 45)
                                                for r in (3, 5)}, {3, 5}, {})
        store.add_alert_changes(rows, log)
    assert sorted(fast_state.load(store, job)) == [3, 5]
    return store, engine


def test_a_job_that_finishes_while_ranks_fire_keeps_no_fast_state(tmp_path):
    store, engine = _firing_rank(tmp_path, "j")
    rows, log, _ = engine.on_state("j", "finished")
    assert sorted((a.rule, a.status) for a in rows) == [("rank_slowdown", "resolved")] * 2
    store.set_job_state("j", "finished", alert_rows=rows, log_rows=log)
    assert fast_state.load(store, "j") == {}     # (was: both rows kept for good)
    assert sorted(fast_state.load(store, "other")) == [3, 5]   # another job's stay


def test_a_new_run_and_the_detectors_own_resolve_drop_the_fast_state(tmp_path):
    store, engine = _firing_rank(tmp_path, "j")
    # the detector resolves rank 5 (its save is left out here: the alert's row alone drops it)
    rows, log, _ = engine.on_changes("j", {3: Change(3, "firing", 3.0, 40, 45)}, {3, 5}, {})
    store.add_alert_changes(rows, log)
    assert sorted(fast_state.load(store, "j")) == [3]
    rows, log, _ = engine.on_reset("j")
    assert store.reset_job("j", {"world_size": 8}, rows, log)
    assert fast_state.load(store, "j") == {}
    assert sorted(fast_state.load(store, "other")) == [3, 5]
