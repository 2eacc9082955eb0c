"""Where window analyses run: a separate, spawned process by default, or the calling thread.

The what-if engine is numpy plus a lot of Python; run on a thread of the service, it holds the
interpreter lock that the HTTP server and the ingest thread need, and ingest slowed by a third
to a half whenever windows closed (benchmarks/monitor_ingest.py). In its own process it uses the
second core instead. The process is started with `spawn` (the service has threads, and forking
a process with threads is unsafe), warmed up when the first job appears, replaced if it dies
(the window it was on is tried once more in the new one, then kept as an error row), and it
exits by itself when the service is gone, kill -9 included.

A window's analysis has a time limit (`analysis_timeout_s`), counted from when the analysis
process starts that window (it says so through a queue as it unpickles the window): the
start of a new process and the read-ahead tasks queued before the window do not count. The
engine cannot be interrupted (numpy and Python with no point that checks a deadline), so past
the limit the process is killed and replaced, and the window is stored with an error row saying
so, with the time it held the analysis (never dropped, never left unanalysed without a word). On the calling thread (`analysis_process: false`) nothing can stop
the engine: it is waited for on a thread of its own up to the limit, then the window gets its
error row and the engine is left to end there, its result dropped (the next window waits for
it: one engine at a time).
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.queues
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from stragglers.monitor.part_files import READ_TIMEOUT_S
from stragglers.monitor.readahead import forget_parts, read_ahead_parts
from stragglers.monitor.records import Refusal, WindowRow
from stragglers.monitor.windows import Window, analyse_window, window_row

log = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0
ANALYSIS_TIMEOUT_S = 300.0   # settings.analysis_timeout_s (a 1,024-worker window takes ~0.7 s)


class WindowAnalyser:
    """Runs analyse_window for the monitor's analysis thread (one window at a time)."""

    def __init__(self, in_process: bool = False, read_timeout_s: float = READ_TIMEOUT_S,
                 timeout_s: float = ANALYSIS_TIMEOUT_S):
        self.in_process = in_process
        self.read_timeout_s = read_timeout_s   # each part file read ahead (the monitor's)
        self.timeout_s = timeout_s             # one window's analysis, at most
        self._pool: ProcessPoolExecutor | None = None
        self._pid: Future | None = None         # the analysis process's id (to stop it)
        self._starts: multiprocessing.queues.Queue | None = None  # the tokens of the windows it starts
        self._tokens = itertools.count()
        self._behind: threading.Thread | None = None   # an engine left past its limit
        self.stopped = 0    # windows whose analysis ran past timeout_s (given an error row)
        self._lock = threading.RLock()
        self._ahead: list = []         # parts to read ahead, waiting for the task in flight
        self._ahead_busy = False
        self._closed = False
        self.restarts = 0   # analysis processes that died and were replaced

    def warm(self) -> None:
        """Start the analysis process now (it imports the engine), not at the first window."""
        if not self.in_process:
            self._executor()

    def read_ahead(self, files: list) -> None:
        """Have these watched part files (PartFiles) decoded ahead where windows are analysed;
        never waits (a dead process or a closed pool just means windows read them later)."""
        if not files:
            return
        if self.in_process:
            read_ahead_parts(files, self.read_timeout_s)
            return
        # one read-ahead task in flight at a time, carrying every part that came meanwhile: a
        # task per ingest batch (many jobs, small batches) queued the windows behind them
        with self._lock:
            self._ahead.extend(files)
            if self._ahead_busy:
                return
            self._ahead_busy = True
        self._send_ahead()

    def forget(self, directory: str) -> None:
        """Drop what is read ahead (or about to be) from `directory`: a new run of a job writes
        the same file names, whose old rows must not stand in for the new ones."""
        if not directory:
            return
        prefix = directory.rstrip("/") + "/"
        with self._lock:
            self._ahead = [f for f in self._ahead if not str(f.path).startswith(prefix)]
        if self.in_process:
            forget_parts(directory)
            return
        try:
            self._executor().submit(forget_parts, directory)
        except (BrokenProcessPool, RuntimeError):
            pass   # no process: nothing held there

    def _send_ahead(self, _done=None) -> None:
        with self._lock:
            files, self._ahead = self._ahead, []
            if not files or self._closed:   # (a task finishing while close() shuts the pool
                self._ahead_busy = False    # down must not start a new process)
                return
        try:
            self._executor().submit(read_ahead_parts, files, self.read_timeout_s
                                   ).add_done_callback(self._send_ahead)
        except (BrokenProcessPool, RuntimeError):
            with self._lock:
                self._ahead_busy = False

    def analyse(self, window: Window) -> tuple[WindowRow, list[Refusal]]:
        """The window's stored row and the part files refused on reading it; an error row if
        the analysis process died on it."""
        if self.in_process:
            return self._on_thread(window)
        handed = time.monotonic()
        for _ in range(2):
            pool = self._executor()
            with self._lock:
                starts = self._starts if self._pool is pool else None
            token = next(self._tokens)
            started = time.monotonic()
            try:
                future = pool.submit(_analyse_started, _Start(token), window)
                started = _started(future, starts, token)
                # (the limit counts from the start of this window in the process: neither
                # a process starting nor read-ahead tasks queued before it count)
                left = max(0.0, started + self.timeout_s - time.monotonic())
                return future.result(timeout=left)
            except FutureTimeout:
                self._stop(pool)
                return self._too_long(window, "the analysis process was stopped and the "
                                      "next window is analysed in a new one",
                                      time.monotonic() - started), []
            except BrokenProcessPool:
                # the process died (out of memory, a signal), on this window or just before
                # it: a fresh one tries once more; a window that kills that one too keeps an
                # error row rather than killing every process after it
                self._replace(pool)
        log.error("job %s window %d: the analysis process died on it twice; a new one takes "
                  "the next window", window.job, window.idx)
        return window_row(window, "analysis failed: the analysis process died (out of "
                          "memory or killed) while analysing this window, twice",
                          time.monotonic() - handed), []

    def _on_thread(self, window: Window) -> tuple[WindowRow, list[Refusal]]:
        """analyse_window here, waited for at most timeout_s on a thread of its own."""
        if self._behind is not None:   # one engine at a time: the one left past its limit
            self._behind.join()        # ends first (nothing can stop it)
            self._behind = None
        out: list = []

        def run() -> None:
            try:
                out.append(analyse_window(window))
            except BaseException as exc:   # noqa: BLE001 - raised on the calling thread
                out.append(exc)

        engine = threading.Thread(target=run, name="stragglers-analysis-engine", daemon=True)
        started = time.monotonic()
        engine.start()
        engine.join(self.timeout_s)
        if engine.is_alive():
            self._behind = engine
            return self._too_long(window, "its engine runs on, on a thread that cannot be "
                                  "stopped, its result dropped (analysis_process stops it)",
                                  time.monotonic() - started), []
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    def _too_long(self, window: Window, then: str, spent: float) -> WindowRow:
        """The error row of a window whose analysis ran past timeout_s (`spent` seconds)."""
        self.stopped += 1
        log.error("job %s window %d: analysis stopped after analysis_timeout_s (%g s); %s",
                  window.job, window.idx, self.timeout_s, then)
        return window_row(window, f"analysis stopped: it ran past analysis_timeout_s "
                          f"({self.timeout_s:g} s) on this window's {len(window.steps)} steps; "
                          f"{then}", analysis_s=spent)

    def _stop(self, pool: ProcessPoolExecutor) -> None:
        """Kill the analysis process of `pool` (busy past the limit) and replace it."""
        with self._lock:
            pid = self._pid if self._pool is pool else None
        # the pool's own processes (started or still starting), and the id it reported
        pids = set(getattr(pool, "_processes", None) or {})
        if pid is not None and pid.done() and pid.exception() is None:
            pids.add(pid.result())
        for p in pids:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:   # gone already: replaced all the same
                pass
        self._replace(pool)

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            starts = None
            if self._pool is broken:
                self._pool, starts, self._starts = None, self._starts, None
                self.restarts += 1
        broken.shutdown(wait=False, cancel_futures=True)
        if starts is not None:
            starts.close()

    def close(self) -> None:
        """Stop the analysis process (waits for a window in progress)."""
        with self._lock:
            pool, self._pool = self._pool, None
            starts, self._starts = self._starts, None
            self._closed = True
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        if starts is not None:
            starts.close()

    def pids(self) -> list[int]:
        """The analysis process's id, [] when none runs (for tests)."""
        with self._lock:
            pool = self._pool
        return [pool.submit(os.getpid).result()] if pool is not None else []

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._closed:
                raise RuntimeError("the window analyser is closed")
            if self._pool is None:
                spawn = multiprocessing.get_context("spawn")
                self._starts = spawn.Queue()
                self._pool = ProcessPoolExecutor(
                    1, mp_context=spawn,
                    initializer=_start_in_child, initargs=(os.getpid(), self._starts))
                self._pid = self._pool.submit(os.getpid)   # starts the process
                self._pool.submit(_import_engine)           # and warms it
            return self._pool


