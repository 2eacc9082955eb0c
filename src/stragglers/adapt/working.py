"""Requests free of the shard service's shared pace under contention, earned per worker by its
work (see serving_quota.Backpressure: the allowance defers a worker's requests to this)."""

from __future__ import annotations

import time
from collections import OrderedDict

from stragglers.adapt.start_pool import StartPool


def _first(who: object) -> object:
    """The token of a worker named (token, data set, name); anything else is its own."""
    return who[0] if isinstance(who, tuple) else who


class WorkCredit:
    """Per worker (its token, data set and name): requests it may have free of the shared pace.

    Each free request spends a credit; an ack earns in proportion to the share of its shard it
    moves forward (fractions kept, at most `cap` held): a whole shard earns `earn` (a lease and
    its ack spend two, so a worker training gains one a shard, a margin for its retries and
    "wait" answers), and an ack moving at least 1/`progress_acks` of its shard pays for itself
    (a worker may ack a few batches a shard and keep its pace). A flood of one-sample acks earned
    a shard's worth each and never ran out; now what it earns is what it moved. At most
    `per_worker` of a worker's requests are in progress free at once (a worker asks one at a
    time; its ack and next lease may overlap).

    A worker first known to the store (a request of it done: its join, or a lease or ack of a
    worker joined before this process) gets `start` (its join, first lease and first ack: with
    two, 256 workers' first acks waited shared turns) from a pool shared by all tokens, `pool`
    at most, refilled at `pool_per_s`, each token drawing only while it owes the pool less than
    is left (StartPool: one token's workers start up to half of it at once, 1,024 of them;
    one token joining 2,048 real workers emptied it for everyone else). A name the store does
    not know draws nothing, but its join may draw its own credit (given back when refused):
    leases naming made-up workers drew a start each and drained the pool every token shares.
    `token_of(who)`: the token whose share a worker draws on (the first of a tuple).

    A token that joined as many workers as it flooded with connections was a big job by the
    count of its workers, and its flood went unpaced: leases, replays, joins and releases move
    no shard, so such a flood earns nothing and waits its shared turns, while a job whose
    workers train earns its next requests with each step's ack.
    Used on one event loop (no lock).
    """

    def __init__(self, start: int = 3, earn: float = 3, cap: float = 8, per_worker: int = 2,
                 progress_acks: int = 8, pool: float = 6144, pool_per_s: float = 6144 / 60,
                 remember: int = 1 << 16, clock=time.monotonic, token_of=_first):
        self.start, self.earn, self.cap, self.per_worker = start, earn, cap, per_worker
        self.progress_acks = progress_acks
        self.remember, self.token_of = remember, token_of
        self.pool = StartPool(pool, pool_per_s, clock)
        self._credit: OrderedDict[object, float] = OrderedDict()   # workers the store knows
        self._busy: dict[object, int] = {}
        self._joining: dict[object, int] = {}   # joins of unknown names on a pool credit

    def take(self, who: object, joining: bool = False) -> bool:
        """Whether a request of `who` goes free now (then counted in progress until `leave`,
        a credit spent); a worker not known draws one from the pool only for its join."""
        busy = self._busy.get(who, 0)
        if busy >= self.per_worker:
            return False
        credit = self._credit.get(who)
        if credit is None:
            if not joining or self.pool.draw(self.token_of(who), 1) < 1:
                return False
            self._joining[who] = self._joining.get(who, 0) + 1
        elif credit < 1:
            return False
        else:
            self._credit[who] = credit - 1
            self._credit.move_to_end(who)
        self._busy[who] = busy + 1
        return True

    def leave(self, who: object, done: bool) -> None:
        """A free request of `who` is over (`done`: not refused; a refused join of a name not
        known gives its credit back to the pool)."""
        busy = self._busy.get(who, 0) - 1
        if busy > 0:
            self._busy[who] = busy
        else:
            self._busy.pop(who, None)
        joining = self._joining.get(who, 0)
        if joining:
            if joining > 1:
                self._joining[who] = joining - 1
            else:
                del self._joining[who]
            if not done:
                self.pool.give_back(self.token_of(who), 1)

    def known(self, who: object) -> None:
        """A request of `who` was done (the store knows it): a worker first known draws its
        start from the pool (less the credit its join drew)."""
        if who in self._credit:
            self._credit.move_to_end(who)
            return
        self._credit[who] = self.pool.draw(self.token_of(who),
                                           self.start - (1 if who in self._joining else 0))
        while len(self._credit) > self.remember:   # (the least recently seen forgotten)
            self._credit.popitem(last=False)

    def worked(self, who: object, share: float) -> None:
        """`who`'s ack moved `share` of its shard forward: credit in proportion, up to `cap`."""
        if share > 0 and who in self._credit:
            earned = self.earn * share + min(1.0, self.progress_acks * share)
            self._credit[who] = min(self.cap, self._credit[who] + earned)
