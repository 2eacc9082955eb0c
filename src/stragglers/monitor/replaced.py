"""The run tokens of a job that newer runs replaced, as its row keeps them: the last
MAX_SUPERSEDED by name (named in messages), and every one ever replaced in a Bloom filter of
fixed size. A run's token is all that tells an old recorder's run (no `extra.started`) from a
newer one: with the last 16 alone, a stale run whose token had been forgotten was taken as a
new run and reset the current run's parts and windows away.
"""

from __future__ import annotations

import base64
import hashlib
import json
from typing import Any, NamedTuple

MAX_SUPERSEDED = 16        # run tokens kept by name
SEEN_BITS = 1 << 14        # the filter: 2 KiB a job row (2.7 kB as base64)
SEEN_HASHES = 8            # bits set per token
# The chance that a token never replaced reads as replaced (a new run refused 409, its uploader
# stopped), after n replaced runs, is (1 - e^(-8n/16384))^8: 6e-9 after 200 runs of one job
# name, 5e-4 after 1,000 (tests/monitor/test_monitor_replaced_runs.py measures it).


class Replaced(NamedTuple):
    """A job row's replaced runs: the last tokens, and the filter of all (None: none)."""

    last: list[str]
    seen: bytes | None


def read(text: Any) -> Replaced:
    """The row's value (a JSON list of tokens as stores before the filter wrote it, or
    {"last": [...], "seen": base64}); a damaged value reads as none."""
    try:
        value = json.loads(text) if text else []
    except (TypeError, ValueError, RecursionError):
        return Replaced([], None)
    if isinstance(value, list):
        return Replaced([t for t in value if isinstance(t, str)], None)
    if not isinstance(value, dict):
        return Replaced([], None)
    last = value.get("last")
    last = [t for t in last if isinstance(t, str)] if isinstance(last, list) else []
    try:
        seen = base64.b64decode(value.get("seen") or "", validate=True)
    except (TypeError, ValueError):
        seen = b""
    return Replaced(last, seen if len(seen) == SEEN_BITS // 8 else None)


def _bits(token: str) -> list[int]:
    digest = hashlib.sha256(token.encode()).digest()
    return [int.from_bytes(digest[4 * i:4 * i + 4], "little") % SEEN_BITS
            for i in range(SEEN_HASHES)]


def was_replaced(text: Any, token: str) -> bool:
    """Whether `token` is one the row lists as replaced, by name or in its filter."""
    r = read(text)
    if token in r.last:
        return True
    return r.seen is not None and all(r.seen[b >> 3] >> (b & 7) & 1 for b in _bits(token))


def with_replaced(text: Any, token: str) -> str:
    """The row's value with `token` replaced: kept by name (the last MAX_SUPERSEDED) and set
    in the filter (the tokens named by a store from before it are set too)."""
    r = read(text)
    seen = bytearray(r.seen or bytes(SEEN_BITS // 8))
    for t in ([] if r.seen is not None else r.last) + [token]:
        for b in _bits(t):
            seen[b >> 3] |= 1 << (b & 7)
    last = r.last if token in r.last else (r.last + [token])[-MAX_SUPERSEDED:]
    return json.dumps({"last": last, "seen": base64.b64encode(bytes(seen)).decode()})
