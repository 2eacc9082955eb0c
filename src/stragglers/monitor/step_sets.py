"""A part's distinct steps, kept compactly, so that two parts of a rank conflict only when
they share a step (a part of steps 0..3 and 904 once made the rank's parts of steps 5..903
"overlap" it by its range, and ~180 of its windows were analysed without the rank).

A step set is written as runs of evenly spaced steps: "a" (one step), "a-b" (every step of
a..b) or "a-b/s" (every s-th), joined by ","; a recorder's parts are one run (consecutive, or
every sample_every-th step), so the text stays short.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stragglers.monitor.part_files import open_part_file, read_whole
from stragglers.monitor.part_limits import MAX_PART_ROWS

# runs kept in the store per part; a part of more is left unwritten (None) and its steps are
# read from its file when a conflict is to be judged
MAX_RUNS = 4096

# a step set: its distinct steps, or the whole range first..last (not materialised: a range
# may span millions of steps)
Steps = np.ndarray | tuple[int, int]


def distinct(steps: np.ndarray) -> np.ndarray:
    """The sorted distinct values of a step column as int64 (a recorder's come sorted: no
    sort then)."""
    d = np.diff(steps)
    if len(steps) and (d >= 0).all():
        return steps[np.concatenate(([True], d != 0))].astype(np.int64)
    return np.unique(steps).astype(np.int64)


def encode(steps: np.ndarray) -> str | None:
    """The text of a sorted array of distinct steps (None: empty, or more than MAX_RUNS runs)."""
    s = np.asarray(steps, dtype=np.int64)
    if not len(s):
        return None
    runs: list[str] = []
    n = len(s)
    d = np.diff(s)
    # where the spacing changes: a run starting at i ends at the first change after it (found
    # by bisection, not a step-by-step loop: a part may hold a million steps)
    change = np.flatnonzero(d[1:] != d[:-1]) + 1
    i = 0
    while i < n:
        if i == n - 1:
            runs.append(str(int(s[i])))
            break
        stride = int(d[i])
        at = int(np.searchsorted(change, i, side="right"))
        j = int(change[at]) if at < len(change) else n - 1
        if j == i + 1 and stride != 1:   # two steps apart are not a run: the first alone
            runs.append(str(int(s[i])))
            j = i
        else:
            runs.append(f"{int(s[i])}-{int(s[j])}" + (f"/{stride}" if stride != 1 else ""))
        if len(runs) > MAX_RUNS:
            return None
        i = j + 1
    return ",".join(runs)


def decode(text: object, first: int, last: int) -> np.ndarray | None:
    """The steps written by encode, or None when the text does not read as steps within
    first..last of at most MAX_PART_ROWS (a store written before step sets, or damaged: the
    caller falls back to the range, as before)."""
    if not isinstance(text, str) or not text:
        return None
    out: list[np.ndarray] = []
    total = 0
    try:
        for run in text.split(","):
            head, _, stride_text = run.partition("/")
            lo_text, dash, hi_text = head.partition("-")
            lo = int(lo_text)
            hi = int(hi_text) if dash else lo
            stride = int(stride_text) if stride_text else 1
            if stride < 1 or hi < lo or lo < first or hi > last:
                return None
            count = (hi - lo) // stride + 1
            total += count
            if total > MAX_PART_ROWS:
                return None
            out.append(np.arange(lo, hi + 1, stride, dtype=np.int64))
    except ValueError:
        return None
    steps = np.unique(np.concatenate(out))
    return steps if len(steps) else None


def meet(a: Steps, b: Steps) -> bool:
    """Whether two step sets share a step."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return a[0] <= b[1] and b[0] <= a[1]
    if isinstance(a, tuple):
        a, b = b, a
    if isinstance(b, tuple):
        arr = np.asarray(a)
        return bool(((arr >= b[0]) & (arr <= b[1])).any())
    return bool(len(np.intersect1d(a, b, assume_unique=True)))


def read_steps(source: bytes | Path, within: str = "") -> np.ndarray | None:
    """The distinct steps of a Parquet part (its bytes, or its file opened as the ingest opens
    one: regular, bounded, inside `within`); None when they cannot be read."""
    try:
        if isinstance(source, Path):
            f, nbytes = open_part_file(source, within=within)
            with f:
                source = read_whole(f, nbytes)
        # one thread, no pre-buffering, row groups named: half the CPU of .read() on a
        # recorder's part (~110 against ~220 µs; benchmarks/monitor_window_settle.py)
        pf = pq.ParquetFile(pa.BufferReader(source), pre_buffer=False)
        table = pf.read_row_groups(range(pf.num_row_groups), columns=["step"],
                                   use_threads=False)
        if table.num_rows > MAX_PART_ROWS:
            return None
        return distinct(table.column(0).to_numpy(zero_copy_only=False))
    except Exception:   # anything a damaged file raises: the caller keeps the range, as before
        return None
