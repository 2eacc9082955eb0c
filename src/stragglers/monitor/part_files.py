"""Part files on disk: opened only when regular and bounded, read in place, written atomically."""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from pathlib import Path

from stragglers.errors import InputError
from stragglers.trace.runformat import rank_file_name


MAX_PART_FILE_BYTES = 1 << 30   # a watched part file (an upload is bounded by max_part_bytes)

# a part file up to this size is read in one read and checked and decoded from those bytes (a
# recorder's parts are kB to a few MB); a larger one is read where touched (FileBytes)
WHOLE_READ_BYTES = 16 << 20



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
