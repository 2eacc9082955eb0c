"""Part files on disk: opened only when regular and bounded, read in place, written atomically."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import stat
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Executor, Future, wait
from pathlib import Path

from stragglers.errors import InputError
from stragglers.trace.runformat import rank_file_name

log = logging.getLogger(__name__)

MAX_PART_FILE_BYTES = 1 << 30   # a watched part file (an upload is bounded by max_part_bytes)

# a part file up to this size is read in one read and checked and decoded from those bytes (a
# recorder's parts are kB to a few MB); a larger one is read where touched (FileBytes)
WHOLE_READ_BYTES = 16 << 20

# a watched file's read (open, footer, bytes) that has not returned after this long is given
# up on for now: a hard-mounted NFS file whose server went away, a hung FUSE file (sshfs,
# s3fs, gcsfuse) block a read for good, and O_NONBLOCK does nothing for a regular file
READ_TIMEOUT_S = 5.0
# threads left behind in reads that did not return, at most, at once (a thread blocked in
# the kernel cannot be stopped); past it watched files are left for later unread
MAX_STUCK_READS = 8


OUTSIDE = "a link to a file outside the watched folder (not followed)"
HARD_LINKED = ("a file with {n} names (a hard link: it may be a file of another folder, which "
               "its name here cannot tell); not read: expected a part or meta.json written "
               "in place (one name), as the recorder writes it")


def check_opened_within(fd: int, st: os.stat_result, path: Path, within: str) -> None:
    """InputError naming `path` unless the file open at `fd` (fstat `st`) lies in the folder
    `within` once links are followed (opened_within) and has one name: a hard link in a watched
    folder to a file elsewhere (a private file, another job's part) is a regular file whose
    opened path lies in the folder, so only its link count tells it from one written there
    (the recorder and the uploads write a temporary and rename it: one name)."""
    if not opened_within(fd, st, path, within):
        raise InputError(path, None, OUTSIDE)
    if st.st_nlink > 1:
        raise InputError(path, None, HARD_LINKED.format(n=st.st_nlink))


def open_part_file(path: Path, limit: int = MAX_PART_FILE_BYTES, within: str = ""):
    """(binary file, size) of a part file, opened without blocking and only if it is a
    regular file of at most `limit` bytes (a FIFO named like a part would block the ingest
    thread for good) and, with `within`, one that lies in that folder once links are followed
    and has no other name (check_opened_within); InputError naming the file otherwise
    (FileNotFoundError passes)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(path, None, "not a regular file (a FIFO, device or directory "
                             "named like a part); expected a Parquet file")
        if within:
            check_opened_within(fd, st, path, within)
        if st.st_size > limit:
            raise InputError(path, None, f"{st.st_size} bytes; expected at most {limit}")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb"), st.st_size



def opened_within(fd: int, st: os.stat_result, path: Path, within: str) -> bool:
    """Whether the file open at `fd` (fstat `st`, opened by the name `path`) lies in the folder
    `within` once links are followed. What was opened is judged, not the name: the name was
    checked and then swapped for a link out of the folder before the open, and the open
    followed it. The opened file's own path (/proc/self/fd) must lie in the folder; where
    there is no /proc, the name's real path must, and lead to the very file opened (same
    device and inode)."""
    root = os.path.realpath(within)
    try:
        real = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        real = os.path.realpath(path)
        try:
            there = os.stat(real)
        except OSError:
            return False
        if (there.st_dev, there.st_ino) != (st.st_dev, st.st_ino):
            return False
    return real == root or real.startswith(root.rstrip("/") + "/")



def read_whole(f, size: int) -> bytes:
    """The first `size` bytes of an open part file (OSError when it shrank meanwhile)."""
    parts, got = [], 0
    while got < size:
        block = os.pread(f.fileno(), size - got, got)
        if not block:
            raise OSError(f"the file shrank while read ({got} bytes where {size} were)")
        parts.append(block)
        got += len(block)
    return parts[0] if len(parts) == 1 else b"".join(parts)



def checked_digest(data) -> bytes:
    """What a part's checked bytes are known by (BLAKE2b, 128 bits): a file whose bytes give the
    same digest holds the bytes that were checked (a forged match is out of reach), one that
    changed in any byte since, after a rename or a rewrite in place alike, gives another."""
    return hashlib.blake2b(data, digest_size=16).digest()



def file_bytes(f, size: int):
    """The bytes of an open file as `size` long, read where touched (only the page headers
    are): a read past what the file now holds raises OSError. Not an mmap: a file truncated
    by its writer while mapped killed the whole monitor with SIGBUS on the next page read."""
    return contextlib.nullcontext(FileBytes(f.fileno(), size))


class FileBytes:
    """Indexable bytes of an open file (ints and slices), read with pread in blocks."""

    BLOCK = 1 << 16

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self._base, self._block = 0, b""

    def __len__(self) -> int:
        return self.size

    def _read(self, start: int, n: int) -> bytes:
        got = os.pread(self.fd, n, start)
        if len(got) < n:
            raise OSError(f"the file shrank while read ({start + len(got)} bytes where "
                          f"{self.size} were)")
        return got

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, step = key.indices(self.size)
            if step != 1:
                raise ValueError("expected a contiguous slice")
            return self._read(start, max(0, stop - start))
        i = key + self.size if key < 0 else key
        if not 0 <= i < self.size:
            raise IndexError("index past the file's end")
        off = i - self._base
        if not 0 <= off < len(self._block):
            self._base = i
            self._block = self._read(i, min(self.BLOCK, self.size - i))
            off = 0
        return self._block[off]



def write_part_file(directory: Path, rank: int, part: int, data: bytes,
                    sync_dir: bool = True) -> Path:
    """Put uploaded bytes in the run format, atomically and durably (fsync, then rename; with
    sync_dir=False the caller fsyncs the directory, once for many files)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / rank_file_name(rank, part)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{id(data):x}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)   # a full disk leaves no half-written file behind
        raise
    if sync_dir:
        sync_directory(directory)
    return path



def sync_directory(directory: Path) -> None:
    """fsync a directory: the renames in it survive a power cut before a part is acknowledged."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)



class StuckRead(InputError):
    """A watched file whose read did not return in time (or was not begun: every reader
    stuck): the ingest leaves it for a later scan, not refused (its run goes on; it is read
    again once the read left behind returned); a window goes without its rows."""



class FileReaders(Executor):
    """Threads that read watched files, each read waited for at most `timeout_s` from when
    it began (map): one that does not return is left behind on its thread (blocked in the
    kernel, it cannot be stopped), the file answered StuckRead and not read again while that
    read is stuck, and a thread started in its place, up to `max_stuck` left behind at once.
    Daemon threads of their own: neither a stop nor the interpreter's exit waits for one (a
    ThreadPoolExecutor's threads are joined at exit, so SIGTERM waited on a stuck read)."""

    def __init__(self, threads: int = 2, timeout_s: float = READ_TIMEOUT_S,
                 max_stuck: int = MAX_STUCK_READS, name: str = "stragglers-file-read"):
        self.threads, self.timeout_s, self.max_stuck, self.name = \
            threads, timeout_s, max_stuck, name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers = 0   # threads taking reads (not left behind)
        self._running: dict[Future, tuple[str, float, int]] = {}   # → (file, began, thread)
        self._left: dict[int, str] = {}   # thread left behind → the file it reads
        self.stuck: dict[str, float] = {}   # file → when its read that is stuck began
        self.given_up = 0   # reads left behind, in all
        self._closed = False
        # done at shutdown: a map waiting on its reads stops waiting (a stop waited up to a
        # read's deadline, 30 s for a run's scan, on one that hung)
        self._shut: Future = Future()

    def stuck_reads(self) -> dict[str, float]:
        """file → seconds its read has been stuck, for the reads left behind now."""
        now = time.monotonic()
        with self._lock:
            return {f: now - began for f, began in self.stuck.items()}

    def submit(self, fn, /, *args, **kwargs) -> Future:
        """fn(*args) on a reader thread (not bounded: map bounds its reads)."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the file readers are shut down")
            if self._workers < self.threads and len(self._left) < self.max_stuck:
                self._start()
        self._tasks.put((fut, lambda: fn(*args, **kwargs), _file_of(args[0]) if args else ""))
        return fut

    def timed(self, timeout_s: float) -> "TimedReaders":
        """These readers with each read of a map given up on after `timeout_s` (one caller's
        setting: the readers' own is left as it is)."""
        return TimedReaders(self, timeout_s)

    def map(self, fn, *iterables, timeout=None, chunksize=1, read_timeout_s=None):
        """fn(item) of each item, in order; an item's result is StuckRead when its file
        (the item's first element, or its .path) did not answer within `read_timeout_s`
        (else timeout_s) of its read's start, is stuck already, or no reader is left (every
        one stuck)."""
        limit = self.timeout_s if read_timeout_s is None else float(read_timeout_s)
        items = list(zip(*iterables)) if len(iterables) > 1 else list(iterables[0])
        out: list = [None] * len(items)
        futures: dict[Future, int] = {}
        for i, item in enumerate(items):
            file = _file_of(item)
            with self._lock:
                began, closed = self.stuck.get(file), self._closed
            if closed:   # (a thread still at work while the monitor stops: nothing is read)
                out[i] = StuckRead(file, None, "not read: the readers are shut down")
            elif began is not None:
                out[i] = StuckRead(file, None, _still_stuck(time.monotonic() - began))
            else:
                futures[self.submit(fn, *item) if len(iterables) > 1
                        else self.submit(fn, item)] = i
        pending = set(futures)
        # set once every read still waited for is done (one wake, not one per read)
        gate, awaited = threading.Lock(), set(futures)
        all_read: Future = Future()

        def settled(fut: Future) -> None:   # (a read done, or no longer waited for)
            with gate:
                awaited.discard(fut)
                if not awaited and not all_read.done():
                    all_read.set_result(None)

        for fut in futures:
            fut.add_done_callback(settled)
        while pending:
            now, given_up = time.monotonic(), []
            with self._lock:
                for fut in [f for f in self._running if f in pending]:   # (begun: a few)
                    file, began, thread = self._running[fut]
                    if now - began >= limit and not fut.done():
                        del self._running[fut]
                        self._left[thread] = file
                        self.stuck[file] = began
                        self._workers -= 1
                        self.given_up += 1
                        pending.discard(fut)
                        settled(fut)
                        out[futures[fut]] = StuckRead(file, None, _still_stuck(now - began))
                        given_up.append(file)
                        if len(self._left) < self.max_stuck and not self._closed:
                            self._start()   # (in its place)
                if self._workers == 0:   # every reader left behind: the rest wait for later
                    for fut in [f for f in pending if f.cancel()]:
                        pending.discard(fut)
                        out[futures[fut]] = StuckRead(
                            _file_of(items[futures[fut]]), None,
                            f"not read: {len(self._left)} reads of watched files are stuck "
                            f"(at most {self.max_stuck} are left behind)")
                due = [began + limit for f, (_, began, _) in self._running.items()
                       if f in pending]
                stuck_now = len(self._left)
            for file in given_up:
                log.warning("%s: its read did not return within %g s (a hung file system?); "
                            "given up on (a watched file: left for a later scan), its thread "
                            "left behind (%d reads stuck now)", file, limit, stuck_now)
            if not pending:
                break
            # (woken once all are read, at shutdown, or at the first deadline of a read
            # begun; a read not begun yet has none: the readers' deadlines bound its wait.
            # Not at each read done: a batch of 1,024 files cost a pass over the rest per read)
            wait((all_read, self._shut),
                 timeout=max(0.0, min(due, default=now + limit) - time.monotonic()),
                 return_when=FIRST_COMPLETED)
            for fut in [f for f in pending if f.done()]:
                pending.discard(fut)
                if not fut.cancelled():
                    out[futures[fut]] = fut.result()
            if self._shut.done():   # (the readers' owner stops: no read is waited for)
                for fut in pending:
                    out[futures[fut]] = StuckRead(_file_of(items[futures[fut]]), None,
                                                  "not read: the readers are shut down")
                break
        return iter(out)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop the readers; none is waited for (a stuck one never returns)."""
        with self._lock:
            self._closed = True
            workers = self._workers
            if not self._shut.done():
                self._shut.set_result(None)
        for _ in range(workers):
            self._tasks.put(None)

    def _start(self) -> None:
        """One more reader thread (held by _lock)."""
        self._workers += 1
        threading.Thread(target=self._work, name=self.name, daemon=True).start()

    def _work(self) -> None:
        me = threading.get_ident()
        while True:
            task = self._tasks.get()
            if task is None:   # (shut down: behind every read asked for before)
                with self._lock:
                    self._workers -= 1
                return
            fut, call, file = task
            if not fut.set_running_or_notify_cancel():
                continue
            with self._lock:
                self._running[fut] = (file, time.monotonic(), me)
            try:
                fut.set_result(call())
            except BaseException as exc:   # noqa: BLE001 - the caller's to see
                fut.set_exception(exc)
            with self._lock:
                self._running.pop(fut, None)
                left = self._left.pop(me, None)
                if left is None:
                    continue
                began = self.stuck.pop(left, time.monotonic())
                stuck_now = len(self._left)
                # back: it reads again if the readers are short of one, else it ends
                back = not self._closed and self._workers < self.threads
                if back:
                    self._workers += 1
            log.warning("%s: its stuck read returned after %.0f s; the file is read again "
                        "when next asked for (%d reads stuck now)", left,
                        time.monotonic() - began, stuck_now)
            if not back:
                return


class TimedReaders(Executor):
    """A FileReaders' threads with one caller's read timeout (a window's tracker): set on the
    shared readers at each call, two monitors in one process overwrote each other's."""

    def __init__(self, readers: FileReaders, timeout_s: float):
        self.readers, self.timeout_s = readers, float(timeout_s)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        return self.readers.submit(fn, *args, **kwargs)

    def map(self, fn, *iterables, timeout=None, chunksize=1):
        return self.readers.map(fn, *iterables, read_timeout_s=self.timeout_s)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing: the readers are their owner's to stop."""


def _still_stuck(seconds: float) -> str:
    return f"its read has not returned in {seconds:.0f} s (a hung file system?)"



def _file_of(item) -> str:
    """The file a reader's item reads: its .path, its first element, or itself."""
    path = getattr(item, "path", None)
    if path is None:
        path = item[0] if isinstance(item, tuple) and item else item
    return str(path)
