"""Where window analyses run: a separate, spawned process by default, or the calling thread.

The what-if engine is numpy plus a lot of Python; run on a thread of the service, it holds the
interpreter lock that the HTTP server and the ingest thread need, and ingest slowed by a third
to a half whenever windows closed (benchmarks/monitor_ingest.py). In its own process it uses the
second core instead. The process is started with `spawn` (the service has threads, and forking
a process with threads is unsafe), warmed up when the first job appears, replaced if it dies
(the window it was on is tried once more in the new one, then kept as an error row), and it
exits by itself when the service is gone, kill -9 included. A process that cannot be started
at all (out of file handles, memory or processes) gives the window an error row too, and the
next window tries again.

A window's analysis has a time limit (`analysis_timeout_s`), counted from when the analysis
process starts that window (it says so on its pipe of answers before it unpickles the window): the
start of a new process and the read-ahead tasks queued before the window do not count. The
engine cannot be interrupted (numpy and Python with no point that checks a deadline), so past
the limit the process is killed and replaced, and the window is stored with an error row saying
so, with the time it held the analysis (never dropped, never left unanalysed without a word). On the calling thread (`analysis_process: false`) nothing can stop
the engine: it is waited for on a thread of its own up to the limit, then the window gets its
error row and the engine is left to end there, its result dropped (the next window waits for
it: one engine at a time).

The wait for the process to start a window is bounded too (`analysis_start_timeout_s`): a
process that hangs while it starts (an import that never returns: a hung file system under
site-packages) or on a task queued before the window is killed and replaced, and the window
is stored with an error row saying so, as one past its limit. The service owns the process
(a multiprocessing Process and its handle): it kills it by that handle, whether or not it
started.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

from stragglers.monitor.part_files import READ_TIMEOUT_S
from stragglers.monitor.readahead import forget_parts, read_ahead_parts
from stragglers.monitor.records import Refusal, WindowRow
from stragglers.monitor.windows import Window, analyse_window, window_row

log = logging.getLogger(__name__)

PARENT_CHECK_S = 1.0
ANALYSIS_TIMEOUT_S = 300.0   # settings.analysis_timeout_s (a 1,024-worker window takes ~0.7 s)
# settings.analysis_start_timeout_s: a process starts and imports the engine in ~0.4-1.4 s
# here (round 15), a read-ahead task queued before a window only submits reads
START_TIMEOUT_S = 120.0
# close() waits this long for the process to end, then kills it: it holds nothing durable
# (a window not stored is analysed again after a restart), and a hung one held the stop
CLOSE_WAIT_S = 1.0
# settings.analysis_answer_max_bytes: a window's pickled answer, at most (a 4-worker window's is
# ~1 KB, a 256-worker one's ~9 KB)
ANSWER_MAX_BYTES = 64 << 20
_ANSWER_HEAD = 4096   # (the answer's envelope: its kind and token around the pickled value)


class ProcessDied(Exception):
    """The analysis process died (or was stopped) before it answered a task."""


class Closed(RuntimeError):
    """The analyser is closed (the monitor stops): the window is not analysed now, and not
    stored, so the next start analyses it."""


class AnswerTooLarge(RuntimeError):
    """A task's answer is larger than the analysis process may send (answer_max_bytes)."""


def too_large(size: int | None, cap: int) -> AnswerTooLarge:
    """The refusal of an answer of `size` bytes (None: not known, refused by its length)."""
    got = f"{size:,} bytes" if size is not None else "longer than that"
    return AnswerTooLarge(f"the window's answer is {got}, over analysis_answer_max_bytes "
                          f"({cap:,} bytes)")


class NotStarted(ProcessDied):
    """The analysis process could not be started (spawn failed: out of file handles, of
    memory, of processes)."""


