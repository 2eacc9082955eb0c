"""SIGTERM writes out the recorded steps before the process goes: torchrun stops a job with it."""

from __future__ import annotations

import os
import signal
import threading
from typing import Callable


class FlushOnTerm:
    """While installed, SIGTERM first runs `flush`, then does what it did before.

    torchrun (and `stragglers record`, and schedulers) stop workers with SIGTERM, whose default
    action ends the process at once: the steps still queued for the writer (up to one flush
    interval of them) would be lost. A handler the program had is chained after the flush; a
    default action is re-raised, so the process still dies by the signal (exit status 143 under
    a shell). An ignored SIGTERM, or a recorder started off the main thread (Python runs
    handlers there only), is left alone.
    """

    def __init__(self, flush: Callable[[], None]):
        self._flush = flush
        self._previous = None
        self.installed = False
        if threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN or previous is None:  # None: set outside Python, keep it
            return
        self._previous = previous
        signal.signal(signal.SIGTERM, self._handle)
        self.installed = True

    def remove(self) -> None:
        """Put the previous handler back, unless the program has replaced ours since."""
        if not self.installed:
            return
        self.installed = False
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) == self._handle:
            signal.signal(signal.SIGTERM, self._previous)

    def _handle(self, signum, frame) -> None:
        previous = self._previous
        self.remove()
        try:
            self._flush()
        finally:
            if callable(previous):
                previous(signum, frame)
            else:  # the default action: end the process by the signal, as it would have
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
