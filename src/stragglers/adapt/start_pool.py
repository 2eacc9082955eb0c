"""The pool of start credits all tokens' new workers draw from, shared fairly between tokens
(see working.WorkCredit)."""

from __future__ import annotations

import heapq
import itertools
import time


class StartPool:
    """`size` credits, kept as what each token owes: the level is `size` less all debts, and
    the refill (`per_s`) pays off the debts of the tokens that owe, in equal parts.

    A token draws only while it owes less than the level left: one token stops at half the
    pool, k tokens drawing together at 1/(k+1) each, and a token owing nothing still finds a
    share of theirs. Was: one level all tokens drew from, so one token joining 2,048 real
    workers (its 64 data sets hold 65,536) emptied it, and another token's new workers found
    nothing for as long as the first kept joining.
    """

    def __init__(self, size: float, per_s: float, clock=time.monotonic):
        self.size, self.per_s, self.clock = float(size), per_s, clock
        self._at = clock()
        self._paid = 0.0   # paid off so far to each token owing all along (a virtual time)
        self._due: dict[object, float] = {}   # token -> `_paid` at which its debt is paid off
        self._heap: list[tuple[float, int, object]] = []   # (due, seq, token), stale kept
        self._seq = itertools.count()
        self._owed = 0.0

    def _refill(self) -> None:
        """Pay the refill since the last call off the debts, in equal parts (water-filling:
        the smallest debts end first and their part goes to the others)."""
        now = self.clock()
        left, self._at = (now - self._at) * self.per_s, now
        while left > 0 and self._due:
            due, _, token = self._heap[0]
            if self._due.get(token) != due:   # (an entry replaced since: dropped)
                heapq.heappop(self._heap)
                continue
            k = len(self._due)
            gap = max(0.0, due - self._paid)
            if gap * k > left:   # every debt outlasts the refill: each paid its part
                self._paid += left / k
                self._owed = max(0.0, self._owed - left)
                break
            self._paid, left = due, left - gap * k   # the smallest debt paid off
            self._owed = max(0.0, self._owed - gap * k)
            heapq.heappop(self._heap)
            del self._due[token]
        if not self._due:
            self._owed, self._heap = 0.0, []

    def owes(self, token: object) -> float:
        """What `token` owes the pool now."""
        self._refill()
        return max(0.0, self._due.get(token, self._paid) - self._paid)

    def level(self) -> float:
        """Credits left to draw."""
        self._refill()
        return max(0.0, self.size - self._owed)

    def draw(self, token: object, n: int) -> int:
        """Up to `n` whole credits for `token`: none while it owes as much as the level left."""
        owes, level = self.owes(token), self.level()
        if owes >= level:
            return 0
        got = int(min(n, level))
        if got > 0:
            self._owe(token, owes + got)
        return got

    def give_back(self, token: object, n: float) -> None:
        """Credits `token` drew and did not use (as far as it still owes them)."""
        owes = self.owes(token)
        self._owe(token, owes - min(n, owes))

    def _owe(self, token: object, debt: float) -> None:
        self._owed += debt - max(0.0, self._due.get(token, self._paid) - self._paid)
        if debt <= 0:
            self._due.pop(token, None)
            return
        self._due[token] = due = self._paid + debt
        heapq.heappush(self._heap, (due, next(self._seq), token))
        if len(self._heap) > 4 * len(self._due) + 64:   # (entries replaced: rebuilt)
            self._heap = [(d, next(self._seq), t) for t, d in self._due.items()]
            heapq.heapify(self._heap)
