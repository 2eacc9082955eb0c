"""A part's identity: job names, part numbers, file names, and its bytes' fingerprint."""

from __future__ import annotations

import hashlib
import os
import re
import stat
from pathlib import Path

from stragglers.errors import InputError
from stragglers.trace.runformat import RANK_FILE, rank_file_name


# Job names become directory names: letters, digits, '.', '_', '-', no leading dot, bounded;
# matched whole (fullmatch: `$` also matches before a final newline, and 'j\n' was a job)
JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

MAX_RANK = 9_999_999

MAX_PART = 999_999

MAX_WINDOW = 2**63 - 1  # a window index in a request: SQLite's largest integer


class PartConflict(InputError):
    """A part number already stored with other bytes: answered 409, nothing is replaced."""



def fingerprint(body: bytes) -> str:
    """The digest that tells a retried upload (same bytes) from a different part."""
    return hashlib.blake2b(body, digest_size=16).hexdigest()



def file_fingerprint(path: Path) -> str | None:
    """`fingerprint` of a stored part's file, read in chunks (None: it cannot be read now:
    the read that follows names why)."""
    h = hashlib.blake2b(digest_size=16)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)   # (a FIFO put there must not block)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        while chunk := os.read(fd, 1 << 20):
            h.update(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return h.hexdigest()


def check_same_part(stored: str | None, digest: str | None, job: str, rank: int,
                    part: int) -> None:
    """PartConflict when an upload reuses a stored part's number with different bytes."""
    if stored is not None and digest is not None and stored != digest:
        raise PartConflict(f"part {job}/{rank}/{part}", None,
                           f"part {part} of rank {rank} is already stored with different "
                           "content; a restarted job that numbers its parts from 0 again "
                           "needs a new job name (nothing was replaced)")



def is_job_name(job: object) -> bool:
    """Whether `job` is safe as a directory name (JOB_NAME matched whole, no '..')."""
    return isinstance(job, str) and JOB_NAME.fullmatch(job) is not None and ".." not in job


def check_job_name(job: str, source: object = "job") -> str:
    """The job name if it is safe as a directory name, else InputError naming the problem."""
    if not is_job_name(job):
        raise InputError(source, "job", f"{str(job)[:80]!r} is not a valid job name: expected "
                         "1-128 letters, digits, '.', '_' or '-', starting with a letter or digit, "
                         "without '..' or path separators")
    return job



def parse_part_name(name: str) -> tuple[int, int] | None:
    """(rank, part) of a `rank-RRRRR.part-PPPPPP.parquet` file name as the recorder writes
    it (rank_file_name), None for other files: `rank-0.part-1.parquet` or `part-0001` named
    the same part as the recorder's own file, so a copy stored first had the real one refused,
    and after a restart the part's path, rebuilt from its numbers, was the other file."""
    m = RANK_FILE.match(name)
    if m is None or len(name) > 64:   # (no int() of a 10,000-digit number)
        return None
    rank, part = int(m[1]), int(m[2]) if m[2] is not None else None
    if rank_file_name(rank, part) != name:
        return None
    return rank, part or 0



def is_whole_rank_file(path: Path | None) -> bool:
    """Whether a part file is a whole rank's ops (rank-RRRRR.parquet), written once a run ended."""
    if path is None:
        return False
    m = RANK_FILE.match(path.name)
    return m is not None and m[2] is None



def part_path(directory: Path, rank: int, part: int) -> Path:
    """Where a stored part's file is: its part file, or for part 0 a whole-rank file
    (rank-RRRRR.parquet names part 0 too; rebuilding the part-file name for it lost a watched
    run's unanalysed tail at every restart)."""
    path = directory / rank_file_name(rank, part)
    if part == 0 and not os.path.lexists(path):
        whole = directory / rank_file_name(rank)
        if os.path.lexists(whole):
            return whole
    return path
