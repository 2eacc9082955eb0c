"""What one client may create holds no place for good: a controller with no config or report
for `idle_s` gives its places (the service's, its token's, its client's, its step records) to a
new one that needs them, longest-idle first, and its owner may DELETE it. Before, one local
process minting a token per 16 controllers took all 1,024 in 70 s, and every later job's
control/config was 429 until the service restarted (review H3). Counted with a clock passed in."""

from __future__ import annotations

import httpx
import pytest

from adapt_clock import Clock
from stragglers.adapt.client import ShardClient
from stragglers.adapt.control import ControlPlane
from stragglers.adapt.controller import ControlConfig
from stragglers.adapt.errors import QuotaExceeded
from stragglers.adapt.monitor import records_kept
from stragglers.adapt.service import EmbeddedServer, ServiceConfig
from stragglers.errors import StragglersError

CFG = {"policy": "nd", "world_size": 1, "global_batch": 8}


def plane(clock: Clock, **limits) -> ControlPlane:
    return ControlPlane(**limits, idle_s=60.0, clock=clock)


def test_a_filled_service_gives_a_new_job_the_longest_idle_controllers_place():
    clock = Clock()
    p = plane(clock, max_jobs=4)
    for i in range(4):   # one greedy token's, made at once (as a minting loop's)
        p.configure(f"g{i}", ControlConfig(**CFG), "greedy")
    clock.now += 30
    p.report("g0", 0, [(1, 0.5, 8)], "", 0, 0, "greedy")   # g0 is in use
    with pytest.raises(QuotaExceeded, match="max_jobs=4"):   # none idle for 60 s yet
        p.configure("job", ControlConfig(**CFG), "honest")
    clock.now += 30   # g1..g3 idle 60 s, g0 30 s
    p.configure("job", ControlConfig(**CFG), "honest")
    assert sorted(p._jobs) == ["g0", "g2", "g3", "job"]   # g1, the longest idle, gave way
    p.configure("job2", ControlConfig(**CFG), "honest")
    assert sorted(p._jobs) == ["g0", "g3", "job", "job2"]
    assert p._owned == {"greedy": 2, "honest": 2}
    # the job's own controller is never taken while its agents report
    for _ in range(3):
        clock.now += 59
        p.report("job", 0, [], "", 0, 0, "honest")
        p.report("job2", 0, [], "", 0, 0, "honest")
        p.report("g0", 0, [], "", 0, 0, "greedy")
        p.configure("g3", ControlConfig(**CFG), "greedy")   # a config sent again: in use too
    with pytest.raises(QuotaExceeded, match="max_jobs=4"):
        p.configure("late", ControlConfig(**CFG), "other")
    assert sorted(p._jobs) == ["g0", "g3", "job", "job2"]


def test_a_tokens_and_a_clients_limits_take_only_their_own_idle_controllers():
    clock = Clock()
    p = plane(clock, max_jobs=100, max_jobs_per_token=2)
    p.configure("other", ControlConfig(**CFG), "b")   # the oldest, another token's
    p.configure("a1", ControlConfig(**CFG), "a")
    p.configure("a2", ControlConfig(**CFG), "a")
    with pytest.raises(QuotaExceeded, match="max_jobs_per_token=2"):
        p.configure("a3", ControlConfig(**CFG), "a")
    clock.now += 60
    p.configure("a3", ControlConfig(**CFG), "a")   # takes a1's place, not b's
    assert sorted(p._jobs) == ["a2", "a3", "other"] and p._owned == {"a": 2, "b": 1}

    p = plane(clock, max_jobs=100, max_jobs_per_client=2)
    p.configure("y1", ControlConfig(**CFG), "y", "10.0.0.2")   # the oldest, another client's
    p.configure("x1", ControlConfig(**CFG), "x1", "10.0.0.1")
    clock.now += 30
    p.configure("x2", ControlConfig(**CFG), "x2", "10.0.0.1")
    with pytest.raises(QuotaExceeded, match="max_jobs_per_client=2"):
        p.configure("x3", ControlConfig(**CFG), "x3", "10.0.0.1")
    clock.now += 30   # y1 and x1 idle 60 s, x2 30 s
    p.configure("x3", ControlConfig(**CFG), "x3", "10.0.0.1")   # x1's place: its client's
    assert sorted(p._jobs) == ["x2", "x3", "y1"]
    assert p._created == {"10.0.0.1": 2, "10.0.0.2": 1}


def test_the_step_records_budget_is_given_back_by_idle_controllers():
    clock = Clock()
    wide = {"policy": "nd", "world_size": 16, "global_batch": 16}
    cost = 16 * (records_kept(5) + 10)
    p = plane(clock, max_records=3 * cost, max_records_per_token=3 * cost)
    for i in range(3):
        p.configure(f"w{i}", ControlConfig(**wide), "greedy")
    with pytest.raises(QuotaExceeded, match="max_control_records="):
        p.configure("job", ControlConfig(**wide), "honest")
    clock.now += 60
    p.configure("job", ControlConfig(**wide), "honest")
    assert sorted(p._jobs) == ["job", "w1", "w2"]
    assert p._kept == {"greedy": 2 * cost, "honest": cost} and p._kept_total == 3 * cost


def test_the_owner_deletes_its_controller_and_its_places_are_free_at_once(tmp_path):
    config = ServiceConfig(max_jobs=2, new_tokens_per_minute=1000)
    srv = EmbeddedServer(tmp_path / "s.db", config=config).start()
    owner = {"Authorization": "Bearer owner-token-0123456789"}
    stranger = {"Authorization": "Bearer stranger-token-0123456789"}
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            for job in ("j1", "j2"):
                r = http.post(f"/jobs/{job}/control/config", json=CFG, headers=owner)
                assert r.status_code == 200, r.text
            r = http.post("/jobs/j3/control/config", json=CFG, headers=stranger)
            assert r.status_code == 429 and "max_jobs=2" in r.json()["error"], r.text
            r = http.delete("/jobs/j1/control", headers=stranger)
            assert r.status_code == 403 and r.json()["kind"] == "Forbidden", r.text
            r = http.delete("/jobs/j1/control", headers=owner)   # (was 405: no such route)
            assert r.status_code == 200 and r.json() == {"deleted": "j1"}, r.text
            r = http.post("/jobs/j3/control/config", json=CFG, headers=stranger)
            assert r.status_code == 200, r.text
            r = http.delete("/jobs/j1/control", headers=owner)
            assert r.status_code == 404 and r.json()["kind"] == "NotFound", r.text
            r = http.post("/jobs/j1/control/report", headers=owner, json={
                "rank": 0, "records": [], "device": "", "incarnation": 0, "since": 0})
            assert r.status_code == 404, r.text
            r = http.request("DELETE", "/jobs/j2/control", json={"x": 1},
                             headers=owner)
            assert r.status_code == 400, r.text   # a body that carries something is refused
        client = ShardClient(srv.url, "unused", job="j2", worker="w",
                             token="owner-token-0123456789")
        try:
            assert client.delete_control().deleted == "j2"
            with pytest.raises(StragglersError, match="no controller for job 'j2'"):
                client.delete_control()
        finally:
            client.close()
    finally:
        srv.stop()