_STARTS: multiprocessing.queues.Queue | None = None   # in the analysis process: where it says a window started


def _started(future: Future, starts: multiprocessing.queues.Queue | None, token: int) -> float:
    """When (monotonic) the analysis process started the window of `token`: waits while it
    starts, imports, or reads ahead before it; now if the task ended (or the pool broke)
    first."""
    while starts is not None and not future.done():
        try:
            # (a token before ours is a window that ended before its token was read)
            if starts.get(timeout=0.1) == token:
                return time.monotonic()
        except queue.Empty:
            continue
        except (OSError, ValueError, EOFError):   # closed: the pool was replaced
            break
    return time.monotonic()


class _Start:
    """Unpickled in the analysis process just before the window that follows it in the task's
    arguments (a window that hangs there is stopped too): says there that the window started."""

    def __init__(self, token: int):
        self.token = token

    def __reduce__(self):
        return _say_started, (self.token,)


def _say_started(token: int) -> int:
    if _STARTS is not None:
        _STARTS.put(token)
    return token


def _analyse_started(_start: "_Start | int", window: Window) -> tuple[WindowRow, list[Refusal]]:
    """In the analysis process: analyse the window (its start was said as it was unpickled)."""
    return analyse_window(window)


def _start_in_child(parent: int, starts: multiprocessing.queues.Queue | None = None) -> None:
    """In the analysis process: keep the queue where windows say they started; exit when the
    service process is gone (the pipes of a killed parent are held open by this process too,
    so it would otherwise wait forever)."""
    global _STARTS
    _STARTS = starts
    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_S)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="stragglers-analysis-parent", daemon=True).start()


def _import_engine() -> None:
    from stragglers.whatif import analyze  # noqa: F401  (the first window then starts at once)
