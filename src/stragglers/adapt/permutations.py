"""Per-epoch shuffles kept in memory, bounded in bytes, each computed once (single flight).

A shuffle of 2**26 samples takes seconds; the service computes it on its own threads (never on
the commit thread, see `service.py`), so one big data set's new epoch delays only its own leases.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable

import msgspec
import numpy as np

from stragglers.adapt.dataset import epoch_permutation

Key = tuple[int, int, int]  # (num_samples, seed, epoch): the shuffle depends on nothing else


class Pending(msgspec.Struct, frozen=True):
    """Indices of a lease whose epoch's shuffle is not in memory yet (filled off the commit thread)."""

    key: Key
    start: int
    stop: int


class Permutations:
    """LRU of epoch permutations (int32) up to `max_bytes`; concurrent requests share one computation.

    Also an LRU of the JSON arrays of leased ranges (`json`), up to `max_json_bytes`.
    """

    def __init__(self, max_bytes: int = 512 << 20, max_json_bytes: int = 32 << 20):
        self.max_bytes, self.max_json_bytes = max_bytes, max_json_bytes
        self._lock = threading.Lock()
        self._cache: OrderedDict[Key, np.ndarray] = OrderedDict()
        self._json: OrderedDict[Pending, msgspec.Raw] = OrderedDict()
        self._json_bytes = 0
        self.encoded = 0   # ranges made JSON (not found in the LRU: tested)
        self._running: dict[Key, threading.Event] = {}
        self.computed = 0
        self.threads: set[str] = set()  # names of the threads shuffles ran on (tested)

    def cached(self, key: Key) -> np.ndarray | None:
        """The permutation if it is in memory (no computation)."""
        with self._lock:
            perm = self._cache.get(key)
            if perm is not None:
                self._cache.move_to_end(key)
            return perm

    def get(self, key: Key) -> np.ndarray:
        """The permutation, computed here (once, whoever asks meanwhile waits for it)."""
        while True:
            with self._lock:
                perm = self._cache.get(key)
                if perm is not None:
                    self._cache.move_to_end(key)
                    return perm
                running = self._running.get(key)
                if running is None:
                    running = self._running[key] = threading.Event()
                    break
            running.wait()
        try:
            self.threads.add(threading.current_thread().name)
            perm = epoch_permutation(*key)
            with self._lock:
                self._keep(key, perm)
                self.computed += 1
            return perm
        finally:
            with self._lock:
                del self._running[key]
            running.set()

    def _keep(self, key: Key, perm: np.ndarray) -> None:
        used = sum(p.nbytes for p in self._cache.values())
        while self._cache and used + perm.nbytes > self.max_bytes:
            used -= self._cache.popitem(last=False)[1].nbytes
        self._cache[key] = perm

    def json(self, pending: Pending, encode: Callable[[np.ndarray], msgspec.Raw],
             perm: np.ndarray | None = None) -> msgspec.Raw:
        """The JSON array of a range, `encode`d from its permutation unless kept: a replayed
        lease of 4 x 65,536 indices took ~21 ms of CPU to write each time (1.7 MB), five
        clients replaying theirs in a loop ~0.6 of the service's cores. `perm`: the
        permutation, computed already (not looked up: it may have left the LRU since)."""
        with self._lock:
            body = self._json.get(pending)
            if body is not None:
                self._json.move_to_end(pending)
                return body
        if perm is None:
            perm = self.get(pending.key)
        body = encode(perm[pending.start:pending.stop])
        with self._lock:
            self.encoded += 1
            if pending not in self._json and len(body) <= self.max_json_bytes:
                while self._json and self._json_bytes + len(body) > self.max_json_bytes:
                    self._json_bytes -= len(self._json.popitem(last=False)[1])
                self._json[pending] = body
                self._json_bytes += len(body)
        return body

    def wanted(self, pending: Pending) -> bool:
        """Whether writing `pending`'s JSON needs its permutation (its JSON is not kept)."""
        with self._lock:
            return pending not in self._json

    def indices(self, key: Key, start: int, stop: int) -> list[int]:
        """Positions start..stop of the permutation, as a list (computed if needed)."""
        return self.get(key)[start:stop].tolist()
