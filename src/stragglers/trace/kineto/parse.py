"""Parse rank files into RankParts, in parallel processes when there is enough to gain.

Each worker decodes one file at a time and returns only the compact parts (arrays of compute
items and a list of collectives), so peak memory is about one decoded file per worker, and the
parent never holds a rank's events. Workers are bounded by cores and by free memory; a large
input is parsed in a worker process even with one worker.
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from stragglers.errors import InputError
from stragglers.trace.kineto import fastdecode
from stragglers.trace.kineto.events import read_rank_events
from stragglers.trace.kineto.items import rank_parts
from stragglers.trace.kineto.ops import RankParts

# Below this much input, starting processes costs more than it saves.
PARALLEL_MIN_BYTES = 8 << 20
# From this much input on, even one parse runs in a worker process: a decoded file's memory is
# freed but not returned to the system by the allocator (a 1.1 GB file left ~0.9 GB of RSS
# behind in the process, 13 MB of it live), and the parent keeps only the compact parts.
SEPARATE_PROCESS_BYTES = 256 << 20
# A file needs about this many times its (decompressed) size while it is parsed: msgspec reads
# it a chunk at a time (what stays is the events as typed columns: 0.4x measured on 1.1 GB
# files, BENCHMARKS.md issue 29; 1.5 keeps the margin of the tuples it used to hold);
# the stdlib holds its whole text and the events.
MEMORY_PER_BYTE = 1.5 if fastdecode.AVAILABLE else 3


def parse_one(path: Path | str) -> RankParts:
    """One file → RankParts (InputError naming the file and field on bad input)."""
    return rank_parts(read_rank_events(path))


def _parse_in_worker(path: str):
    # InputError does not survive pickling (its constructor takes three arguments): send fields.
    try:
        return parse_one(path)
    except InputError as exc:
        return ("InputError", exc.source, exc.field, exc.problem)


def parse_files(files: list[Path], workers: int | None = None) -> list[RankParts]:
    """RankParts of every file, in file order; the first bad file (in order) raises."""
    n = _worker_count(files, workers)
    if n <= 1 and sum(_size(f) for f in files) < SEPARATE_PROCESS_BYTES:
        return [parse_one(f) for f in files]
    with ProcessPoolExecutor(n, mp_context=_context()) as pool:
        results = list(pool.map(_parse_in_worker, [str(f) for f in files]))
    for r in results:
        if isinstance(r, tuple):
            raise InputError(r[1], r[2], r[3])
    return results


def _worker_count(files: list[Path], workers: int | None) -> int:
    if workers is not None:
        if not isinstance(workers, int) or workers < 1:
            raise InputError("workers", None, f"expected a whole number >= 1, got {workers!r}")
        return min(workers, len(files))
    if len(files) < 2:
        return 1
    sizes = [_size(f) for f in files]
    if sum(sizes) < PARALLEL_MIN_BYTES:
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = min(len(files), cores or 1)
    free = _available_memory()
    if free:
        # gzip files decompress to ~10x; plain JSON is as large as the file.
        biggest = max(s * (10 if f.name.endswith(".gz") else 1) for f, s in zip(files, sizes))
        n = min(n, max(1, int(free // max(1.0, MEMORY_PER_BYTE * biggest))))
    return max(1, n)


def _size(f: Path) -> int:
    try:
        return f.stat().st_size
    except OSError:
        return 0


def _available_memory() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _context():
    # fork is cheapest, but not safe once this process runs other threads (a progress bar,
    # a server): then start workers from a clean server process.
    methods = multiprocessing.get_all_start_methods()
    if "fork" in methods and threading.active_count() == 1:
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
