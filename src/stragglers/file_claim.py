"""One service per database file: an exclusive flock on the file itself, never a descriptor of
it closed while the service's SQLite connections may hold POSIX locks on it.

Closing any descriptor of a file drops every POSIX (fcntl) lock the process holds on it, and
SQLite's connections hold theirs for their whole life (a WAL reader's SHARED lock among
them). A claim refused in a process that serves the same file (a second service started by
mistake, a test) used to close its descriptor: the serving connections lost their locks, the
next process to open and close the file took itself for the last one and deleted the live
write-ahead log, and what the first service acknowledged after that was lost at kill -9. So a
refused claim keeps its descriptor for the next attempt on that file (one per file a process
was refused), and a claim this process already holds is refused without opening the file.
"""

from __future__ import annotations

import fcntl
import os
import threading
from dataclasses import dataclass
from pathlib import Path


class Held(Exception):
    """Another service (`pid`, None when unknown) holds the claim."""

    def __init__(self, pid: int | None):
        super().__init__(pid)
        self.pid = pid


@dataclass
class _Entry:
    fd: int
    owned: bool


_LOCK = threading.Lock()
_FILES: dict[tuple[int, int], _Entry] = {}   # (st_dev, st_ino) -> this process's descriptor
_LEAKED: list[int] = []   # descriptors never closed: a file replaced under the path, see below


class FileClaim:
    """The exclusive flock of one file, held while this is open (close() drops it)."""

    def __init__(self, key: tuple[int, int]):
        self._key: tuple[int, int] | None = key

    def close(self) -> None:
        """Give up the claim: the descriptor is closed (call it after the store's own
        connections are closed: that close drops the process's POSIX locks on the file)."""
        with _LOCK:
            if self._key is None:
                return
            entry = _FILES.pop(self._key, None)
            self._key = None
            if entry is not None:
                os.close(entry.fd)


def claim_file(path: str | Path) -> FileClaim | None:
    """An exclusive flock on the file at `path` (its inode: a hard link, a symlink or a bind
    mount reaches the same one), held while the returned FileClaim is open; the kernel drops it
    when the process ends, kill -9 included. Held when another service holds it (this process's
    own included); None on a file system without flock (no claim); OSError when the file cannot
    be opened."""
    with _LOCK:
        key = _key(os.stat(path))
        entry = _FILES.get(key)
        if entry is not None and entry.owned:
            raise Held(os.getpid())
        if entry is None:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            key = _key(os.fstat(fd))   # (the file the descriptor reached, if it was replaced)
            if key in _FILES:          # ... by one this process knows: keep both descriptors
                _LEAKED.append(fd)     # (closing it would drop that file's POSIX locks)
                entry = _FILES[key]
                if entry.owned:
                    raise Held(os.getpid())
            else:
                entry = _FILES[key] = _Entry(fd, False)
        try:
            fcntl.flock(entry.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Held(_holder(entry.fd)) from None   # (the descriptor kept: see above)
        except OSError:
            # a file system without flock (some FUSE, old NFS): no claim; the descriptor stays
            # registered, as a refused one
            return None
        entry.owned = True
        return FileClaim(key)


def _key(st: os.stat_result) -> tuple[int, int]:
    return (st.st_dev, st.st_ino)


def _holder(fd: int) -> int | None:
    """The pid holding a flock on the file of `fd` (from /proc/locks), None when unknown."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as f:
            for line in f:
                # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF"
                fields = line.split()
                if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode \
                        and fields[4].isdigit():
                    return int(fields[4])
    except OSError:
        pass
    return None
