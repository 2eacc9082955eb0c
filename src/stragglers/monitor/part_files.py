"""Part files on disk: opened only when regular and bounded, mapped, written atomically."""

from __future__ import annotations

import contextlib
import mmap
import os
import stat
from pathlib import Path

from stragglers.errors import InputError
from stragglers.trace.runformat import rank_file_name


MAX_PART_FILE_BYTES = 1 << 30   # a watched part file (an upload is bounded by max_part_bytes)



def open_part_file(path: Path, limit: int = MAX_PART_FILE_BYTES):
    """(binary file, size) of a part file, opened without blocking and only if it is a
    regular file of at most `limit` bytes (a FIFO named like a part would block the ingest
    thread for good); InputError naming the file otherwise (FileNotFoundError passes)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(path, None, "not a regular file (a FIFO, device or directory "
                             "named like a part); expected a Parquet file")
        if st.st_size > limit:
            raise InputError(path, None, f"{st.st_size} bytes; expected at most {limit}")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb"), st.st_size



def mapped(f, size: int):
    """The bytes of an open file, mapped (only the page headers are touched)."""
    if size == 0:
        return contextlib.nullcontext(b"")
    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)



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
