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
    the others behind all of it. Items of one key keep their order."""

    def __init__(self, key: Callable[[T], Hashable]):
        self._key = key
        self._ready = threading.Condition()
        self._keys: OrderedDict[Hashable, deque[T]] = OrderedDict()
        self._size = 0

    def put(self, item: T) -> None:
        """Queue `item` behind its key's items (a new key takes its turn after the others)."""
        with self._ready:
            self._keys.setdefault(self._key(item), deque()).append(item)
            self._size += 1
            self._ready.notify()

    def get(self) -> T:
        """The next key's oldest item (that key then goes to the back), waiting for one."""
        with self._ready:
            while not self._size:
                self._ready.wait()
            return self._take()

    def get_nowait(self) -> T:
        """get(), or queue.Empty when nothing is queued."""
        with self._ready:
            if not self._size:
                raise queue.Empty
            return self._take()

    def _take(self) -> T:
        """The next key's oldest item (the lock held)."""
        key, items = next(iter(self._keys.items()))
        item = items.popleft()
        if items:
            self._keys.move_to_end(key)
        else:
            del self._keys[key]
        self._size -= 1
        return item

    def qsize(self) -> int:
        """How many items are queued."""
        with self._ready:
            return self._size

    def empty(self) -> bool:
        """Whether nothing is queued."""
        return self.qsize() == 0
