"""Scrapes of /metrics share renders at a bounded share of the CPU (coalesce.SharedRender): 8
clients scraping in a loop, no token needed, slowed every upload 16x, pipelined scrapes nobody
read 44x."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from stragglers.monitor.coalesce import SharedRender


def test_callers_during_a_render_share_the_next_one_begun_after_them():
    async def scenario():
        renders: list[float] = []
        gate = asyncio.Event()

        async def render() -> int:
            renders.append(time.monotonic())
            if len(renders) == 1:
                await gate.wait()   # the first render runs until every caller below waits
            await asyncio.sleep(0.01)
            return len(renders)

        shared = SharedRender(render, duty=3.0)
        first = asyncio.ensure_future(shared.get())
        while not renders:
            await asyncio.sleep(0)
        later = [asyncio.ensure_future(shared.get()) for _ in range(20)]
        await asyncio.sleep(0)
        gate.set()
        assert await first == 1
        assert await asyncio.gather(*later) == [2] * 20   # one render for all twenty
        return renders

    renders = asyncio.run(scenario())
    assert len(renders) == 2


def test_a_render_begins_no_sooner_than_duty_times_the_last_ones_cost_after_it():
    async def scenario():
        spans: list[tuple[float, float]] = []

        async def render() -> None:
            began = time.monotonic()
            await asyncio.sleep(0.02)
            spans.append((began, time.monotonic()))

        shared = SharedRender(render, duty=3.0)
        for _ in range(3):   # one caller after another, as a scrape loop asks
            await shared.get()
        return spans

    spans = asyncio.run(scenario())
    for (b0, e0), (b1, _) in zip(spans, spans[1:]):
        assert b1 - e0 >= 3.0 * (e0 - b0) - 1e-3, spans   # (a lower bound: sleeps are late)


def test_a_failed_render_is_its_callers_error_and_the_next_one_goes_on():
    async def scenario():
        calls = []

        async def render() -> int:
            calls.append(1)
            if len(calls) == 1:
                raise OSError("the store failed")
            return 7

        shared = SharedRender(render, duty=0.0)
        try:
            await shared.get()
        except OSError:
            pass
        else:
            raise AssertionError("the failure was not handed on")
        return await shared.get()

    assert asyncio.run(scenario()) == 7


def test_metrics_scrapes_still_answer_fresh_series(tmp_path):
    from stragglers.monitor.server import MonitorServer
    from stragglers.monitor.settings import MonitorConfig
    s = MonitorServer(tmp_path / "mon.db", port=0,
                      config=MonitorConfig(window_steps=5, stall_after_s=600)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            first = c.get("/metrics")
            assert first.status_code == 200 and "stragglers_ingest_lag_seconds" in first.text
            s.monitor.reject("bad_part", "probe", "a refusal counted after the first scrape")
            again = c.get("/metrics")
            assert 'stragglers_ingest_rejected_total{reason="bad_part"} 1.0' in again.text
    finally:
        s.stop()


@pytest.mark.slow
def test_one_client_address_is_answered_once_per_read_interval(tmp_path):
    # 8 loops reading /metrics (no token needed) took an answer per render, ~190 a second:
    # their own CPU and wake-ups took the CPUs from a recorder's uploads (1.81x at nice 0).
    # Now an address's requests wait their turns (a lower bound, however loaded the machine).
    import concurrent.futures as cf

    from stragglers.monitor.server import MonitorServer
    from stragglers.monitor.settings import MonitorConfig
    interval = 1.0
    s = MonitorServer(tmp_path / "mon.db", port=0,
                      config=MonitorConfig(stall_after_s=600, read_interval_s=interval)).start()
    try:
        def scrape(path: str) -> float:
            with httpx.Client(base_url=s.url, timeout=60) as c:
                assert c.get(path).status_code == 200
                return time.monotonic()

        for path in ("/metrics", "/api/jobs", "/api/stats"):
            began = time.monotonic()   # (before the first request's turn began)
            with cf.ThreadPoolExecutor(3) as pool:
                done = sorted(pool.map(scrape, [path] * 3))
            assert done[-1] - began >= 2 * interval, (path, began, done)
    finally:
        s.stop()
