"""Push for the dashboard: a Server-Sent Events stream that says when the store changed.

A page subscribes once (`GET /api/events`, `text/event-stream`) and re-reads the JSON API when
told, instead of polling: a window shows on the page as soon as it is stored, not up to a poll
period later. Each event carries only the store's version; what changed is read from the API as
before, so the stream holds no state a page could miss (a reconnecting EventSource just reads
again). Writes wake the subscribers from the writing thread without waiting on them; a
subscriber is told at most every `min_interval_s` (ingest commits many times a second), and the
number of subscribers and the life of a stream are bounded (the browser reconnects by itself).
The subscriber slots are shared among client addresses: when all are taken, a client holding
fewer than another gets one of that client's (its oldest stream ends), so one client cannot
hold every slot and lock the others' pages out of push.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import AsyncIterator

from stragglers.serving import REQUEST_CLIENT

HEARTBEAT_S = 15.0


class _Subscriber:
    """One open stream: where to wake it, whose it is, whether its slot was given away."""

    __slots__ = ("loop", "event", "client", "since", "ended")

    def __init__(self, loop: asyncio.AbstractEventLoop, client: str | None):
        self.loop, self.event, self.client = loop, asyncio.Event(), client
        self.since, self.ended = time.monotonic(), False


class ChangeFeed:
    """Wakes event-stream subscribers (asyncio tasks) when the store commits a write."""

    def __init__(self, store, max_subscribers: int = 64, min_interval_s: float = 0.1,
                 max_stream_s: float = 600.0):
        self.store = store
        self.max_subscribers, self.min_interval_s = max_subscribers, min_interval_s
        self.max_stream_s = max_stream_s
        self._subscribers: set[_Subscriber] = set()
        self._lock = threading.Lock()
        self.closing = False
        store.on_change(self._changed)

    def _changed(self, _version: int) -> None:
        with self._lock:
            subscribers = list(self._subscribers)
        for sub in subscribers:
            try:
                sub.loop.call_soon_threadsafe(sub.event.set)
            except RuntimeError:  # that loop closed (server shut down); its stream is gone
                pass

    def full(self) -> bool:
        """Whether the client of the request being served (serving.REQUEST_CLIENT) is refused
        a stream: all slots are taken and it holds as many as any other client. When another
        holds more, that client's oldest stream ends to make room (True means refused)."""
        client = REQUEST_CLIENT.get()
        with self._lock:
            if len(self._subscribers) < self.max_subscribers:
                return False
            held: dict[str | None, list[_Subscriber]] = {}
            for sub in self._subscribers:
                held.setdefault(sub.client, []).append(sub)
            mine = len(held.get(client, ()))
            most = max(held.values(), key=lambda subs: (len(subs), -min(s.since for s in subs)))
            if len(most) <= mine:
                return True
            victim = min(most, key=lambda s: s.since)
            victim.ended = True
            self._subscribers.discard(victim)
        try:
            victim.loop.call_soon_threadsafe(victim.event.set)
        except RuntimeError:   # its loop is closed: the stream is gone already
            pass
        return False

    def close(self) -> None:
        """End every stream (at shutdown, so the server need not wait for the browsers)."""
        self.closing = True
        self._changed(self.store.version)

    async def stream(self) -> AsyncIterator[str]:
        """SSE text: `event: change` with the store version on every (coalesced) change."""
        sub = _Subscriber(asyncio.get_running_loop(), REQUEST_CLIENT.get())
        with self._lock:
            self._subscribers.add(sub)
        try:
            # the first event tells the page where the store stands (it may have missed writes
            # between its last read and subscribing)
            yield _event(self.store.version)
            seen, end = self.store.version, time.monotonic() + self.max_stream_s
            while not self.closing and not sub.ended and time.monotonic() < end:
                try:
                    await asyncio.wait_for(sub.event.wait(), HEARTBEAT_S)
                except asyncio.TimeoutError:
                    yield ": keep-alive\n\n"
                    continue
                sub.event.clear()
                if self.closing or sub.ended:
                    break   # (a page whose slot went to another client reconnects or polls)
                if self.store.version != seen:
                    seen = self.store.version
                    yield _event(seen)
                    await asyncio.sleep(self.min_interval_s)
        finally:
            with self._lock:
                self._subscribers.discard(sub)


def _event(version: int) -> str:
    return f"event: change\ndata: {json.dumps({'version': version})}\n\n"