class AnalysisProcess:
    """The spawned analysis process (its multiprocessing Process: `process`), the pipe of its
    tasks, written by a thread here, and the pipe of its answers, read by another that settles
    each task's Future (ProcessDied for every task unanswered when the process ends)."""

    def __init__(self, parent: int, answer_max_bytes: int = ANSWER_MAX_BYTES):
        self.answer_max_bytes = answer_max_bytes
        ctx = multiprocessing.get_context("spawn")
        # tasks go through a queue here to a writer thread: a task handed to a process that
        # hangs while it starts waits there, not in the thread that handed it; the process
        # holds the pipe's only reader, so once it is gone a write fails (EPIPE) rather than
        # waiting for good on a full pipe (a multiprocessing.Queue keeps a reader here too)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        task_end, self._tasks = ctx.Pipe(duplex=False)
        answers, self._answer_end = ctx.Pipe(duplex=False)
        self._answers = answers
        self._lock = threading.Lock()
        self._tokens = itertools.count()
        self._pending: dict[int, tuple[Future, threading.Event]] = {}
        self.dead = False
        self.process = ctx.Process(target=_serve, args=(os.getpid(), task_end,
                                                        self._answer_end, answer_max_bytes),
                                   name="stragglers-analysis", daemon=True)
        try:
            self.process.start()
        except BaseException:
            # (out of file handles, memory or processes: its pipes must not be left open, or
            # every later try leaks four more file handles into a service already short)
            for end in (task_end, self._tasks, answers, self._answer_end):
                end.close()
            raise
        task_end.close()           # (the process holds the only ends of its pipes: its death
        self._answer_end.close()   # is an EOF to the reader, a broken pipe to the writer)
        try:
            threading.Thread(target=self._read, name="stragglers-analysis-answers",
                             daemon=True).start()
            threading.Thread(target=self._write, name="stragglers-analysis-tasks",
                             daemon=True).start()
        except BaseException:   # (no thread to be had: a process no one talks to is killed)
            self.kill()
            self.process.join(CLOSE_WAIT_S)
            raise

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run fn(*args) there, after the tasks before it; its Future. ProcessDied when the
        process has ended."""
        token = next(self._tokens)
        # (pickled here: a value that does not pickle raises in the caller, not in a thread)
        data = pickle.dumps((token, fn, pickle.dumps(args, pickle.HIGHEST_PROTOCOL)),
                            pickle.HIGHEST_PROTOCOL)
        future: Future = Future()
        with self._lock:
            if self.dead:
                raise ProcessDied("the analysis process has ended")
            self._pending[token] = (future, threading.Event())
        future.token = token  # type: ignore[attr-defined]
        self._outbox.put(data)
        return future

    def wait_started(self, future: Future, timeout: float) -> bool:
        """Whether the process started the task of `future` (or it ended) within `timeout`."""
        with self._lock:
            entry = self._pending.get(future.token)  # type: ignore[attr-defined]
        return entry is None or entry[1].wait(timeout)

    def kill(self) -> None:
        """SIGKILL the process (started, still starting, or busy); its tasks fail."""
        try:
            self.process.kill()
        except (OSError, ValueError):   # gone already, or closed
            pass

    def shutdown(self, wait_s: float) -> None:
        """End the process once the tasks handed to it are done (killed past `wait_s`)."""
        self._outbox.put(None)
        self.process.join(wait_s)
        if self.process.exitcode is None:
            self.kill()
            self.process.join(wait_s)

    def _write(self) -> None:
        """The tasks, in order, to the process; ends with it (or at None: the process ends
        when its pipe does)."""
        try:
            while (data := self._outbox.get()) is not None:
                self._tasks.send_bytes(data)
        except OSError:   # the process is gone (EPIPE): its tasks fail with it (_read)
            pass
        finally:
            self._tasks.close()

    def _read(self) -> None:
        """The answers, as they come; every task unanswered fails once the process ended."""
        sentinel = self.process.sentinel
        try:
            while True:
                ready = multiprocessing.connection.wait([self._answers, sentinel])
                if self._answers not in ready and not self._answers.poll():
                    break   # ended, every answer read
                try:
                    # (bounded: the length comes first, a longer message is not read)
                    data = self._answers.recv_bytes(self.answer_max_bytes + _ANSWER_HEAD)
                except EOFError:
                    break
                except OSError:
                    if self._answers.closed:   # too long (multiprocessing closed it): the
                        self._overflow()       # task on the process fails so, not retried
                    break
                kind, token, blob = pickle.loads(data)
                self._settle(kind, token, blob)
        finally:
            self._end()
            self._answers.close()

    def _settle(self, kind: str, token: int, blob: bytes) -> None:
        with self._lock:
            entry = self._pending.get(token)
            if entry is not None and kind != "started":
                del self._pending[token]
        if entry is None:
            return
        future, started = entry
        if kind == "started":
            future.began = True  # type: ignore[attr-defined]  # (a death now is on its task)
            started.set()
            return
        started.set()
        try:
            value = pickle.loads(blob)
        except Exception as exc:   # noqa: BLE001 - an answer that does not unpickle here
            future.set_exception(exc)
            return
        if kind == "done":
            future.set_result(value)
        else:
            future.set_exception(value)

    def _overflow(self) -> None:
        """The task the process is on sent an answer past the cap: it fails with
        AnswerTooLarge (not ProcessDied, which a window retries in a new process, where it
        fails the same way) and the process, whose pipe cannot be read any more, is killed."""
        self.kill()
        with self._lock:
            self.dead = True   # (before the task fails: its window replaces the process)
            began = [(token, entry) for token, entry in self._pending.items()
                     if entry[1].is_set()]
            for token, _ in began:
                del self._pending[token]
        for _, (future, _started) in began:
            future.set_exception(too_large(None, self.answer_max_bytes))

    def _end(self) -> None:
        with self._lock:
            self.dead = True
            pending, self._pending = self._pending, {}
        self._outbox.put(None)   # (the writer ends too)
        for future, started in pending.values():
            started.set()
            future.set_exception(ProcessDied("the analysis process ended (out of memory, "
                                             "killed, or stopped)"))


class WindowAnalyser:
    """Runs analyse_window for the monitor's analysis thread (one window at a time)."""

    def __init__(self, in_process: bool = False, read_timeout_s: float = READ_TIMEOUT_S,
                 timeout_s: float = ANALYSIS_TIMEOUT_S,
                 start_timeout_s: float = START_TIMEOUT_S,
                 answer_max_bytes: int = ANSWER_MAX_BYTES):
        self.in_process = in_process
        self.answer_max_bytes = answer_max_bytes   # a window's answer from the process
        self.read_timeout_s = read_timeout_s   # each part file read ahead (the monitor's)
        self.timeout_s = timeout_s             # one window's analysis, at most
        self.start_timeout_s = start_timeout_s   # the wait for the process to start a window
        self._process: AnalysisProcess | None = None
        self._behind: threading.Thread | None = None   # an engine left past its limit
        self.stopped = 0    # windows given an error row past timeout_s or start_timeout_s
        self._lock = threading.RLock()
        self._ahead: list = []         # parts to read ahead, waiting for the task in flight
        self._ahead_busy = False
        self._closed = False
        self.restarts = 0   # analysis processes that died (or were stopped) and were replaced
        # the last start failed: read-ahead and warm-up do not try again (every ingest batch
        # would, in a service out of file handles); the next window does
        self._spawn_failed = False

    def warm(self) -> None:
        """Start the analysis process now (it imports the engine), not at the first window;
        never raises (a process that cannot be started is tried again at the next window)."""
        if not self.in_process:
            try:
                self._executor(spawn=not self._spawn_failed)
            except (ProcessDied, RuntimeError):
                pass

    def read_ahead(self, files: list) -> None:
        """Have these watched part files (PartFiles) decoded ahead where windows are analysed;
        never waits (a dead process or a closed analyser just means windows read them later)."""
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
            self._executor(spawn=False).submit(forget_parts, directory)
        except (ProcessDied, RuntimeError):
            pass   # no process: nothing held there

    def _send_ahead(self, _done=None) -> None:
        with self._lock:
            files, self._ahead = self._ahead, []
            if not files or self._closed:   # (a task finishing while close() stops the
                self._ahead_busy = False    # process must not start a new one)
                return
        try:
            self._executor(spawn=not self._spawn_failed).submit(
                read_ahead_parts, files, self.read_timeout_s).add_done_callback(
                    self._send_ahead)
        except (ProcessDied, RuntimeError):
            with self._lock:
                self._ahead_busy = False

    def analyse(self, window: Window) -> tuple[WindowRow, list[Refusal]]:
        """The window's stored row and the part files refused on reading it; an error row if
        the analysis process died on it, did not start it in time, or ran past the limit.
        Closed if the analyser was closed meanwhile (its process killed by the stop)."""
        if self.in_process:
            return self._on_thread(window)
        handed = time.monotonic()
        deaths = 0   # processes that died while on this window (after it began there)
        # (a process that died before it began the window, killed while idle, costs the
        # window no try: it spent the window's retry, and a window that then met one death
        # of its own was stored as 'died twice'; such tries are bounded too: 4 in all)
        for _ in range(4):
            future: Future | None = None
            try:
                process = self._executor()
            except NotStarted as exc:
                # (out of file handles, memory or processes: the window was dropped, raised
                # out of the analysis step; now kept as an error row like one past its limit,
                # and the next window tries a new process)
                return window_row(window, f"analysis failed: {exc}; the next window tries "
                                  "a new process", time.monotonic() - handed), []
            started = time.monotonic()
            try:
                future = process.submit(analyse_window, window)
                # the start is bounded on its own (a process hung while it starts, or on a
                # task before the window, held the analysis thread, and every window, for
                # good); the limit counts from the start of this window in the process:
                # neither a process starting nor read-ahead tasks queued before it count
                if not process.wait_started(future, self.start_timeout_s):
                    self._stop(process)
                    return self._too_long(
                        window, f"analysis stopped: the analysis process did not start "
                        f"this window within analysis_start_timeout_s "
                        f"({self.start_timeout_s:g} s; hung while starting, or on a task "
                        f"before it)", "the process was stopped and the next window is "
                        "analysed in a new one", time.monotonic() - started), []
                started = time.monotonic()
                left = max(0.0, started + self.timeout_s - time.monotonic())
                return future.result(timeout=left)
            except FutureTimeout:
                self._stop(process)
                return self._too_long(window, None, "the analysis process was stopped and "
                                      "the next window is analysed in a new one",
                                      time.monotonic() - started), []
            except ProcessDied:
                # the process died (out of memory, a signal), on this window or just before
                # it: a fresh one tries once more; a window that kills that one too keeps an
                # error row rather than killing every process after it
                self._replace(process)
                if future is not None and getattr(future, "began", False):
                    deaths += 1
                    if deaths == 2:
                        break
            except Exception as exc:   # noqa: BLE001 - kept as the window's error row
                if process.dead:   # (killed for an answer past the cap: replaced now)
                    self._replace(process)
                # a window that cannot be handed over or whose answer does not come back
                # (it does not pickle): raised out of the analysis step, it was never stored,
                # and once a later window was, never analysed again
                log.error("job %s window %d: analysis failed in the analysis process (%s: "
                          "%s)", window.job, window.idx, type(exc).__name__, str(exc)[:200])
                return window_row(window, f"analysis failed: {type(exc).__name__}: "
                                  f"{str(exc)[:300]}", time.monotonic() - handed), []
        how = "while analysing this window, twice" if deaths == 2 else \
            "4 times in a row, before or while analysing this window"
        log.error("job %s window %d: the analysis process died %s; a new one takes the next "
                  "window", window.job, window.idx, how)
        return window_row(window, "analysis failed: the analysis process died (out of "
                          f"memory or killed) {how}", time.monotonic() - handed), []

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
            return self._too_long(window, None, "its engine runs on, on a thread that cannot "
                                  "be stopped, its result dropped (analysis_process stops it)",
                                  time.monotonic() - started), []
        if isinstance(out[0], BaseException):
            raise out[0]
        return out[0]

    def _too_long(self, window: Window, why: str | None, then: str,
                  spent: float) -> WindowRow:
        """The error row of a window whose analysis ran past timeout_s (or, `why`, was not
        started within start_timeout_s) after `spent` seconds."""
        self.stopped += 1
        why = why or (f"analysis stopped: it ran past analysis_timeout_s ({self.timeout_s:g} "
                      f"s) on this window's {len(window.steps)} steps")
        log.error("job %s window %d: %s; %s", window.job, window.idx, why, then)
        return window_row(window, f"{why}; {then}", analysis_s=spent)

    def _stop(self, process: AnalysisProcess) -> None:
        """Kill the analysis process (busy past the limit, or still starting) and replace it."""
        process.kill()   # (its own handle: started or not, reported its id or not)
        self._replace(process)

    def _replace(self, broken: AnalysisProcess) -> None:
        with self._lock:
            if self._process is broken:
                self._process = None
                self.restarts += 1
        broken.kill()   # (a process whose pipes broke but that lives on is not left behind)
        broken.process.join(CLOSE_WAIT_S)

    def close(self) -> None:
        """Stop the analysis process (killed after CLOSE_WAIT_S: a window in progress is
        analysed again after a restart)."""
        with self._lock:
            process, self._process = self._process, None
            self._closed = True
        if process is not None:
            process.shutdown(CLOSE_WAIT_S)

    def pids(self) -> list[int]:
        """The analysis process's id once it started and imported the engine, [] when none
        runs (for tests)."""
        with self._lock:
            process = self._process
        return [process.submit(os.getpid).result()] if process is not None else []

    def _executor(self, spawn: bool = True) -> AnalysisProcess:
        """The analysis process, started if none runs (NotStarted if that fails; with
        `spawn` false, ProcessDied rather than a start)."""
        with self._lock:
            if self._closed:
                raise Closed("the window analyser is closed")
            if self._process is None:
                if not spawn:
                    raise ProcessDied("no analysis process runs")
                try:
                    process = AnalysisProcess(os.getpid(), self.answer_max_bytes)
                except Exception as exc:   # noqa: BLE001 - OSError, MemoryError, RuntimeError
                    self._spawn_failed = True
                    log.error("the analysis process could not be started (%s: %s); the next "
                              "window tries again", type(exc).__name__, str(exc)[:200])
                    raise NotStarted(f"the analysis process could not be started "
                                     f"({type(exc).__name__}: {str(exc)[:200]})") from exc
                self._spawn_failed = False
                self._process = process
                try:
                    process.submit(_import_engine)   # warms it
                except ProcessDied:
                    pass   # (died at once: the window handed next finds it dead, replaces it)
            return self._process


