"""What the monitor shows of a run reads true (issue 35): a re-run starts its own history, a
run written whole is finished (not running, then stalled), a cause that comes and goes is not
"new" every time, and a cause found at two places is listed once."""

from __future__ import annotations

import copy

import httpx
import msgspec
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, slow_job, write_whole_run
from stragglers.monitor.alerts import AlertEngine, parse_rules
from stragglers.monitor.records import WindowRow
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import Store
from stragglers.trace.runformat import table_bytes

TOKEN = "runs-test-token-0123456"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=0.5,
                    close_grace_s=0.5)


def with_start(trace, start):
    """meta.json as the recorder writes it once its ranks met (the start clock known)."""
    raw = copy.deepcopy(trace.meta.to_dict())
    raw["extra"]["clock"] = {"start": start}
    return raw


@pytest.mark.slow
def test_a_rerun_of_a_job_starts_a_new_history_and_resolves_the_old_alerts(tmp_path):
    # after `--overwrite` the old windows and alerts stayed ("severe" still firing), and the
    # new run's parts, numbered from 0 again, were refused as other bytes under stored numbers
    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - {name: slow, when: 'slowdown >= 1.0', for_windows: 1}\n")
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG,
                      config_file=rules).start()
    first, second = slow_job(steps=10, seed=0), slow_job(steps=5, seed=1)
    world = first.meta.world_size
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            old = [{"offset_ns": 1, "rank": r} for r in range(world)]
            assert c.put("/api/jobs/gpt/meta", json=with_start(first, old),
                         headers=AUTH).status_code == 200
            for rank, part, cols in parts_of(first, 5):
                r = c.put(f"/api/jobs/gpt/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                          headers=AUTH)
                assert r.status_code == 200, r.text
            eventually(lambda: len(get(c, "/api/jobs/gpt")["windows"]) == 2, what="2 windows")
            eventually(lambda: get(c, "/api/jobs/gpt")["alerts"], what="the alert firing")
            # the re-run: its recorder writes meta.json anew (start clock not known yet)
            assert c.put("/api/jobs/gpt/meta", json=with_start(second, [None] * world),
                         headers=AUTH).status_code == 200
            job = get(c, "/api/jobs/gpt")
            assert job["windows"] == [] and job["alerts"] == [] and job["window"] is None
            assert job["alert_log"][0]["status"] == "resolved"
            assert job["state"] == "running"
            for rank, part, cols in parts_of(second, 5):
                r = c.put(f"/api/jobs/gpt/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                          headers=AUTH)
                assert r.status_code == 200 and r.json()["status"] == "stored", r.text
            wins = eventually(lambda: get(c, "/api/jobs/gpt")["windows"], what="new window")
            assert [w["idx"] for w in wins] == [0]
            # the same run rewriting its meta (start clock known, then the end) is the same run
            new = [{"offset_ns": 2, "rank": r} for r in range(world)]
            for raw in (with_start(second, new), {**with_start(second, new)}):
                raw["extra"]["clock"]["end"] = [{"offset_ns": 3}] * world
                assert c.put("/api/jobs/gpt/meta", json=raw, headers=AUTH).status_code == 200
            assert [w["idx"] for w in get(c, "/api/jobs/gpt")["windows"]] == [0]
    finally:
        s.stop()


@pytest.mark.slow
def test_a_run_written_whole_is_finished_not_running_then_stalled(tmp_path):
    runs = tmp_path / "runs"
    run = runs / "synth"
    trace = slow_job(steps=12)
    write_whole_run(run, trace)
    s = MonitorServer(tmp_path / "mon.db", watch=[runs], port=0,
                      config=CFG.replace(stall_after_s=30)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            def done():
                job = get(c, "/api/jobs/synth")
                return job["state"] == "finished" and len(job["windows"]) == 3 and job

            job = eventually(done, 60, what="finished, with the tail window")
            assert [(w["first_step"], w["last_step"]) for w in job["windows"]] == \
                [(0, 4), (5, 9), (10, 11)]
            assert not [e for e in job["alert_log"] if e["rule"] == "stalled"]
    finally:
        s.stop()


def window(idx, causes):
    return msgspec.convert(window_json(idx, causes), WindowRow)


def window_json(idx, causes):
    return {"job": "j", "idx": idx, "error": None, "slowdown": 1.2, "waste": 0.1, "m_w": 1.0, "m_s": 1.0,
            "first_step": idx * 5, "last_step": idx * 5 + 4, "scores": [], "steps": [],
            "missing_ranks": [], "diagnosis": [{"cause": c, "where": {}} for c in causes],
            "closed_at": 0.0, "analysed_at": 0.0, "analysis_s": 0.0, "reason": "complete",
            "t_base": 1, "t_ideal": 1, "sim_error": 0}


def test_a_cause_that_comes_and_goes_is_new_once_not_every_time(tmp_path):
    store = Store(tmp_path / "a.db")
    store.register_job("j", str(tmp_path), "http", None)
    engine = AlertEngine(parse_rules([{"name": "new", "when": "new_cause"}]), store, 3600)
    fired = []
    for i in range(12):
        w = window(i, ["compute_imbalance"] + (["cpu_contention"] if i % 2 else []))
        alert_rows, log_rows, _ = engine.on_window("j", w, now=float(i))
        store.add_window(w, alert_rows, log_rows)
        fired += [(i, e.summary) for e in log_rows if e.status == "firing"]
    # each cause fires once (window 0, window 1), not again each time it comes back
    assert [i for i, _ in fired] == [0, 1], fired
    store.close()


def test_a_cause_found_at_two_places_is_listed_once(tmp_path):
    store = Store(tmp_path / "a.db")
    store.register_job("j", str(tmp_path), "http", None)
    store.add_window(window(0, ["cpu_contention", "cpu_contention", "worker_fault"]), [], [])
    assert store.windows("j")[0].causes == ["cpu_contention", "worker_fault"]
    store.close()


def test_the_demo_ends_on_a_command_that_serves_its_store_again(tmp_path):
    from stragglers.monitor.demo import reopen_command

    cmd = reopen_command(tmp_path, 8150)
    assert f"--db {tmp_path / 'monitor.db'}" in cmd and f"--config {tmp_path / 'rules.yaml'}" in cmd


@pytest.mark.slow
def test_a_store_served_again_with_other_settings_says_how_its_windows_were_cut(tmp_path):
    trace = slow_job(steps=10)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    with httpx.Client(base_url=s.url, timeout=60) as c:
        c.put("/api/jobs/j/meta", json=trace.meta.to_dict(), headers=AUTH)
        for rank, part, cols in parts_of(trace, 5):
            c.put(f"/api/jobs/j/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                  headers=AUTH)
        eventually(lambda: len(get(c, "/api/jobs/j")["windows"]) == 2, what="windows")
    s.stop()
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN,
                      config=CFG.replace(window_steps=10)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert get(c, "/api/jobs/j")["window_steps"] == 5
    finally:
        s.stop()


@pytest.mark.slow
def test_a_new_run_waits_for_the_old_runs_parts_on_their_way(tmp_path):
    # the old run's part, checked and not yet committed when the new run's meta.json came,
    # was stored after the reset as the new run's part 0 of its rank: the new run's own
    # part 0 was then refused as other bytes (409) and the old rows analysed as the new
    # run's. The reset now waits (503, retried) until no part of the job is on its way.
    import threading

    old_trace, new_trace = slow_job(steps=10, seed=1), slow_job(steps=10, seed=2)
    world = old_trace.meta.world_size
    old, new = ([{"offset_ns": n, "rank": r} for r in range(world)] for n in (1, 2))
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    entered, release = threading.Event(), threading.Event()
    real = s.monitor.store.add_parts

    def held(*args, **kwargs):
        entered.set()
        release.wait(120)
        return real(*args, **kwargs)

    answers: list[int] = []
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=with_start(old_trace, old),
                         headers=AUTH).status_code == 200
            s.monitor.store.add_parts = held
            _, _, old_cols = next(p for p in parts_of(old_trace, 5) if p[0] == 2)
            sender = threading.Thread(target=lambda: answers.append(httpx.put(
                f"{s.url}/api/jobs/j/ranks/2/parts/0", content=table_bytes(old_cols),
                headers=AUTH, timeout=180).status_code))
            sender.start()
            try:
                assert entered.wait(60)
                r = c.put("/api/jobs/j/meta", json=with_start(new_trace, new), headers=AUTH)
                assert r.status_code == 503 and r.headers.get("Retry-After"), r.text
            finally:
                release.set()
                sender.join()
            assert answers == [200]
            s.monitor.store.add_parts = real
            assert c.put("/api/jobs/j/meta", json=with_start(new_trace, new),
                         headers=AUTH).status_code == 200
            for rank, part, cols in parts_of(new_trace, 5):
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{part}", content=table_bytes(cols),
                          headers=AUTH)
                assert r.status_code == 200 and r.json()["status"] == "stored", r.text
    finally:
        release.set()
        s.stop()
