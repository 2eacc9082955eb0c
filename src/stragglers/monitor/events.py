"""Push for the dashboard: a Server-Sent Events stream that says when the store changed.

A page subscribes once (`GET /api/events`, `text/event-stream`) and re-reads the JSON API when
told, instead of polling: a window shows on the page as soon as it is stored, not up to a poll
period later. Each event carries only the store's version; what changed is read from the API as
before, so the stream holds no state a page could miss (a reconnecting EventSource just reads
again). Writes wake the subscribers from the writing thread without waiting on them; a
subscriber is told at most every `min_interval_s` (ingest commits many times a second), and the
number of subscribers and the life of a stream are bounded (the browser reconnects by itself).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import AsyncIterator

HEARTBEAT_S = 15.0


class ChangeFeed:
    """Wakes event-stream subscribers (asyncio tasks) when the store commits a write."""

    def __init__(self, store, max_subscribers: int = 64, min_interval_s: float = 0.1,
                 max_stream_s: float = 600.0):
        self.store = store
        self.max_subscribers, self.min_interval_s = max_subscribers, min_interval_s
        self.max_stream_s = max_stream_s
        self._subscribers: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._lock = threading.Lock()
        self.closing = False
        store.on_change(self._changed)

    def _changed(self, _version: int) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for loop, event in subscribers:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # that loop closed (server shut down); its stream is gone
                pass

    def full(self) -> bool:
        """Whether a new subscriber would exceed the bound."""
        with self._lock:
            return len(self._subscribers) >= self.max_subscribers

    def close(self) -> None:
        """End every stream (at shutdown, so the server need not wait for the browsers)."""
        self.closing = True
        self._changed(self.store.version)

    async def stream(self) -> AsyncIterator[str]:
        """SSE text: `event: change` with the store version on every (coalesced) change."""
        loop, event = asyncio.get_running_loop(), asyncio.Event()
        entry = (loop, event)
        with self._lock:
            self._subscribers.add(entry)
        try:
            # the first event tells the page where the store stands (it may have missed writes
            # between its last read and subscribing)
            yield _event(self.store.version)
            seen, end = self.store.version, time.monotonic() + self.max_stream_s
            while not self.closing and time.monotonic() < end:
                try:
                    await asyncio.wait_for(event.wait(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                event.clear()
                if self.closing:
                    break
                if self.store.version != seen:
                    seen = self.store.version
                    yield _event(seen)
                    await asyncio.sleep(self.min_interval_s)
        finally:
            with self._lock:
                self._subscribers.discard(entry)


def _event(version: int) -> str:
    return f"event: change\ndata: {json.dumps({'version': version})}\n\n"
