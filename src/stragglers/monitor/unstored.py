"""Decisions whose write the store refused (a full disk, a locked or unreachable store): kept
until a write of them commits, and the refusal said once, not at every retry.

A tick takes what it decides out of its pending state (a window's rows, a job's state, a rank's
silence) before it stores it; a write that failed there lost it (a window closed by a stall on
a full disk was never stored, nor analysed, once space came back). What such a write was to
store stays here, and the tick writes it again at each later tick.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from stragglers.monitor.alerts import Changes

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldState:
    """A job state decided here, with the alert changes it caused, not stored yet."""

    state: str
    changes: Changes
    finished_at: float | None


class WriteTrouble:
    """Says once that a kind of write (a job's state, its silent ranks, ...) is refused, and
    once that it is stored again: one line each, not a traceback per tick."""

    def __init__(self, storage_errors: tuple[type[Exception], ...]):
        self.storage_errors = (*storage_errors, OSError)
        self._failing: set[str] = set()
        self._lock = threading.Lock()

    def refused(self, what: str, exc: Exception, detail: str = "") -> None:
        """A write of `what` (`detail`: which) failed; it is kept and written again at the
        next tick."""
        with self._lock:
            first = what not in self._failing
            self._failing.add(what)
        if not first:
            return
        text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        # a storage error is the disk's or the store's (one line); anything else is a bug
        # (its traceback, once)
        log.error("%s%s not stored (%s); kept, and written again at each tick until it is",
                  what, detail, text, exc_info=not isinstance(exc, self.storage_errors))

    def stored(self, what: str) -> None:
        """A write of `what` committed (said when it had been refused)."""
        with self._lock:
            if what not in self._failing:
                return
            self._failing.discard(what)
        log.warning("%s stored now", what)

    def failing(self) -> list[str]:
        """What is refused now."""
        with self._lock:
            return sorted(self._failing)
