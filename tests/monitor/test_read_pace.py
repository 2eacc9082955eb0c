"""The per-address read pace (coalesce.ClientPace) of /metrics, /api/jobs and /api/stats: a
turn is taken only when it is served, and no request waits more than a few turns. Turns
reserved at arrival let 100 abandoned scrapes from 127.0.0.1 push the next one 17 s out.

The pace runs on a real asyncio loop and the real park() (a client that leaves sets the event
the serving layer sets), whose clock is virtual: a wait passes at once, so every verdict is
exact, whatever the load of the machine."""

from __future__ import annotations

import asyncio
import selectors

from stragglers.monitor.coalesce import ClientPace
from stragglers.serving_guard import PARKED_KEY

INTERVAL = 0.25


class _VirtualTime(selectors.DefaultSelector):
    """A selector that, asked to wait, lets that much virtual time pass instead."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 1000.0

    def select(self, timeout=None):
        if timeout is not None and timeout > 0:
            self.now += timeout
        return super().select(0)


class _Loop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self.clock = _VirtualTime()
        super().__init__(self.clock)

    def time(self) -> float:
        return self.clock.now


def run(scenario):
    loop = _Loop()
    try:
        return loop.run_until_complete(scenario(loop))
    finally:
        loop.close()


def scope(client: str = "127.0.0.1") -> dict:
    return {"client": (client, 40000)}


async def leave_when_parked(request: dict) -> None:
    """The client closes its connection once its request waits (what the protocol does)."""
    while PARKED_KEY not in request:
        await asyncio.sleep(0)
    request[PARKED_KEY].set()


def test_requests_whose_clients_left_do_not_delay_the_next_one_from_their_address():
    async def scenario(loop):
        pace = ClientPace(INTERVAL)
        assert await pace.turn(scope())   # the address's turn, served at once
        for _ in range(100):   # each abandoned by its client while it waits
            request = scope()
            leaving = asyncio.ensure_future(leave_when_parked(request))
            assert not await pace.turn(request)
            await leaving
        asked = loop.time()
        assert await pace.turn(scope())
        return loop.time() - asked

    # at most the wait that was left of the served turn (reserved turns: 100 x 0.25 s)
    assert run(scenario) <= INTERVAL


def test_a_burst_that_leaves_together_gives_every_turn_back():
    async def scenario(loop):
        pace = ClientPace(INTERVAL)
        assert await pace.turn(scope())
        burst = [scope() for _ in range(50)]
        asked = [asyncio.ensure_future(pace.turn(r)) for r in burst]
        for r in burst:
            await leave_when_parked(r)
        assert not any(await asyncio.gather(*asked))
        began = loop.time()
        assert await pace.turn(scope())
        return loop.time() - began

    assert run(scenario) <= INTERVAL


def test_a_request_behind_many_waiting_ones_waits_a_few_turns_at_most():
    # waiting requests whose clients went (the serving layer gives those up at once since
    # 92592b3; the cap holds for any other kind): 100 of them once pushed a scrape 25 s out
    async def scenario(loop):
        pace = ClientPace(INTERVAL)
        assert await pace.turn(scope())
        waiting = [asyncio.ensure_future(pace.turn(scope())) for _ in range(100)]
        await asyncio.sleep(0)
        asked = loop.time()
        assert await pace.turn(scope())
        waited = loop.time() - asked
        assert all(await asyncio.gather(*waiting))
        return waited

    assert run(scenario) <= 4 * INTERVAL   # (the default backlog: 4 turns)


def test_an_address_asking_faster_than_its_pace_is_answered_within_a_bounded_wait():
    # a proxy with 6 honest pollers, each asking every 0.5 s (12 a second, 4 turns a
    # second): reserved turns grew the backlog without end
    async def scenario(loop):
        pace = ClientPace(INTERVAL)
        waits: list[float] = []

        async def poller(offset: float) -> None:
            await asyncio.sleep(offset)
            for _ in range(40):
                asked = loop.time()
                assert await pace.turn(scope("10.0.0.7"))
                waits.append(loop.time() - asked)
                await asyncio.sleep(0.5)

        await asyncio.gather(*(poller(i / 12) for i in range(6)))
        return waits

    waits = run(scenario)
    assert len(waits) == 240
    assert max(waits) <= 4 * INTERVAL   # (the default backlog: 4 turns)


def test_a_loop_that_keeps_asking_is_answered_about_once_per_interval():
    # the reason for the pace: 8 loops at one address took ~190 answers a second
    async def scenario(loop):
        pace = ClientPace(INTERVAL)
        answers: list[list[float]] = [[] for _ in range(8)]
        end = loop.time() + 60

        async def reader(mine: list[float]) -> None:
            while loop.time() < end:
                assert await pace.turn(scope())
                mine.append(loop.time())
                await asyncio.sleep(0)

        await asyncio.gather(*(reader(a) for a in answers))
        return answers

    answers = run(scenario)
    turns = 60 / INTERVAL
    assert all(len(a) <= turns + 1 for a in answers)
    # the address: one turn per interval, and each request past its backlog of turns
    # answered without one (8 loops: ~8 answers a second, not one per render)
    backlog = ClientPace(INTERVAL).backlog
    assert sum(len(a) for a in answers) <= turns + 8 * 60 / (backlog * INTERVAL) + 8


def test_other_addresses_keep_their_own_pace():
    async def scenario(loop):
        pace = ClientPace(INTERVAL)
        assert await pace.turn(scope("127.0.0.1"))
        began = loop.time()
        assert await pace.turn(scope("10.0.0.8"))
        return loop.time() - began

    assert run(scenario) == 0
