"""Restore bodies parsed, validated and prepared in a child process, not the serving one.

Parsing a 655,360-row snapshot (26 MB of JSON) and checking and preparing its rows is ~3.5 s of
pure Python. On a thread of the service it held the GIL that the event loop and the commit
thread need: each of their wake-ups waited a switch interval (5 ms) behind it, and a loop of
owner restores made every other job's lease + ack ~5x slower. In a child process it costs the
service nothing; the rows come back packed RESTORE_CHUNK to a bytes object (unpacked one chunk
per commit step), so no step holds the GIL for more than one chunk.
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from stragglers.adapt import requests as rq
from stragglers.adapt.dataset import validate_snapshot
from stragglers.adapt.errors import Busy
from stragglers.adapt.restores import PreparedRestore, prepare_restore
from stragglers.errors import InputError, StragglersError


def checked_snapshot(raw: bytes, name: str) -> PreparedRestore:
    """Parse, validate and prepare a restore body (its rows packed in chunks)."""
    body = rq.parse(rq.Snapshot, raw)
    if body.dataset.name != name:
        raise InputError("snapshot", "dataset.name", f"expected '{name}' (the URL's data set),"
                         f" got '{body.dataset.name}'")
    # validate_snapshot checks the JSON form (what a checkpoint holds): rows as lists
    snap = {"dataset": body.dataset.model_dump(), "epochs_created": body.epochs_created,
            "shards": [list(r) for r in body.shards]}
    return prepare_restore(validate_snapshot(snap))


def _in_child(raw: bytes, name: str) -> tuple:
    """checked_snapshot in the child; its refusals as plain values (InputError's constructor
    takes three arguments: it does not survive pickling as an exception)."""
    try:
        return ("ok", checked_snapshot(raw, name))
    except InputError as exc:
        return ("input", type(exc), exc.source, exc.field, exc.problem)
    except StragglersError as exc:
        return ("error", type(exc), str(exc))


class SnapshotParser:
    """A pool of `n` child processes (started at the first restore) that prepare restores."""

    def __init__(self, n: int):
        self.n = n
        self._pool: ProcessPoolExecutor | None = None

    async def prepare(self, raw: bytes, name: str) -> PreparedRestore:
        """checked_snapshot(raw, name) in a child process; its refusals raised here."""
        if self._pool is None:
            # spawn: a fork of this threaded process could copy a held lock
            self._pool = ProcessPoolExecutor(self.n, multiprocessing.get_context("spawn"))
        try:
            out = await asyncio.wrap_future(self._pool.submit(_in_child, raw, name))
        except (BrokenProcessPool, RuntimeError, OSError) as exc:
            # killed (out of memory), or could not start (an embedding script without a
            # __main__ guard, out of processes): a new pool for the next restore, not a 500
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
            raise Busy(f"the process preparing restores died or could not start"
                       f" ({type(exc).__name__}); retry later") from None
        if out[0] == "input":
            raise out[1](out[2], out[3], out[4])
        if out[0] == "error":
            raise out[1](out[2])
        return out[1]

    def close(self) -> None:
        """Stop the child processes (a restore being prepared is finished first: waiting lets
        the pool release its queues and locks, which a process exiting under it would leak)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

