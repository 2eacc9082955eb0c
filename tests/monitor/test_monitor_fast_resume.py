"""A firing fast alert's baseline survives its detector (round 13, finding 9): kept in the
store, a new detector (a restart, another instance taking the job) resumes the rank from it,
keeps it firing while it stays slow and resolves it once it recovers."""

from __future__ import annotations

import numpy as np
import pytest

from pg_cluster import postgres_cluster, postgres_url  # noqa: F401 - fixtures
from stragglers.monitor import fast_state
from stragglers.monitor.changes import ChangeSettings, RankChangeDetector
from stragglers.monitor.store import Store

RANKS = 8


def _busy(steps: range, slow: bool, seed: int) -> np.ndarray:
    """steps × ranks busy seconds (2 % noise); rank 3 3x slow where `slow`."""
    rng = np.random.default_rng(seed)
    busy = 0.1 * np.exp(rng.normal(0, 0.02, (len(steps), RANKS)))
    if slow:
        busy[:, 3] *= 3.0
    return busy


def _feed(d: RankChangeDetector, first: int, busy: np.ndarray) -> list:
    out = []
    for k, row in enumerate(busy):
        for r in range(RANKS):
            d.add(r, np.array([first + k]), row[r:r + 1])
        out.extend(d.settle())
    return out


def test_a_new_detector_resumes_a_firing_rank_from_the_store(tmp_path):
    settings = ChangeSettings()
    d = RankChangeDetector(list(range(RANKS)), {}, settings)
    changes = _feed(d, 0, _busy(range(40), False, 0)) + _feed(d, 40, _busy(range(20), True, 1))
    assert [(c.rank, c.status) for c in changes] == [(3, "firing")]
    store = Store(tmp_path / "m.db")
    fast_state.save(store, "j", {3: d.fired_state(3)})
    fast_state.save(store, "other", {})   # (another job's rows are its own)
    store.close()

    def fresh() -> RankChangeDetector:
        """A detector built after a restart on the same store file."""
        s = Store(tmp_path / "m.db")
        states = fast_state.load(s, "j")
        s.close()
        assert list(states) == [3] and states[3].frozen == d.fired_state(3).frozen
        new = RankChangeDetector(list(range(RANKS)), {}, settings)
        new.resume(3, states[3])
        return new

    # still slow: 60 more steps, still firing
    new = fresh()
    assert _feed(new, 60, _busy(range(60), True, 2)) == [] and 3 in new.firing
    # (a detector built anew learns the slow steps as rank 3's baseline: judged, not firing,
    # which alerts.on_changes took for a recovery and resolved)
    plain = RankChangeDetector(list(range(RANKS)), {}, settings)
    assert _feed(plain, 60, _busy(range(60), True, 2)) == []
    assert 3 in plain.warm() and 3 not in plain.firing
    # recovered: resolved against the baseline it fired against, within ~15 steps
    new = fresh()
    back = _feed(new, 60, _busy(range(30), False, 3))
    assert [(c.rank, c.status) for c in back] == [(3, "resolved")] and back[0].at_step < 60 + 20
    # the state saved for no firing rank is gone
    store = Store(tmp_path / "m.db")
    fast_state.save(store, "j", {})
    assert fast_state.load(store, "j") == {}
    store.close()


def _kept(store) -> None:
    """save / load on one backend: per job (a name that prefixes another's, quotes), whole
    replaced, a damaged row left out."""
    state = fast_state.FiredState(frozen=0.01, base=[0.0] * 20, ratio=2.9, since_step=32,
                                  at_step=36)
    fast_state.save(store, "j", {3: state, 5: state})
    fast_state.save(store, "j2", {1: state})
    fast_state.save(store, 'a"b', {0: state})
    assert sorted(fast_state.load(store, "j")) == [3, 5]
    assert fast_state.load(store, "j")[3] == state
    assert list(fast_state.load(store, 'a"b')) == [0] and list(fast_state.load(store, "j2")) == [1]
    fast_state.save(store, "j", {5: state})
    assert list(fast_state.load(store, "j")) == [5] and list(fast_state.load(store, "j2")) == [1]
    store._write(lambda db: store._exec(db, "UPDATE store_info SET value = 'x' WHERE key = ?",
                                        (fast_state.PREFIX + '["j", 5]',)))
    assert fast_state.load(store, "j") == {}


