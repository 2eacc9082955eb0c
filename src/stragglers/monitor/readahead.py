"""Part files (watched or uploaded) decoded ahead, in the analysis process, as they arrive: a
window that closes finds its rows read (the footer-only ingest otherwise moves every decode to
the close)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

from stragglers.errors import InputError
from stragglers.monitor.part_files import READ_TIMEOUT_S, FileReaders
from stragglers.monitor.parts import PartData, PartFile, read_part_files

CHUNK = 64   # parts read and checked together on one thread (checks cost per column, not row)


class ReadAhead:
    """Part files being read ahead, held until the window that ends them takes them."""

    def __init__(self, max_rows: int = 4_000_000, threads: int = 2):
        self.max_rows = max_rows   # beyond this, windows read their files themselves
        self.rows = 0
        self._held: dict[str, tuple[PartFile, Future, int]] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="stragglers-read-ahead")
        # each file read bounded (FileReaders): a file that hangs since its footer was read
        # (its NFS server gone) is a part its window goes without, not a window (and every
        # window after it, and the stop) waiting on it for good
        self._files = FileReaders(threads, name="stragglers-read-ahead-file")

    def add(self, files: list[PartFile], read_timeout_s: float = READ_TIMEOUT_S) -> None:
        """Start reading these parts (those over the row bound are left to their window), each
        file's read given up on after `read_timeout_s` (the monitor's setting)."""
        take = []
        with self._lock:
            for f in files:
                if str(f.path) not in self._held and self.rows + f.records <= self.max_rows:
                    take.append(f)
                    self.rows += f.records
        for i in range(0, len(take), CHUNK):
            chunk = take[i:i + CHUNK]
            # (timed: the caller's setting, not the readers' own; two monitors in one process
            # may have two: a fixed 5 s cut a slow file system's reads that the setting allowed)
            fut = self._pool.submit(read_part_files, [f.path for f in chunk],
                                    self._files.timed(read_timeout_s),
                                    [f.digest for f in chunk], [f.within for f in chunk])
            with self._lock:
                for j, f in enumerate(chunk):
                    self._held[str(f.path)] = (f, fut, j)

    def take(self, files: list[PartFile], last_step: int) -> dict[str, PartData | InputError]:
        """What was read ahead of these parts (path → rows or refusal); a part that ends at or
        before `last_step` is let go (no later window needs it)."""
        out = {}
        for f in files:
            key = str(f.path)
            with self._lock:
                entry = self._held.get(key)
            if entry is None:
                continue
            held, fut, j = entry
            out[key] = fut.result()[j]
            if held.last_step <= last_step:
                with self._lock:
                    if self._held.pop(key, None) is not None:
                        self.rows -= held.records
        return out


    def forget(self, directory: str) -> None:
        """Let go of every part held from `directory` (a new run writes the same file names)."""
        prefix = directory.rstrip("/") + "/"
        with self._lock:
            for key in [k for k in self._held if k.startswith(prefix)]:
                self.rows -= self._held.pop(key)[0].records


_AHEAD: list[ReadAhead] = []


def read_ahead() -> ReadAhead:
    """This process's ReadAhead."""
    if not _AHEAD:
        _AHEAD.append(ReadAhead())
    return _AHEAD[0]


def forget_parts(directory: str) -> None:
    """ReadAhead.forget in this process (the analyser submits this to its process)."""
    read_ahead().forget(directory)


def read_ahead_parts(files: list[PartFile], read_timeout_s: float = READ_TIMEOUT_S) -> None:
    """Start reading these parts in this process (the analyser submits this to its process)."""
    read_ahead().add(files, read_timeout_s)
