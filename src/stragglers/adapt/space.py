"""Whether a failed write of the shard store failed for want of space: checked, not guessed.

SQLite says "database or disk is full" (SQLITE_FULL) when a write got ENOSPC, but only "disk I/O
error" when it got EFBIG (the process's file-size limit) or EDQUOT, and for a failing disk alike.
An I/O error on a write counts as want of space only when the space is seen to be gone: a file of
the database cannot grow by one more SQLite write under the file-size limit, or its file system
has (almost) no free blocks left for this process.
"""

from __future__ import annotations

import errno
import os
import resource
import sqlite3

SQLITE_FULL = 13
SQLITE_IOERR = 10
# the I/O errors of writing or growing a file (extended codes: SQLITE_IOERR | n << 8)
_WRITE_IOERRS = {778, 1034, 1290, 1546, 4874, 5386}   # WRITE, FSYNC, DIR_FSYNC, TRUNCATE,
#                                                       SHMSIZE, SHMMAP
# SQLite's largest single write here: one WAL frame of the largest page (64 KiB + its header);
# a -shm file grows by 32 KiB
LARGEST_WRITE = (1 << 16) + 24
# free blocks under this are a full file system: ext4 and others refuse a write before the last
# block (metadata, delayed-allocation reservations)
MIN_FREE_BYTES = 1 << 20


def out_of_space(exc: BaseException, db: str) -> bool:
    """Whether `exc`, raised by a write to the shard database file `db`, means its storage is
    full (a 507 to retry once space is freed), not a damaged or failing disk."""
    if isinstance(exc, OSError):
        return exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    if not isinstance(exc, sqlite3.Error):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    if code == SQLITE_FULL:
        return True
    return code in _WRITE_IOERRS and exhausted(db)


def io_error(exc: BaseException) -> bool:
    """Whether `exc` is an I/O error of the database's files (not a lock or a constraint)."""
    if isinstance(exc, OSError):
        return True
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.Error) and code is not None and (
        code & 0xFF in (SQLITE_IOERR, SQLITE_FULL))


def exhausted(db: str) -> bool:
    """Whether the database `db` cannot grow: one of its files is within one SQLite write of the
    process's file-size limit (RLIMIT_FSIZE), or its directory's file system is out of space."""
    sizes = []
    for suffix in ("", "-wal", "-shm", "-journal"):
        try:
            sizes.append(os.stat(db + suffix).st_size)
        except OSError:
            pass
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY and max(sizes, default=0) + LARGEST_WRITE > soft:
        return True
    try:
        fs = os.statvfs(os.path.dirname(os.path.abspath(db)))
    except OSError:
        return False
    return fs.f_bavail * fs.f_frsize < MIN_FREE_BYTES
