"""Calls of many keys (tokens) on one pool, the keys served in turn (round robin)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor


class KeyedTurns:
    """A pool's calls taken a key at a time, the keys in turn: a key's backlog waits behind one
    call of each other key, never the others behind all of it.

    A key whose call is running is out of the turn until the call ends, then goes behind the
    keys that came meanwhile (unlike monitor.turns.Turns, which moves it back when the call
    is taken): a new key's call waits for the one running and at most one call of each other
    key. On one FIFO shuffle thread, one token's leases of three big unshuffled epochs queued
    another job's lease behind all three shuffles (2.7 s against 3 ms); one key's calls run one
    at a time.
    """

    def __init__(self, threads: int, thread_name_prefix: str):
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix=thread_name_prefix)
        self._lock = threading.Lock()
        # each key with a call waiting or running -> its waiting calls, in their order
        self._calls: dict[Hashable, deque[tuple[Future, Callable, tuple]]] = {}
        self._turns: deque[Hashable] = deque()   # keys with a call waiting and none running
        self._closed = False

    def submit(self, key: Hashable, fn: Callable, *args) -> Future:
        """A future of fn(*args), run in `key`'s turn; RuntimeError once shut down."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot schedule new calls after shutdown")
            calls = self._calls.get(key)
            if calls is None:
                calls = self._calls[key] = deque()
                self._turns.append(key)
            calls.append((fut, fn, args))
        # (one task a call: a task serves the turns until none is left, so a call is never
        # left waiting with no task to take it, whichever task ran the calls before it)
        self._pool.submit(self._serve)
        return fut

    def counts(self) -> tuple[int, int]:
        """(calls waiting, calls running)."""
        with self._lock:
            waiting = sum(len(c) for c in self._calls.values())
            return waiting, len(self._calls) - len(self._turns)

    def _serve(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._turns:
                    return
                key = self._turns.popleft()
                fut, fn, args = self._calls[key].popleft()
            try:
                if fut.set_running_or_notify_cancel():   # (else its caller has gone)
                    try:
                        fut.set_result(fn(*args))
                    except BaseException as exc:  # noqa: BLE001 - the caller's to handle
                        fut.set_exception(exc)
            finally:
                with self._lock:
                    if self._calls[key]:
                        self._turns.append(key)
                    else:
                        del self._calls[key]

    def shutdown(self) -> None:
        """Stop: the calls running end, those waiting are cancelled."""
        with self._lock:
            self._closed = True
            waiting = [fut for calls in self._calls.values() for fut, _, _ in calls]
            for calls in self._calls.values():
                calls.clear()
        for fut in waiting:
            fut.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
