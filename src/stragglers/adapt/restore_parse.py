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
import os
import pickle
import struct
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

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
            "shards": [list(r) for r in body.shards], "folded_epochs": body.folded_epochs}
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


class _Child:
    """One child process that prepares restores: `python -c` running `serve`, requests and
    answers as length-prefixed pickles on its stdin and stdout.

    Not multiprocessing's spawn: that runs the parent's __main__ again in the child, and in
    embedded mode __main__ is the user's training script — one without a __main__ guard was
    run a second time (its top level: another server, another rank) by the first restore,
    and every restore was refused."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from stragglers.adapt.restore_parse import serve; serve()"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, close_fds=True)

    def call(self, raw: bytes, name: str) -> tuple:
        """_in_child(raw, name) in the child (blocking); OSError when the child is gone."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        data = pickle.dumps((raw, name), protocol=pickle.HIGHEST_PROTOCOL)
        self.proc.stdin.write(_LEN.pack(len(data)) + data)
        self.proc.stdin.flush()
        return pickle.loads(_read_exactly(self.proc.stdout, _LEN.unpack(
            _read_exactly(self.proc.stdout, _LEN.size))[0]))

    def stop(self, timeout: float) -> None:
        """Close its input (it exits after the request in hand) and wait; killed past it."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


_LEN = struct.Struct("<Q")


def _read_exactly(stream, n: int) -> bytes:
    data = stream.read(n)
    if data is None or len(data) != n:
        raise EOFError("the child process ended")
    return data


# the child's niceness above the service's: its seconds of pure Python per restore, at the
# service's priority on a busy machine, took CPUs the event loop, the commit thread and the
# jobs' own clients wait for (a loop of restores and deletes: another job's lease + ack 12.7x
# its quiet latency, 2.6x less the run-queue wait); at 10 it yields to them, not to idle
CHILD_NICE = 10


def serve() -> None:
    """The child's loop: a request from stdin, its answer to stdout, until stdin closes."""
    if hasattr(os, "nice"):
        os.nice(CHILD_NICE)   # (raising one's own niceness is always allowed)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr   # (nothing else may write to the answers' pipe)
    while True:
        try:
            size = _LEN.unpack(_read_exactly(stdin, _LEN.size))[0]
            raw, name = pickle.loads(_read_exactly(stdin, size))
        except EOFError:
            return
        try:
            out = _in_child(raw, name)
        except Exception as exc:   # noqa: BLE001 - a bug: a 500 in the parent, not a dead child
            out = ("error", RuntimeError, f"preparing the restore failed: {exc!r:.200}")
        data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
        stdout.write(_LEN.pack(len(data)) + data)
        stdout.flush()


class SnapshotParser:
    """At most `n` child processes (started at the first restores) that prepare restores."""

    def __init__(self, n: int):
        self.n = n
        self._idle: list[_Child] = []
        self._busy: set[_Child] = set()
        self._lock = threading.Lock()
        self._closed = False
        # a thread per child: each waits on its child's answer (the event loop never does)
        self._threads = ThreadPoolExecutor(n, thread_name_prefix="shard-restores")

    def pids(self) -> list[int]:
        """The process ids of the children running now."""
        with self._lock:
            return [c.proc.pid for c in [*self._idle, *self._busy]]

    async def prepare(self, raw: bytes, name: str) -> PreparedRestore:
        """checked_snapshot(raw, name) in a child process; its refusals raised here."""
        out = await asyncio.wrap_future(self._threads.submit(self._run, raw, name))
        if out[0] == "busy":
            raise Busy(f"the process preparing restores died or could not start ({out[1]});"
                       " retry later")
        if out[0] == "input":
            raise out[1](out[2], out[3], out[4])
        if out[0] == "error":
            raise out[1](out[2])
        return out[1]

    def _run(self, raw: bytes, name: str) -> tuple:
        """On a thread of the pool: an idle child (or a new one) prepares it, then is idle
        again (the books kept here: a request given up by its client leaks no child)."""
        with self._lock:
            if self._closed:
                return ("busy", "the service is stopping")
            child = self._idle.pop() if self._idle else None
        try:
            child = child or _Child()
        except OSError as exc:   # out of processes or memory
            return ("busy", type(exc).__name__)
        with self._lock:
            self._busy.add(child)
        try:
            out = child.call(raw, name)
        except (OSError, EOFError, pickle.UnpicklingError, ValueError) as exc:
            # killed (out of memory): a new child for the next restore, not a 500
            with self._lock:
                self._busy.discard(child)
            child.stop(0)
            return ("busy", type(exc).__name__)
        with self._lock:
            self._busy.discard(child)
            keep = not self._closed
            if keep:
                self._idle.append(child)
        if not keep:
            child.stop(5)
        return out

    def close(self) -> None:
        """Stop the child processes: idle ones exit, one preparing a restore is killed (the
        service is stopping: nobody waits for its answer)."""
        with self._lock:
            self._closed = True
            idle, busy, self._idle = self._idle, list(self._busy), []
        for child in busy:
            child.proc.kill()
        for child in idle:
            child.stop(5)
        self._threads.shutdown(wait=True)