def test_fast_state_is_kept_per_job_in_sqlite(tmp_path):
    store = Store(tmp_path / "m.db")
    try:
        _kept(store)
    finally:
        store.close()


def test_fast_state_is_kept_per_job_in_postgres(postgres_url):
    from stragglers.monitor.store import PostgresStore

    store = PostgresStore(postgres_url)
    try:
        _kept(store)
    finally:
        store.close()


def _onset_job():
    """dp 4 job: 30 healthy steps, then rank 3 3x slow for 60 (parts of 10 steps)."""
    from monitor_jobs import slow_job

    ops, shift, first = [], 0.0, 0
    for slow, seed, steps in ((None, 0, 30), ((3, 0, 3.0), 1, 60)):
        piece = {k: v.copy() for k, v in
                 slow_job(steps=steps, dp=4, pp=1, slow=slow, seed=seed).ops.items()}
        piece["step"] += first
        piece["start_ts"] += shift
        shift = float((piece["start_ts"] + piece["duration"]).max()) + 0.01
        first = int(piece["step"].max()) + 1
        ops.append(piece)
    trace = slow_job(steps=1, dp=4, pp=1, slow=None)
    trace.ops = {k: np.concatenate([o[k] for o in ops]) for k in ops[0]}
    return trace


@pytest.mark.slow
def test_kill_9_after_a_fast_alert_fired_leaves_it_firing_while_the_rank_stays_slow(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    import httpx

    from conftest import REPO, eventually, free_port
    from monitor_jobs import get, parts_of
    from stragglers.monitor.server import MonitorServer
    from stragglers.monitor.settings import MonitorConfig
    from stragglers.trace.runformat import table_bytes

    trace = _onset_job()
    parts = parts_of(trace, 10)
    db = tmp_path / "mon.db"
    cfg = tmp_path / "monitor.yaml"
    cfg.write_text("settings: {window_steps: 10, stall_after_s: 600, tick_s: 0.05}\n")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                             str(db), "--port", str(port), "--config", str(cfg)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def fast(c) -> list[str]:
        return [a["labels"]["rank"] for a in get(c, "/api/jobs/j")["alerts"]
                if a["rule"] == "rank_slowdown"]
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            eventually(lambda: _up(c), what="the monitor serving")
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict()).status_code == 200
            for rank, n, cols in parts:
                if n < 6:
                    r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols))
                    assert r.status_code == 200, r.text
            # (windows 0-4 stored: a restart reads back only the steps after them, the slow
            # ones, so its new detector has no healthy step to learn from)
            eventually(lambda: get(c, "/api/jobs/j")["windows_total"] >= 5, what="5 windows")
            eventually(lambda: get(c, "/api/stats")["idle"], what="the monitor idle")
            assert fast(c) == ["3"]
    finally:
        os.kill(proc.pid, signal.SIGKILL)   # no stop: what it kept is what it wrote
        proc.wait()
    s = MonitorServer(db, port=0, config=MonitorConfig(window_steps=10, stall_after_s=600,
                                                       tick_s=0.05)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for rank, n, cols in parts:
                if n >= 6:
                    r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols))
                    assert r.status_code == 200, r.text
            eventually(lambda: get(c, "/api/jobs/j")["windows_total"] >= 8, what="8 windows")
            # (idle: the detector's pass over every part done, Monitor.idle)
            eventually(lambda: get(c, "/api/stats")["idle"], what="the monitor idle")
            assert fast(c) == ["3"]
            log = [e["status"] for e in get(c, "/api/jobs/j")["alert_log"]
                   if e["rule"] == "rank_slowdown"]
            assert "resolved" not in log, log
    finally:
        s.stop()


def _up(c) -> bool:
    import httpx

    try:
        return c.get("/api/stats").status_code == 200
    except httpx.TransportError:
        return False
