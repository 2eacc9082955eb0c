"""One part (a flushed Parquet file of one rank): names, and the checks before it is stored."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stragglers.errors import InputError
from stragglers.trace.columns import table_to_columns
from stragglers.trace.runformat import RANK_FILE, rank_file_name

# Job names become directory names: letters, digits, '.', '_', '-', no leading dot, bounded.
JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_RANK = 9_999_999
MAX_PART = 999_999


def check_job_name(job: str, source: object = "job") -> str:
    """The job name if it is safe as a directory name, else InputError naming the problem."""
    if not isinstance(job, str) or not JOB_NAME.match(job) or ".." in job:
        raise InputError(source, "job", f"{str(job)[:80]!r} is not a valid job name: expected "
                         "1-128 letters, digits, '.', '_' or '-', starting with a letter or digit, "
                         "without '..' or path separators")
    return job


def parse_part_name(name: str) -> tuple[int, int] | None:
    """(rank, part) of a `rank-RRRRR.part-PPPPPP.parquet` file name, None for other files."""
    m = RANK_FILE.match(name)
    if m is None:
        return None
    return int(m[1]), int(m[2]) if m[2] is not None else 0


@dataclass
class PartData:
    """A checked part: its op columns and what the store keeps about it."""

    rank: int
    part: int
    columns: dict[str, np.ndarray]
    nbytes: int

    @property
    def records(self) -> int:
        return int(len(self.columns["step"]))

    @property
    def first_step(self) -> int:
        return int(self.columns["step"].min()) if self.records else -1

    @property
    def last_step(self) -> int:
        return int(self.columns["step"].max()) if self.records else -1


def check_part(table: pa.Table, source: object, rank: int, part: int, nbytes: int) -> PartData:
    """Validate an op table as one rank's part (schema, values, and that it is that rank's)."""
    cols = table_to_columns(table, source)
    if len(cols["rank"]) and (cols["rank"] != rank).any():
        other = int(cols["rank"][cols["rank"] != rank][0])
        raise InputError(source, "rank", f"rows of rank {other} in a part of rank {rank}; "
                         "expected one rank per part")
    return PartData(rank, part, cols, nbytes)


def read_small_parquet(source) -> pa.Table:
    """One small Parquet file, read on this thread: for parts of a few thousand rows this is
    ~5× faster than pq.read_table (no dataset discovery, no thread-pool hand-offs)."""
    return pq.ParquetFile(source).read(use_threads=False)


def read_part_bytes(data: bytes, source: object, rank: int, part: int) -> PartData:
    """Parse and validate an uploaded part (Parquet bytes)."""
    try:
        table = read_small_parquet(pa.BufferReader(data))
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(source, "body", f"not a readable Parquet file ({first[:200]})") from None
    return check_part(table, source, rank, part, len(data))


def read_part_file(path: Path) -> PartData:
    """Read and validate a part file of a run directory."""
    ids = parse_part_name(path.name)
    if ids is None:
        raise InputError(path, None, "not a rank-RRRRR.part-PPPPPP.parquet file")
    try:
        table = read_small_parquet(path)
        nbytes = path.stat().st_size
    except FileNotFoundError:
        raise InputError(path, None, "vanished before it could be read") from None
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(path, None, f"not a readable Parquet file ({first[:200]})") from None
    return check_part(table, path, ids[0], ids[1], nbytes)


def write_part_file(directory: Path, rank: int, part: int, data: bytes) -> Path:
    """Put uploaded bytes in the run format, atomically and durably (fsync, then rename)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / rank_file_name(rank, part)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{id(data):x}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself must survive a power cut before the part is acknowledged
    finally:
        os.close(fd)
    return path
