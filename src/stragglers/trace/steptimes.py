"""Per-worker step times (a CSV table) → the op table of a synchronous data-parallel job.

Clusters often keep nothing but each worker's time per step or mini-batch (e.g. Alibaba PAI's
released mini-batch times). That is enough to tell who is slow: in synchronous data
parallelism every worker computes its step, then waits at the gradient all-reduce for the
slowest one. Each worker's step becomes one compute op of its measured time, followed by an
all-reduce that ends when the slowest worker of the step arrives; the next step starts there.

The table needs a worker column, a step column and a time column; their names are recognised
(`rank`/`worker`, `step`/`iteration`/`time`, `step_time`/`batch_time`/`duration`...). Times
are seconds, or milliseconds / microseconds where the column name ends in `_ms` / `_us`;
normalised times (`*_norm`) are shown as milliseconds (only ratios matter to the analysis).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.model import OPTYPE_CODES, JobMeta, Trace

WORKER_NAMES = ("rank", "worker", "dp_rank", "worker_id")
STEP_NAMES = ("step", "iteration", "iter", "time", "batch")
TIME_NAMES = ("step_time", "batch_time", "step_time_s", "step_time_ms", "batch_time_ms",
              "batch_time_norm", "duration", "duration_s", "duration_ms", "seconds", "elapsed")
MAX_BYTES = 1 << 30


def looks_like_step_times(path: Path) -> bool:
    """A .csv file whose header names a worker, a step and a time column."""
    if not (path.is_file() and path.suffix == ".csv"):
        return False
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            header = next(csv.reader(fh), [])
    except (OSError, UnicodeDecodeError, csv.Error):
        return False
    try:
        _columns([h.strip().lower() for h in header], path)
    except InputError:
        return False
    return True


def read_step_times(path: Path | str, name: str | None = None) -> Trace:
    """Read a step-time table into a trace of one compute op and one all-reduce per worker-step."""
    path = Path(path)
    if path.stat().st_size > MAX_BYTES:
        raise InputError(path, None, f"{path.stat().st_size:,} bytes; expected a step-time "
                         f"table under {MAX_BYTES:,} bytes")
    with open(path, newline="", encoding="utf-8-sig") as fh:
        rows = list(csv.reader(fh))
    if len(rows) < 2:
        raise InputError(path, None, "no rows; expected a header and one row per worker and step")
    header = [h.strip().lower() for h in rows[0]]
    wi, si, ti = _columns(header, path)
    worker, step, seconds = _values(rows[1:], (wi, si, ti), header, path)
    seconds = seconds * _unit(header[ti])
    return _trace(worker, step, seconds, name or path.stem, str(path), header[ti])


def _columns(header: list[str], path: Path) -> tuple[int, int, int]:
    """Indexes of the worker, step and time columns."""
    def find(names: tuple[str, ...], what: str, taken: set[int]) -> int:
        for n in names:
            if n in header and header.index(n) not in taken:
                return header.index(n)
        raise InputError(path, what, f"no {what} column; expected one of {', '.join(names)} "
                         f"(the header has {', '.join(h for h in header if h) or 'nothing'})")
    ti = find(TIME_NAMES, "time", set())
    wi = find(WORKER_NAMES, "worker", {ti})
    return wi, find(STEP_NAMES, "step", {ti, wi}), ti


def _values(rows: list[list[str]], cols: tuple[int, int, int], header: list[str], path: Path):
    """The three columns as numbers; a bad cell names its row and column."""
    out = [np.empty(len(rows)) for _ in cols]
    for r, row in enumerate(rows):
        for k, c in enumerate(cols):
            try:
                out[k][r] = float(row[c])
            except (IndexError, ValueError):
                cell = row[c] if c < len(row) else "nothing"
                raise InputError(path, header[c], f"row {r + 2}: {cell!r}; expected a number"
                                 ) from None
    worker, step, seconds = out
    for values, col in ((worker, cols[0]), (step, cols[1])):
        if not np.all(np.isfinite(values)) or np.any(values != np.round(values)) \
                or np.any(values < 0) or np.any(values > 2**31):
            raise InputError(path, header[col], "expected whole numbers ≥ 0")
    if not np.all(np.isfinite(seconds)) or np.any(seconds < 0) or np.any(seconds > 1e7):
        raise InputError(path, header[cols[2]], "expected finite times ≥ 0")
    return worker.astype(np.int64), step.astype(np.int64), seconds


def _unit(column: str) -> float:
    """Seconds per unit of a time column, from its name (normalised, unitless times are read as
    milliseconds: a step of 0-1000 of them reads as a plausible step, and only ratios matter)."""
    if column.endswith(("_ms", "_norm")):
        return 1e-3
    if column.endswith("_us"):
        return 1e-6
    return 1.0


def _unique_rows(worker, step, seconds, source: str):
    """The rows with exact repeats (same worker, step and time) read once; a worker with two
    different times for one step is an error naming both."""
    keys = np.stack([worker, step]).T
    _, first, counts = np.unique(keys, axis=0, return_index=True, return_counts=True)
    if len(first) == len(worker):
        return worker, step, seconds, 0
    for k in np.flatnonzero(counts > 1):
        same = (worker == worker[first[k]]) & (step == step[first[k]])
        if np.ptp(seconds[same]) > 0:
            raise InputError(source, "step", f"worker {worker[first[k]]} has {int(same.sum())} "
                             f"rows for step {step[first[k]]} with different times "
                             f"({', '.join(f'{x:g}' for x in seconds[same][:4])}); expected one")
    keep = np.sort(first)
    return worker[keep], step[keep], seconds[keep], len(worker) - len(keep)


def _trace(worker, step, seconds, name: str, source: str, column: str) -> Trace:
    """Lay the steps end to end: compute from the step's start, the all-reduce to its end."""
    worker, step, seconds, repeated = _unique_rows(worker, step, seconds, source)
    workers, w_idx = np.unique(worker, return_inverse=True)
    steps, s_idx = np.unique(step, return_inverse=True)
    dur = np.full((len(workers), len(steps)), np.nan)
    dur[w_idx, s_idx] = seconds
    # synchronous DP: a step ends when its slowest worker's compute does (missing: skipped)
    span = np.nanmax(np.where(np.isnan(dur), -np.inf, dur), axis=0)
    start = np.concatenate([[0.0], np.cumsum(np.maximum(span, 0.0))[:-1]])
    comp = OPTYPE_CODES["forward-compute"]
    ar = OPTYPE_CODES["grads-all-reduce"]
    n = len(worker)
    ops = {
        "rank": np.tile(w_idx, 2), "dp_rank": np.tile(w_idx, 2), "stage": np.zeros(2 * n),
        "step": np.tile(steps[s_idx], 2), "optype": np.repeat([comp, ar], n),
        "start_ts": np.concatenate([start[s_idx], start[s_idx] + seconds]),
        "duration": np.concatenate([seconds, span[s_idx] - seconds]),
        "seq_id": np.zeros(2 * n), "mb_id": np.concatenate([np.zeros(n), -np.ones(n)]),
        "mc": np.zeros(2 * n), "gmc": np.zeros(2 * n),
    }
    from stragglers.trace.model import COLUMNS

    ops = {k: np.asarray(v).astype(COLUMNS[k]) for k, v in ops.items()}
    meta = JobMeta(name=name, dp_size=len(workers), pp_size=1,
                   extra={"source_format": "step_times",
                          "workers": [int(x) for x in workers]})
    trace = Trace(ops, meta, source)
    trace.note("layout", f"{len(workers)} workers read as the data-parallel ranks 0–"
                         f"{len(workers) - 1} of one stage (worker ids {int(workers[0])}–"
                         f"{int(workers[-1])} in file order)")
    if repeated:
        trace.note("dropped", f"{repeated} row(s) repeating a worker's step with the same time "
                              "were read once")
    if column.endswith("_norm"):
        trace.note("other", f"{column!r} holds normalised (unitless) times: they are shown as "
                            "milliseconds; every ratio, S and speedup is unaffected")
    trace.note("other", f"step times only ({column!r}): each worker's step is one compute op, "
                        "then a gradient all-reduce that ends when the step's slowest worker "
                        "arrives (synchronous data parallelism assumed); the next step starts "
                        "there. Host stalls, links and pipelines cannot be told apart from "
                        "compute in such a table")
    return trace
