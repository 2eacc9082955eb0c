"""Whether a failed write of the shard store failed for want of space: checked, not guessed.

SQLite says "database or disk is full" (SQLITE_FULL) when a write got ENOSPC, but only "disk I/O
error" when it got EFBIG (the process's file-size limit) or EDQUOT, and for a failing disk alike.
An I/O error on a write counts as want of space only when the space is seen to be gone: a file of
the database cannot grow by one more SQLite write under the file-size limit, or its file system
has (almost) no free blocks left for this process.
"""

from __future__ import annotations

import errno
import hashlib
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


def corrupt_file(exc: BaseException) -> bool:
    """Whether `exc` says a page of the database file is damaged (SQLITE_CORRUPT, NOTADB):
    what a statement read there, not the disk or a lock."""
    code = getattr(exc, "sqlite_errorcode", None)
    return isinstance(exc, sqlite3.Error) and code is not None and (
        code & 0xFF in (sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB))


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


# Space a restore sets aside before it writes (see Reserve): an upper bound of its rows' bytes.
# Each shard row is an entry in five b-trees (the row and its four indices, schema.py), each
# carrying the rows key and a few integers; b-tree pages split in two are half full.
ROW_TREES = 5
ENTRY_OVERHEAD = 24        # cell header, rowid and integer columns of one index entry
FIXED_PAGES = 64 * 4096    # interior and freelist pages the deletion rewrites besides


def restore_bound(rows: int, key_len: int, payload: int) -> int:
    """An upper bound of the bytes `rows` shard rows under a key of `key_len` characters take
    in the file (and of the log a deletion of them writes): `payload`, their packed size."""
    return 2 * (rows * ROW_TREES * (key_len + ENTRY_OVERHEAD) + payload) + FIXED_PAGES


class Reserve:
    """Space set aside beside the database (a file of `nbytes` allocated blocks) while a
    restore writes: given back before the rows written so far are deleted, so that a restore
    refused for space can always take its rows back (deleting writes the log too)."""

    def __init__(self, db: str, nbytes: int):
        self.path: str | None = os.path.join(os.path.dirname(os.path.abspath(db)),
                                             f"{self.prefix(db)}{os.getpid()}-{id(self):x}")
        soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
        if soft != resource.RLIM_INFINITY and nbytes > soft:
            raise OSError(errno.EFBIG, "past the file-size limit")
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                     | os.O_CLOEXEC, 0o600)
        try:
            _allocate(fd, nbytes)
            free = os.statvfs(os.path.dirname(os.path.abspath(db)))
            if free.f_bavail * free.f_frsize < nbytes + MIN_FREE_BYTES:
                # (the rows themselves need as much again beside the reserve)
                raise OSError(errno.ENOSPC, "no room for the rows beside their reserve")
        except BaseException:
            self.release()
            raise
        finally:
            os.close(fd)

    def release(self) -> None:
        """Give the space back (idempotent)."""
        path, self.path = self.path, None
        if path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    @staticmethod
    def prefix(db: str) -> str:
        """The start of the names of `db`'s reserves, in its folder: short whatever the
        database's name (`<db>-reserve-...` was past NAME_MAX for a name of 230 characters,
        which SQLite's own `-wal` still fits, and every restore failed)."""
        name = os.path.basename(os.path.abspath(db))
        return f".{name[:16]}-{hashlib.sha256(name.encode()).hexdigest()[:12]}-reserve-"

    @classmethod
    def sweep(cls, db: str) -> None:
        """Remove the reserves a killed process left beside `db` (the claim is held: none is
        another process's)."""
        folder, name = os.path.split(os.path.abspath(db))
        try:
            names = os.listdir(folder)
        except OSError:
            return
        for other in names:
            if other.startswith(cls.prefix(db)):
                try:
                    os.unlink(os.path.join(folder, other))
                except OSError:
                    pass


def _allocate(fd: int, nbytes: int) -> None:
    """Allocate `nbytes` of blocks to `fd`'s file (written as zeros where the system has no
    posix_fallocate, macOS: a sparse file would set nothing aside)."""
    if hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, 0, nbytes)
        return
    block = b"\0" * (1 << 20)
    left = nbytes
    while left > 0:
        left -= os.write(fd, block[:left])
