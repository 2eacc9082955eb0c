"""A clock the adapt tests move by hand (a store's, a pace's `clock`): time passes only when a
test sets `now`."""

from __future__ import annotations


class Clock:
    """A clock the test moves: `now`, called."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
