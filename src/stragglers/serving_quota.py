"""Limits per key (a token, a client address, a job) on requests in progress and the body
bytes they hold, so that one writer cannot take a whole service's upload budget."""

from __future__ import annotations


class LimitExceeded(Exception):
    """A key is at one of its limits: `what` says which (one line, for the service's error)."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class KeyedLimits:
    """Requests in progress and body bytes held per key, each bounded (used on one event loop:
    no lock). `name` says what a key is, in the messages ("token", "client", "job").

    A key holding nothing is always let in with one body (a part larger than the byte limit
    could otherwise never be stored); past that, a body whose bytes would take the key past
    `max_bytes` is refused as they arrive, like the service's own budget.
    """

    def __init__(self, name: str, max_requests: int, max_bytes: int):
        self.name, self.max_requests, self.max_bytes = name, max_requests, max_bytes
        self.requests: dict[object, int] = {}
        self.held: dict[object, int] = {}

    def enter(self, key: object) -> None:
        """Count a request of `key` in progress; LimitExceeded past max_requests."""
        n = self.requests.get(key, 0)
        if n >= self.max_requests:
            raise LimitExceeded(f"this {self.name} has {n} requests in progress, its limit")
        self.requests[key] = n + 1

    def leave(self, key: object) -> None:
        """A request of `key` is over."""
        n = self.requests.get(key, 0) - 1
        if n > 0:
            self.requests[key] = n
        else:
            self.requests.pop(key, None)

    def fits(self, key: object, n: int) -> bool:
        """Whether a body of `n` bytes (declared) would be let in now."""
        held = self.held.get(key, 0)
        return held == 0 or held + n <= self.max_bytes

    def take(self, key: object, n: int, mine: int = 0) -> None:
        """Count `n` more body bytes of `key` (`mine`: what this request holds already);
        LimitExceeded when the key holds bytes of other requests and would pass max_bytes."""
        held = self.held.get(key, 0)
        if held - mine > 0 and held + n > self.max_bytes:
            raise LimitExceeded(f"this {self.name} holds {held} bytes of uploads, at most "
                                f"{self.max_bytes}")
        self.held[key] = held + n

    def give(self, key: object, n: int) -> None:
        """`n` body bytes of `key` are let go of."""
        left = self.held.get(key, 0) - n
        if left > 0:
            self.held[key] = left
        else:
            self.held.pop(key, None)


class RequestLimits:
    """One request's share of several KeyedLimits (its token's, its client's, ...): entered
    at once, bytes taken from all, everything given back by `close` and `give`."""

    def __init__(self, pairs: list[tuple[KeyedLimits, object]]):
        self.pairs: list[tuple[KeyedLimits, object]] = []
        self.open = True
        try:
            for limits, key in pairs:
                limits.enter(key)
                self.pairs.append((limits, key))
        except LimitExceeded:
            self.close()
            raise

    def fits(self, n: int) -> bool:
        """Whether a body of `n` bytes (declared) would be let in by every limit now."""
        return all(limits.fits(key, n) for limits, key in self.pairs)

    def take(self, n: int, mine: int = 0) -> None:
        """Count `n` body bytes in every limit, none when one refuses them."""
        done = []
        try:
            for limits, key in self.pairs:
                limits.take(key, n, mine)
                done.append((limits, key))
        except LimitExceeded:
            for limits, key in done:
                limits.give(key, n)
            raise

    def give(self, n: int) -> None:
        """`n` body bytes let go of, in every limit."""
        for limits, key in self.pairs:
            limits.give(key, n)

    def close(self) -> None:
        """The request is over (its bytes are given back separately); idempotent."""
        if self.open:
            self.open = False
            for limits, key in self.pairs:
                limits.leave(key)
