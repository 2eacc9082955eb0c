"""One render shared by every request that waits for it, at a bounded share of the CPU.

A scrape of /metrics renders every job's series (85 KB for 12 jobs of 64 workers, ~20 ms of
CPU): 8 clients scraping in a loop, no token needed, slowed a recorder's uploads 16x on two
cores, and pipelined scrapes nobody read kept rendering into the kernel's buffers (44x). Here
requests that arrive while a render runs share the next one (each answer is rendered after
its request arrived), and a render begins no sooner than `duty` times the last one's cost
after it ended: the renders take at most 1 / (1 + duty) of one core, however many ask.
ClientPace then answers one client address about once per interval: a loop of reads waits
its turns (taken when served, at most a few ahead) instead of taking an answer per render.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Generic, TypeVar

from stragglers.serving_guard import park

T = TypeVar("T")


class SharedRender(Generic[T]):
    """`await get()`: the result of a render begun after the call (used on one event loop)."""

    def __init__(self, render: Callable[[], Awaitable[T]], duty: float = 3.0,
                 max_pause_s: float = 1.0):
        self.render, self.duty, self.max_pause_s = render, duty, max_pause_s
        self._next: asyncio.Future[T] | None = None   # the render the next callers share
        self._last: asyncio.Future[T] | None = None   # the one under way (or done)
        self._ended, self._cost = 0.0, 0.0

    async def get(self) -> T:
        """The next render's result (shared with every caller waiting for the same one)."""
        if self._next is None:
            self._next = asyncio.ensure_future(self._run(self._last))
        return await asyncio.shield(self._next)

    async def _run(self, before: asyncio.Future[T] | None) -> T:
        if before is not None:
            try:
                await asyncio.shield(before)   # one render at a time
            except Exception:   # noqa: BLE001 - its callers were told; this one goes on
                pass
        pause = min(self.max_pause_s, self._ended + self._cost * self.duty - time.monotonic())
        if pause > 0:
            await asyncio.sleep(pause)
        # callers from now on wait for the render after this one (this one may have begun
        # before they asked)
        self._last, self._next = self._next, None
        began = time.monotonic()
        try:
            return await self.render()
        finally:
            self._ended = time.monotonic()
            self._cost = self._ended - began


class _Address:
    """One client address's pace: when its next turn is free, and its requests waiting."""

    __slots__ = ("free_at", "waiting")

    def __init__(self) -> None:
        self.free_at = 0.0                 # (loop time) no answer before it but a shared one
        self.waiting: list[object] = []    # its waiting requests, in the order they came


class ClientPace:
    """`await turn(scope)`: one answer per `interval_s` to each client address; a request
    ahead of its turn waits for it, parked (its connection closable at a cap), never refused.

    8 loops reading /metrics (no token needed) took an answer per render, ~190 a second: the
    service's CPU barely moved (renders are shared), but the loops' own CPU at nice 0 and
    their wake-ups at every render took the CPUs from a recorder's uploads (1.8x). A refusal
    answered at once would be an answer the loop spins on; a wait costs nothing. Prometheus
    scrapes an instance every few seconds.

    A turn is taken when it is served, never reserved ahead: a request whose client left
    takes none (turns reserved at arrival let 100 abandoned scrapes push the address's next
    one 25 s out, unbounded: Prometheus on loopback, or everyone behind a proxy, shut out).
    No request waits more than `backlog` turns: past them it is answered without a turn,
    with whatever render is next (shared; the service's CPU stays bounded by SharedRender),
    so an address asking faster than once per interval is answered about once per interval
    per request, never after a backlog that grows."""

    def __init__(self, interval_s: float, backlog: int = 4, max_clients: int = 4096):
        self.interval_s, self.backlog, self.max_clients = interval_s, backlog, max_clients
        self._clients: OrderedDict[str, _Address] = OrderedDict()

    async def turn(self, scope: MutableMapping[str, Any]) -> bool:
        """Wait for the client's turn; False when its connection closed meanwhile."""
        if self.interval_s <= 0:
            return True
        client = str((scope.get("client") or ("?",))[0])
        address = self._clients.pop(client, None) or _Address()
        self._clients[client] = address
        while len(self._clients) > self.max_clients:
            self._clients.popitem(last=False)   # (the least recently asking: most likely free)
        loop = asyncio.get_running_loop()
        now = loop.time()
        latest = now + self.backlog * self.interval_s
        me = object()
        address.waiting.append(me)
        try:
            while now < address.free_at and now < latest:
                # its turn worked out afresh at each wake: the requests ahead that left
                # gave theirs back
                ahead = address.waiting.index(me)
                at = min(latest, address.free_at + ahead * self.interval_s)
                if not await park(scope, at - now):   # type: ignore[arg-type]
                    return False
                now = loop.time()
            if now >= address.free_at:
                address.free_at = now + self.interval_s   # the turn, taken as it is served
            return True
        finally:
            address.waiting.remove(me)
