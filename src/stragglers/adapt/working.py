"""Requests free of the shard service's shared pace under contention, earned per worker by its
work (see serving_quota.Backpressure: the allowance defers a worker's requests to this)."""

from __future__ import annotations

import time
from collections import OrderedDict


class WorkCredit:
    """Per worker (its token, data set and name): requests it may have free of the shared pace.

    Each free request spends a credit; an ack that moves the worker's shard forward earns
    `earn` (at most `cap` held: a lease and its ack spend two, so a worker training gains one
    a shard, a margin for its retries and "wait" answers), and at most `per_worker` of its requests are in progress free
    at once (a worker asks one at a time; its ack and next lease may overlap). A worker first
    seen gets `start` (its join, first lease and first ack: with two, 256 workers' first acks
    waited shared turns) from a pool shared by all tokens, `pool` at most (2,048 workers
    starting at once), refilled at `pool_per_s`: names are cheap to invent (up to 1,024 a data
    set), so what fresh names bring in all is bounded, not what each brings.

    A token that joined as many workers as it flooded with connections was a big job by the
    count of its workers, and its flood went unpaced: leases, replays, joins and releases move
    no shard, so such a flood earns nothing and waits its shared turns, while a job whose
    workers train earns its next requests with each step's ack.
    Used on one event loop (no lock).
    """

    def __init__(self, start: int = 3, earn: int = 3, cap: int = 8, per_worker: int = 2,
                 pool: float = 6144, pool_per_s: float = 6144 / 60, remember: int = 1 << 16,
                 clock=time.monotonic):
        self.start, self.earn, self.cap, self.per_worker = start, earn, cap, per_worker
        self.pool, self.pool_per_s, self.remember, self.clock = pool, pool_per_s, remember, clock
        self._level, self._at = float(pool), clock()
        self._credit: OrderedDict[object, int] = OrderedDict()
        self._busy: dict[object, int] = {}

    def _entry(self, who: object, fresh: bool) -> int:
        """`who`'s credit, remembered (most recent last); a worker first seen draws its start
        from the pool when `fresh`, else starts with none."""
        credit = self._credit.get(who)
        if credit is not None:
            self._credit.move_to_end(who)
            return credit
        credit = 0
        if fresh:
            now = self.clock()
            self._level = min(self.pool, self._level + (now - self._at) * self.pool_per_s)
            self._at = now
            credit = int(min(self.start, self._level))
            self._level -= credit
        self._credit[who] = credit
        while len(self._credit) > self.remember:   # (the least recently seen forgotten)
            self._credit.popitem(last=False)
        return credit

    def take(self, who: object) -> bool:
        """Whether a request of `who` goes free now (then counted in progress until `leave`,
        a credit spent)."""
        credit = self._entry(who, True)
        busy = self._busy.get(who, 0)
        if credit < 1 or busy >= self.per_worker:
            return False
        self._credit[who] = credit - 1
        self._busy[who] = busy + 1
        return True

    def leave(self, who: object) -> None:
        """A free request of `who` is over."""
        busy = self._busy.get(who, 0) - 1
        if busy > 0:
            self._busy[who] = busy
        else:
            self._busy.pop(who, None)

    def worked(self, who: object) -> None:
        """`who` moved its shard forward (an ack): `earn` more credits, up to `cap`."""
        self._credit[who] = min(self.cap, self._entry(who, False) + self.earn)
