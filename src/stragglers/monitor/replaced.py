"""The run tokens of a job that newer runs replaced, as its row keeps them: the last
MAX_SUPERSEDED by name (named in messages), and the last MAX_REPLACED by a 4-byte hash each. A
run's token is all that tells an old recorder's run (no `extra.started`) from a newer one: with
the last 16 alone, a stale run whose token had been forgotten was taken as a new run and reset
the current run's parts and windows away.

A token never replaced whose hash is one of n stored reads as replaced: its run's metadata and
parts are refused 409 superseded_run and its uploader stops — the new run is lost. Its chance
is at most n / 2**32 (2.3e-5 at the cap, FALSE_BOUND = 1e-4 documented), at any count: the
hashes grow with the runs (4 bytes a run, 200 KB at the cap). The Bloom filter of fixed size
(2 KiB, 8 hashes) before them erred for 2.3% of new runs after 2,000 replaced ones and nearly
all after 20,000 (tests/monitor/test_replaced_false_rate.py); a row that has one keeps it as it
is (its tokens are not known to hash again), checked as before, and adds no more to it.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any, NamedTuple

MAX_SUPERSEDED = 16        # run tokens kept by name
MAX_REPLACED = 50_000      # run tokens kept by hash (past it the oldest are forgotten)
HASH_BYTES = 4
FALSE_BOUND = 1e-4         # a new run read as replaced, at most (MAX_REPLACED / 2**32 = 1.2e-5)
SEEN_BITS = 1 << 14        # the Bloom filter rows before the hashes have: 2 KiB
SEEN_HASHES = 8            # bits set per token in it


class Replaced(NamedTuple):
    """A job row's replaced runs: the last tokens, every one's hash (oldest first), and the
    Bloom filter of a row from before the hashes (None: none)."""

    last: list[str]
    hashes: bytes
    seen: bytes | None

    def has(self, token: str) -> bool:
        """Whether `token` is one listed as replaced, by name, by hash or in the old filter."""
        if token in self.last or _holds(self.hashes, _hash(token)):
            return True
        return self.seen is not None and all(self.seen[b >> 3] >> (b & 7) & 1
                                             for b in _bits(token))


def read(text: Any) -> Replaced:
    """The row's value (a JSON list of tokens as stores before the filter wrote it, or
    {"last": [...], "hashes": base64, "seen": base64}); a damaged part reads as none."""
    try:
        value = json.loads(text) if text else []
    except (TypeError, ValueError, RecursionError):
        return Replaced([], b"", None)
    if isinstance(value, list):
        return Replaced([t for t in value if isinstance(t, str)], b"", None)
    if not isinstance(value, dict):
        return Replaced([], b"", None)
    last = value.get("last")
    last = [t for t in last if isinstance(t, str)] if isinstance(last, list) else []
    seen, hashes = _decoded(value.get("seen")), _decoded(value.get("hashes"))
    if len(hashes) % HASH_BYTES:
        hashes = b""   # damaged: not whole hashes
    return Replaced(last, hashes[-MAX_REPLACED * HASH_BYTES:],
                    seen if len(seen) == SEEN_BITS // 8 else None)


def _decoded(text: Any) -> bytes:
    try:
        return base64.b64decode(text or "", validate=True)
    except (TypeError, ValueError):
        return b""


def _hash(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()[:HASH_BYTES]


def _holds(hashes: bytes | bytearray, h: bytes) -> bool:
    """Whether `h` is one of the whole hashes in `hashes` (a match across two is not)."""
    i = hashes.find(h)
    while i >= 0:
        if i % HASH_BYTES == 0:
            return True
        i = hashes.find(h, i + 1)
    return False


def _bits(token: str) -> list[int]:
    digest = hashlib.sha256(token.encode()).digest()
    return [int.from_bytes(digest[4 * i:4 * i + 4], "little") % SEEN_BITS
            for i in range(SEEN_HASHES)]


def was_replaced(text: Any, token: str) -> bool:
    """Whether `token` is one the row lists as replaced (Replaced.has)."""
    return read(text).has(token)


def with_replaced(text: Any, *tokens: str) -> str:
    """The row's value with `tokens` replaced, in order: kept by name (the last
    MAX_SUPERSEDED) and by hash (the last MAX_REPLACED; the tokens a store from before the
    filter named are hashed too)."""
    r = read(text)
    hashes, last = bytearray(r.hashes), list(r.last)
    older = last if not r.hashes and r.seen is None else []   # (a plain list, from before)
    adding = [*older, *tokens]
    # (several at once: a set of those held, not a search of them all per token)
    known = {bytes(hashes[i:i + HASH_BYTES]) for i in range(0, len(hashes), HASH_BYTES)} \
        if len(adding) > 1 else None
    for t in adding:
        h = _hash(t)
        if not (h in known if known is not None else _holds(hashes, h)):
            hashes += h
            if known is not None:
                known.add(h)
        if t not in last:
            last.append(t)
    last = last[-MAX_SUPERSEDED:]
    value: dict[str, Any] = {"last": last, "hashes": base64.b64encode(
        bytes(hashes[-MAX_REPLACED * HASH_BYTES:])).decode()}
    if r.seen is not None:
        value["seen"] = base64.b64encode(r.seen).decode()
    return json.dumps(value)
