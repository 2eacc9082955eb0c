"""Control calls are paced and bounded: a client posting big reports in a loop cannot keep the
control thread (and the GIL the lease path needs) busy (issue 34, control_reports)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from stragglers.adapt.control import ControlPlane
from stragglers.adapt.service import EmbeddedServer, ServiceConfig

TOKENS = [f"control-token-{i:04d}" for i in range(4)]
SHARE = 0.25
SPENT_S = 0.04   # each report's control work (made slow below, whatever the machine's speed)
MAX_PAUSE_S = 1.0   # PacedThread's default: the most any call waits for another's pause


def configure(c: httpx.Client, job: str) -> None:
    r = c.post(f"/jobs/{job}/control/config", json={
        "policy": "bsp", "world_size": 2, "global_batch": 8, "incarnation": 1})
    assert r.status_code == 200, r.text


def report(c: httpx.Client, job: str, step: int) -> httpx.Response:
    return c.post(f"/jobs/{job}/control/report", json={
        "rank": 0, "records": [[step, 0.1, 4]], "incarnation": 1})


@pytest.mark.slow
def test_control_calls_take_at_most_their_share_of_the_time(tmp_path, monkeypatch):
    # five clients posting 10,000-record reports in a loop kept the control thread busy all
    # the time (another job's lease + ack: 52x its quiet latency); now each call is followed
    # by a pause of (1 - share) / share times its duration before the next one starts
    spans: list[tuple[float, float, str]] = []
    real = ControlPlane.report

    def slow_report(self, job, *a, **kw):
        t0 = time.monotonic()
        time.sleep(SPENT_S)
        try:
            return real(self, job, *a, **kw)
        finally:
            spans.append((t0, time.monotonic(), job))
    monkeypatch.setattr(ControlPlane, "report", slow_report)
    srv = EmbeddedServer(tmp_path / "s.db", config=ServiceConfig(control_share=SHARE)).start()
    try:
        clients = [httpx.Client(base_url=srv.url, timeout=60,
                                headers={"Authorization": f"Bearer {t}"}) for t in TOKENS]
        for i, c in enumerate(clients):
            configure(c, f"job{i}")
        codes: list[int] = []

        def loop(i: int) -> None:   # (reports of all four at once: they queue on the thread)
            codes.extend(report(clients[i], f"job{i}", step).status_code
                         for step in range(2, 5))
        threads = [threading.Thread(target=loop, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for c in clients:
            c.close()
    finally:
        srv.stop()
    assert codes == [200] * 12, codes
    spans.sort()
    for (s0, e0, _), (s1, _, _) in zip(spans, spans[1:]):
        # the pause is measured around the call, so it is at least this (any machine speed);
        # what a call longer than max_pause_s / 3 owes past max_pause_s is its token's own
        owed = (e0 - s0) * (1 - SHARE) / SHARE
        assert s1 - e0 >= min(owed, MAX_PAUSE_S), (s1 - e0, e0 - s0)
    for job in {j for _, _, j in spans}:
        mine = [(s, e) for s, e, j in spans if j == job]
        for (s0, e0), (s1, _) in zip(mine, mine[1:]):
            assert s1 - e0 >= (e0 - s0) * (1 - SHARE) / SHARE, (job, s1 - e0, e0 - s0)


@pytest.mark.slow
def test_control_calls_past_a_tokens_bound_are_refused_before_their_body(tmp_path, monkeypatch):
    # queued without bound, each report held up to 1 MiB of parsed rows while it waited for
    # the (paced) thread; past the bound: 503 Busy from the head, nothing parsed
    entered, release = threading.Event(), threading.Event()
    real = ControlPlane.report
    calls: list[int] = []

    def held_report(self, *a, **kw):
        calls.append(1)
        entered.set()
        release.wait(60)
        return real(self, *a, **kw)
    monkeypatch.setattr(ControlPlane, "report", held_report)
    cfg = ServiceConfig(max_control_calls_per_token=1, max_control_calls=2)
    srv = EmbeddedServer(tmp_path / "s.db", config=cfg).start()
    try:
        clients = [httpx.Client(base_url=srv.url, timeout=60,
                                headers={"Authorization": f"Bearer {t}"}) for t in TOKENS]
        for i, c in enumerate(clients):
            configure(c, f"job{i}")
        first = threading.Thread(target=report, args=(clients[0], "job0", 2))
        first.start()
        assert entered.wait(60)
        bad = b'{"rank": "not even parsed"}'   # (a 400 if it were read)
        again = clients[0].post("/jobs/job0/control/report", content=bad,
                                headers={"Content-Type": "application/json"})
        assert again.status_code == 503 and again.json()["kind"] == "Busy", again.text
        assert "token" in again.json()["error"]
        second = threading.Thread(target=report, args=(clients[1], "job1", 2))
        second.start()   # another token: queued behind the first (2 in all)
        waiting = srv.app.state.controlling.in_all.requests
        deadline = time.monotonic() + 60
        while waiting.get(None, 0) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        third = report(clients[2], "job2", 2)
        assert third.status_code == 503 and "service" in third.json()["error"], third.text
        release.set()
        first.join()
        second.join()
        assert report(clients[2], "job2", 3).status_code == 200
        assert len(calls) == 3
        for c in clients:
            c.close()
    finally:
        release.set()
        srv.stop()


@pytest.mark.parametrize("share", [0.0, 1.5])
def test_a_control_share_outside_0_1_is_refused(share):
    from stragglers.errors import InputError
    with pytest.raises(InputError, match="control_share"):
        ServiceConfig(control_share=share)