_ANSWERS: Any = None   # in the analysis process: the pipe of its answers


def _serve(parent: int, tasks: Any, answers: Any,
           answer_max_bytes: int = ANSWER_MAX_BYTES) -> None:
    """The analysis process: each task in turn, its start said, then its result (or
    exception); exits when its pipe of tasks closes, or when the service process is gone (the pipes of a killed
    parent are held open by this process too, so it would otherwise wait forever)."""
    def watch() -> None:
        while True:
            time.sleep(PARENT_CHECK_S)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="stragglers-analysis-parent", daemon=True).start()
    try:
        _serve_tasks(tasks, answers, answer_max_bytes)
    except OSError:   # the service is gone (killed: its end of a pipe closed): no traceback
        os._exit(0)   # in its log, nothing left to answer


def _serve_tasks(tasks: Any, answers: Any, answer_max_bytes: int) -> None:
    """Each task in turn (see _serve), until the pipe of tasks closes."""
    while True:
        try:
            data = tasks.recv_bytes()
        except EOFError:   # the service closed the pipe: done
            return
        token, fn, args = pickle.loads(data)
        answers.send_bytes(pickle.dumps(("started", token, b"")))
        try:
            # (the arguments unpickled after the start is said: a window that hangs there
            # is stopped by the analysis limit)
            kind, value = "done", fn(*pickle.loads(args))
        except BaseException as exc:   # noqa: BLE001 - the caller's to raise
            kind, value = "failed", exc
        try:
            blob = pickle.dumps(value, pickle.HIGHEST_PROTOCOL)
        except Exception as exc:   # noqa: BLE001 - an answer that does not pickle
            kind, blob = "failed", pickle.dumps(RuntimeError(
                f"the analysis process's answer does not pickle: {exc!r}"[:500]))
        if len(blob) > answer_max_bytes:   # (the service would refuse it unread: said here)
            kind, blob = "failed", pickle.dumps(too_large(len(blob), answer_max_bytes))
        answers.send_bytes(pickle.dumps((kind, token, blob), pickle.HIGHEST_PROTOCOL))


def _import_engine() -> None:
    from stragglers.whatif import analyze  # noqa: F401  (the first window then starts at once)
