"""Where window analyses run: a separate, spawned process by default, or the calling thread.

The what-if engine is numpy plus a lot of Python; run on a thread of the service, it holds the
interpreter lock that the HTTP server and the ingest thread need, and ingest slowed by a third
to a half whenever windows closed (benchmarks/monitor_ingest.py). In its own process it uses the
second core instead. The process is started with `spawn` (the service has threads, and forking
a process with threads is unsafe), warmed up when the first job appears, replaced if it dies
(the window it was on is tried once more in the new one, then kept as an error row), and it
exits by itself when the service is gone, kill -9 included.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from stragglers.monitor.part_files import READ_TIMEOUT_S
from stragglers.monitor.readahead import forget_parts, read_ahead_parts
from stragglers.monitor.records import Refusal, WindowRow
from stragglers.monitor.windows import Window, analyse_window, window_row

log = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0


class WindowAnalyser:
    """Runs analyse_window for the monitor's analysis thread (one window at a time)."""

    def __init__(self, in_process: bool = False, read_timeout_s: float = READ_TIMEOUT_S):
        self.in_process = in_process
        self.read_timeout_s = read_timeout_s   # each part file read ahead (the monitor's)
        self._pool: ProcessPoolExecutor | None = None
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
            return analyse_window(window)
        for _ in range(2):
            pool = self._executor()
            try:
                return pool.submit(analyse_window, window).result()
            except BrokenProcessPool:
                # the process died (out of memory, a signal), on this window or just before
                # it: a fresh one tries once more; a window that kills that one too keeps an
                # error row rather than killing every process after it
                self._replace(pool)
        log.error("job %s window %d: the analysis process died on it twice; a new one takes "
                  "the next window", window.job, window.idx)
        return window_row(window, "analysis failed: the analysis process died (out of "
                             "memory or killed) while analysing this window, twice"), []

    def _replace(self, broken: ProcessPoolExecutor) -> None:
        with self._lock:
            if self._pool is broken:
                self._pool = None
                self.restarts += 1
        broken.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        """Stop the analysis process (waits for a window in progress)."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._closed = True
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)

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
                self._pool = ProcessPoolExecutor(
                    1, mp_context=multiprocessing.get_context("spawn"),
                    initializer=_start_in_child, initargs=(os.getpid(),))
                self._pool.submit(_import_engine)  # starts the process and warms it
            return self._pool


def _start_in_child(parent: int) -> None:
    """In the analysis process: exit when the service process is gone (the pipes of a killed
    parent are held open by this process too, so it would otherwise wait forever)."""
    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_S)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="stragglers-analysis-parent", daemon=True).start()


def _import_engine() -> None:
    from stragglers.whatif import analyze  # noqa: F401  (the first window then starts at once)
