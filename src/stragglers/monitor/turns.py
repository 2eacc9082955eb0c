"""A queue served by turns: one item of each key in turn, each key's items in their order."""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class Turns(Generic[T]):
    """queue.Queue's put/get/get_nowait/qsize/empty, but get() takes from the keys in turn (round robin): one
    key's backlog (a job's thousands of windows) waits behind one item of each other key, not
    the others behind all of it. Items of one key keep their order.

    A key's turn is handed on when the work on its item finishes — done(), or the taker's next
    get() — not when the item is taken: handed on at take, a key arriving during a long piece
    of work queued behind the worked key's next item too, and a second taker could work on a
    key's next item beside the one still in hand (out of order). Until then the key's other
    items wait (they are counted by qsize)."""

    def __init__(self, key: Callable[[T], Hashable]):
        self._key = key
        self._ready = threading.Condition()
        self._keys: OrderedDict[Hashable, deque[T]] = OrderedDict()   # keys in turn
        self._held: dict[Hashable, deque[T]] = {}   # keys whose item is being worked on
        self._mine = threading.local()   # the key of the item this thread works on
        self._size = 0

    def put(self, item: T) -> None:
        """Queue `item` behind its key's items (a new key takes its turn after the others)."""
        key = self._key(item)
        with self._ready:
            held = self._held.get(key)
            if held is not None:
                held.append(item)
            else:
                self._keys.setdefault(key, deque()).append(item)
                self._ready.notify()
            self._size += 1

    def get(self) -> T:
        """The next key's oldest item, waiting for one; the calling thread's previous item is
        done (its key goes to the back)."""
        with self._ready:
            self._done()
            while not self._keys:
                self._ready.wait()
            return self._take()

    def get_nowait(self) -> T:
        """get(), or queue.Empty when no key's item can be taken now."""
        with self._ready:
            self._done()
            if not self._keys:
                raise queue.Empty
            return self._take()

    def done(self) -> None:
        """The work on the calling thread's item is over: its key's turn goes on."""
        with self._ready:
            self._done()

    def _done(self) -> None:
        """done() with the lock held."""
        if not getattr(self._mine, "held", False):
            return
        key, self._mine.held = self._mine.key, False
        items = self._held.pop(key)
        if items:   # its next item queues behind every other key's
            self._keys[key] = items
            self._ready.notify()

    def _take(self) -> T:
        """The next key's oldest item (the lock held); its key is held until done."""
        key, items = self._keys.popitem(last=False)
        item = items.popleft()
        self._held[key] = items
        self._mine.key, self._mine.held = key, True
        self._size -= 1
        return item

    def qsize(self) -> int:
        """How many items are queued (a held key's waiting ones too)."""
        with self._ready:
            return self._size

    def empty(self) -> bool:
        """Whether nothing is queued."""
        return self.qsize() == 0
