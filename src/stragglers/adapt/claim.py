"""One shard service per database file: a second one, each answering from its own cached
state (read caches, owners, generations), served what the file no longer held."""

from __future__ import annotations

import fcntl
import logging
import os
from pathlib import Path

from stragglers.errors import InputError

log = logging.getLogger(__name__)


class Claim:
    """The exclusive flock of a database file, held while this is open (close() drops it)."""

    def __init__(self, fd: int | None):
        self.fd = fd

    def close(self) -> None:
        """Give up the claim (closing the descriptor drops the lock)."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def claim(db: str | Path) -> Claim:
    """An exclusive flock on the database file itself (its inode), held while the returned
    Claim is open; the kernel drops it when the process ends, kill -9 included, so a restart
    is never refused for it. InputError naming the file when another service holds it.

    Was a lock file named after the path the --db reached: a hard link to the database, or the
    same file through a bind mount, reached another lock name and a second service started on
    the one file. (flock, apart from the POSIX locks SQLite takes on the same file; the
    descriptor is closed only after the store's connections: closing a descriptor of a file
    drops every POSIX lock the process holds on it.)"""
    try:
        fd = os.open(db, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise InputError(str(db), None, f"cannot open the database to claim it ({exc.strerror})"
                         ) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _holder(fd)
        os.close(fd)
        raise InputError(str(db), None, "another shard service serves this file"
                         + (f" (pid {holder})" if holder else "")
                         + "; stop it first (two on one file each answer from their own"
                         " cached state)") from None
    except OSError as exc:   # a file system without flock (some FUSE, old NFS): no claim
        os.close(fd)
        log.warning("%s: cannot lock the database file (%s): a second service on it would not"
                    " be refused", db, exc.strerror)
        return Claim(None)
    return Claim(fd)


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
