"""One worker thread's calls taken in turns by key (a token): the keys waiting are served round
robin, one call each, so one key's queue of slow calls is not every other key's wait."""

from __future__ import annotations

import asyncio
import collections
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class TakeTurns:
    """Calls run on `pool` (one thread) one at a time, from the event loop; a call that finds
    the thread busy waits in its key's queue, and the next turn goes to the key that waited
    longest since its last turn (the key just served goes to the back).

    One token leasing an unshuffled epoch of three 2^23-sample data sets at once queued three
    shuffles (0.9 s each) on the thread, and another job's first lease waited for all of them
    (2.69 s against 3 ms); now it waits for the call running when it came at most.
    """

    def __init__(self, pool: ThreadPoolExecutor):
        self.pool = pool
        self._waiting: collections.OrderedDict[object, collections.deque[asyncio.Future]] = \
            collections.OrderedDict()
        self._busy = False
        self._last: object = None   # the key whose call runs (or ran last)

    async def run(self, key: object, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the pool's thread, in `key`'s turn."""
        loop = asyncio.get_running_loop()
        if self._busy:
            turn = loop.create_future()
            self._waiting.setdefault(key, collections.deque()).append(turn)
            try:
                await turn
            except asyncio.CancelledError:
                if turn.done() and not turn.cancelled():   # given its turn, then cancelled
                    self._busy = False
                    self._next()
                else:
                    self._drop(key, turn)
                raise
        self._busy, self._last = True, key
        try:
            return await loop.run_in_executor(self.pool, fn, *args)
        finally:
            self._busy = False
            self._next()

    def _drop(self, key: object, turn: asyncio.Future) -> None:
        """Forget a waiting turn (its caller is gone)."""
        queue = self._waiting.get(key)
        if queue is not None and turn in queue:
            queue.remove(turn)
            if not queue:
                del self._waiting[key]

    def _next(self) -> None:
        """Give the thread to the next key waiting (the key served last, if waiting, last)."""
        if self._last in self._waiting:
            self._waiting.move_to_end(self._last)
        while self._waiting and not self._busy:
            key, queue = next(iter(self._waiting.items()))
            turn = queue.popleft()
            if queue:
                self._waiting.move_to_end(key)
            else:
                del self._waiting[key]
            if not turn.done():
                self._busy, self._last = True, key
                turn.set_result(None)
