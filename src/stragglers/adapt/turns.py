"""One worker thread's calls taken in turns by key (a token): the keys waiting are served round
robin, one call each, so one key's queue of slow calls is not every other key's wait; and long
calls that must not be anyone's turn (PacedKeys: a few threads, one call a key, paced)."""

from __future__ import annotations

import asyncio
import collections
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, TypeVar

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


class PacedKeys:
    """Long calls (big shuffles) on `pool` (a few threads), at most one of each key at a time,
    each key charged its calls' CPU time: its next call starts no sooner than that time x
    (1 - share) / share after the last one ended, so a key keeps at most `share` of a thread.

    A shuffle cannot be cut into pieces that yield between turns: numpy shuffles an array in
    one call (Fisher-Yates, every swap after the last), and any other algorithm would give a
    data set that lives across an upgrade another order mid-epoch. So it is not a turn of the
    thread other keys' leases wait on: another token's 2**26-sample shuffle (5 s) held a job's
    lease that long on the one big-shuffle thread (TakeTurns: at most one call ahead, but that
    one was the 5 s). Here it runs beside other keys' (the threads share the cores; numpy lets
    go of the GIL), and paced per key: a token making new 2**26 epochs in a loop takes its
    share of a core (the service's: a tenth), not one.
    """

    def __init__(self, pool: ThreadPoolExecutor, share: float = 0.25,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep):
        self.pool, self.share, self.clock, self.sleep = pool, share, clock, sleep
        self._held: dict[object, tuple[asyncio.Lock, list[int]]] = {}   # key -> (lock, users)
        self._due: dict[object, float] = {}   # key -> its next call not before (clock)
        self.charged: dict[object, float] = {}   # key -> CPU seconds of its calls (tested)

    def paused(self, key: object) -> bool:
        """Whether a call of `key` would wait now (one of its calls runs or waits, or its
        pause has not passed); from any thread."""
        return key in self._held or self._due.get(key, 0.0) > self.clock()

    async def run(self, key: object, fn: Callable[..., T], *args: Any,
                  ready: Callable[[], T | None] | None = None) -> T:
        """fn(*args) on the pool once `key`'s call before it ended and its pause passed.
        `ready`: what fn would return, where some call made it meanwhile (another lease's
        shuffle of the same epoch, which this one waited for), else None: then no pause, no
        charge."""
        lock, users = self._held.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            await lock.acquire()
        except BaseException:
            self._leave(key, users)
            raise
        made = None if ready is None else ready()
        if made is not None:
            lock.release()
            self._leave(key, users)
            return made
        loop = asyncio.get_running_loop()
        try:
            wait = self._due.get(key, 0.0) - self.clock()
            if wait > 0:
                await self.sleep(wait)
            cost = [0.0]

            def timed() -> T:
                t0 = time.thread_time()
                try:
                    return fn(*args)
                finally:
                    cost[0] = time.thread_time() - t0
            fut = self.pool.submit(timed)
        except BaseException:
            lock.release()
            self._leave(key, users)
            raise

        def ended(_) -> None:   # (on the loop; also when the caller left before the end)
            self.charged[key] = self.charged.get(key, 0.0) + cost[0]
            now = self.clock()
            if len(self._due) > 4096:   # (keys paid up are dropped)
                self._due = {k: t for k, t in self._due.items() if t > now}
            self._due[key] = now + cost[0] * (1 - self.share) / self.share
            lock.release()
            self._leave(key, users)
        def settled(f) -> None:   # (on the pool's thread)
            try:
                loop.call_soon_threadsafe(ended, f)
            except RuntimeError:
                pass   # the event loop is gone (the service stopped)
        fut.add_done_callback(settled)
        return await asyncio.wrap_future(fut)

    def _leave(self, key: object, users: list[int]) -> None:
        users[0] -= 1
        if not users[0]:
            del self._held[key]
