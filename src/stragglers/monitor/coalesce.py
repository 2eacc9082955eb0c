"""One render shared by every request that waits for it, at a bounded share of the CPU.

A scrape of /metrics renders every job's series (85 KB for 12 jobs of 64 workers, ~20 ms of
CPU): 8 clients scraping in a loop, no token needed, slowed a recorder's uploads 16x on two
cores, and pipelined scrapes nobody read kept rendering into the kernel's buffers (44x). Here
requests that arrive while a render runs share the next one (each answer is rendered after
its request arrived), and a render begins no sooner than `duty` times the last one's cost
after it ended: the renders take at most 1 / (1 + duty) of one core, however many ask.
ClientPace then answers one client address at most once per interval: a loop of reads waits
its turns instead of taking an answer per render.
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


class ClientPace:
    """`await turn(scope)`: one answer per `interval_s` to each client address; a request
    ahead of its turn waits for it, parked (its connection closable at a cap), never refused.

    8 loops reading /metrics (no token needed) took an answer per render, ~190 a second: the
    service's CPU barely moved (renders are shared), but the loops' own CPU at nice 0 and
    their wake-ups at every render took the CPUs from a recorder's uploads (1.8x). A refusal
    answered at once would be an answer the loop spins on; a wait costs nothing. Prometheus
    scrapes an instance every few seconds."""

    def __init__(self, interval_s: float, max_clients: int = 4096):
        self.interval_s, self.max_clients = interval_s, max_clients
        self._next: OrderedDict[str, float] = OrderedDict()   # client → its next free turn

    async def turn(self, scope: MutableMapping[str, Any]) -> bool:
        """Wait for the client's turn; False when its connection closed meanwhile."""
        if self.interval_s <= 0:
            return True
        client = str((scope.get("client") or ("?",))[0])
        now = time.monotonic()
        at = max(now, self._next.pop(client, now))
        self._next[client] = at + self.interval_s
        while len(self._next) > self.max_clients:
            self._next.popitem(last=False)   # (the least recently asking: most likely free)
        if at <= now:
            return True
        return await park(scope, at - now)   # type: ignore[arg-type]
