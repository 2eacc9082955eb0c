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
Workers may be named (`node-3:29500`, a pod): they become ranks in natural name order, each
name kept as the worker's host. A wide table (a step column, then one time column per worker,
named by it: `rank0`, `gpu_1`) is read the same way. Commas, semicolons, tabs or bars separate
the cells (sniffed from the first lines).
"""

from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.model import OPTYPE_CODES, JobMeta, Trace

WORKER_NAMES = ("rank", "worker", "dp_rank", "worker_id")
STEP_NAMES = ("step", "iteration", "iter", "time", "batch")
TIME_NAMES = ("step_time", "batch_time", "step_time_s", "step_time_ms", "batch_time_ms",
              "batch_time_norm", "duration", "duration_s", "duration_ms", "seconds", "elapsed")
MAX_BYTES = 1 << 30
# Columns of when a step ended (a log line's stamp), not how long a worker took.
STAMP_NAMES = ("timestamp", "ts", "end_time", "datetime", "date", "wall_time", "time_stamp")


def looks_like_step_times(path: Path) -> bool:
    """A .csv file whose header names a worker, a step and a time column (or a step column and
    a time column per worker)."""
    if not (path.is_file() and path.suffix == ".csv"):
        return False
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            head = fh.read(SNIFF_BYTES)
        header = next(csv.reader(head.splitlines(), _dialect(head)), [])
    except (OSError, UnicodeDecodeError, csv.Error):
        return False
    names = [h.strip().lower() for h in header]
    try:
        _columns(names, path)
    except InputError:
        # a worker and a step column without a time one: read, to say what is missing
        return _wide_columns(names) is not None or (
            any(n in names for n in WORKER_NAMES) and any(n in names for n in STEP_NAMES))
    return True


def read_step_times(path: Path | str, name: str | None = None) -> Trace:
    """Read a step-time table into a trace of one compute op and one all-reduce per worker-step."""
    path = Path(path)
    if path.stat().st_size > MAX_BYTES:
        raise InputError(path, None, f"{path.stat().st_size:,} bytes; expected a step-time "
                         f"table under {MAX_BYTES:,} bytes")
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            text = fh.read()
    except UnicodeDecodeError as exc:   # (past the bytes looks_like_step_times read)
        raise InputError(path, None, f"not UTF-8 text (byte {exc.start:,}); expected a "
                         "step-time table (CSV)") from None
    reader = csv.reader(text.splitlines(), _dialect(text[:SNIFF_BYTES]))
    try:
        rows = list(reader)
    except csv.Error as exc:   # a cell over csv's field limit, a NUL byte
        raise InputError(path, None, f"line {reader.line_num}: {exc}; expected a step-time "
                         "table (CSV)") from None
    if len(rows) < 2:
        raise InputError(path, None, "no rows; expected a header and one row per worker and step")
    header = [h.strip().lower() for h in rows[0]]
    try:
        wi, si, ti = _columns(header, path)
    except InputError:
        wide = _wide_columns(header)
        if wide is None:
            raise
        return _read_wide(rows, header, wide, path, name)
    worker, step, seconds = _values(rows[1:], (wi, si, ti), header, path)
    seconds = seconds * _unit(header[ti])
    return _trace(worker, step, seconds, name or path.stem, str(path), header[ti])


# The first bytes of a table from which its separator is sniffed.
SNIFF_BYTES = 1 << 16


def _dialect(head: str) -> type[csv.Dialect]:
    """The table's separator (comma, semicolon, tab or bar), sniffed from its first lines; a
    comma where the sniffer cannot tell (one column)."""
    try:
        return csv.Sniffer().sniff(head, delimiters=",;\t|")
    except csv.Error:
        return csv.excel


def _wide_columns(header: list[str]) -> tuple[int, list[int]] | None:
    """(step column, the worker columns) of a wide table: a step column and at least two
    others, every one named, none of them a worker or time column's name."""
    steps = [i for i, h in enumerate(header) if h in STEP_NAMES]
    if not steps:
        return None
    others = [i for i, h in enumerate(header) if i != steps[0]]
    if len(others) < 2 or any(not header[i] or header[i] in WORKER_NAMES + TIME_NAMES
                              for i in others):
        return None
    return steps[0], others


def _read_wide(rows: list[list[str]], header: list[str], wide: tuple[int, list[int]],
               path: Path, name: str | None) -> Trace:
    """A wide table (one time column per worker) read as the long one: an empty cell is a
    step that worker has no time for."""
    si, cols = wide
    table, row_of = [], []      # (worker, step, seconds) per cell, and its file row
    for r, row in enumerate(rows[1:]):
        for k, c in enumerate(cols):
            cell = row[c].strip() if c < len(row) else ""
            if cell:
                table.append([str(k), row[si] if si < len(row) else "", cell])
                row_of.append(r + 2)
    w, st, sec = _values(table, (0, 1, 2), ["worker", header[si], "seconds"], path, row_of)
    trace = _trace(w, st, sec, name or path.stem, str(path), "seconds",
                   names=[rows[0][c].strip() for c in cols])
    trace.note("layout", f"a wide table: each of its {len(cols)} time columns is one worker "
                         "(seconds; its header names the worker)")
    return trace


def _columns(header: list[str], path: Path) -> tuple[int, int, int]:
    """Indexes of the worker, step and time columns."""
    def find(names: tuple[str, ...], what: str, taken: set[int]) -> int:
        for n in names:
            if n in header and header.index(n) not in taken:
                return header.index(n)
        raise InputError(path, what, f"no {what} column; expected one of {', '.join(names)} "
                         f"(the header has {', '.join(h for h in header if h) or 'nothing'})")
    stamps = [h for h in header if h in STAMP_NAMES]
    if stamps and not any(n in header for n in TIME_NAMES):
        raise InputError(path, stamps[0], "looks like when each step ended: in synchronous "
                         "training every worker ends a step together (at the gradient "
                         "all-reduce), so those cannot tell a straggler; expected each worker's "
                         f"own time per step ({', '.join(TIME_NAMES[:4])}, ...)")
    ti = find(TIME_NAMES, "time", set())
    wi = find(WORKER_NAMES, "worker", {ti})
    return wi, find(STEP_NAMES, "step", {ti, wi}), ti


def _values(rows: list[list[str]], cols: tuple[int, int, int], header: list[str], path: Path,
            row_of: list[int] | None = None):
    """The three columns (the worker column as numbers, or as names where any cell is not
    one); a bad cell names its row and column."""
    ids, names = _workers([row[cols[0]] if cols[0] < len(row) else "" for row in rows],
                          header[cols[0]], path, row_of)
    out = [ids if ids is not None else np.empty(0), np.empty(len(rows)), np.empty(len(rows))]
    for r, row in enumerate(rows):
        for k, c in ((1, cols[1]), (2, cols[2])):
            try:
                out[k][r] = float(row[c])
            except (IndexError, ValueError):
                cell = row[c] if c < len(row) else "nothing"
                raise InputError(path, header[c], f"row {_row(r, row_of)}: {cell[:40]!r}; "
                                 "expected a number") from None
    worker, step, seconds = out
    checked = ((step, cols[1]),) if names is not None else ((worker, cols[0]), (step, cols[1]))
    for values, col in checked:
        if not np.all(np.isfinite(values)) or np.any(values != np.round(values)) \
                or np.any(values < 0) or np.any(values > 2**31):
            raise InputError(path, header[col], "expected whole numbers ≥ 0")
    if not np.all(np.isfinite(seconds)) or np.any(seconds < 0) or np.any(seconds > 1e7):
        raise InputError(path, header[cols[2]], "expected finite times ≥ 0")
    if names is not None:
        return np.array(names, dtype=object), step.astype(np.int64), seconds
    return worker.astype(np.int64), step.astype(np.int64), seconds


def _workers(cells: list[str], column: str, path: Path, row_of: list[int] | None
             ) -> tuple[np.ndarray | None, list[str] | None]:
    """(ids, None) where every cell is a number, else (None, names); a cell that is empty,
    too long, or of the kind few rows have (ids mixed with names: a garbled cell) refused."""
    try:
        return np.asarray(cells, dtype=np.float64), None
    except ValueError:
        pass
    kinds = [_is_number(cell) for cell in cells]
    if any(kinds):
        minority = sum(kinds) <= len(kinds) / 2
        r = kinds.index(minority)
        raise InputError(path, column, f"row {_row(r, row_of)}: {cells[r][:40]!r}; expected "
                         f"every worker given {'by name' if minority else 'as a number'}, as "
                         "most rows give it")
    names = [cell.strip() for cell in cells]
    for r, cell in enumerate(names):
        if not cell or len(cell) > MAX_NAME:
            raise InputError(path, column, f"row {_row(r, row_of)}: {cell[:40]!r}; expected a "
                             f"worker id or a name of 1-{MAX_NAME} characters")
    return None, names


# A worker's name (a host, host:port, a pod) at most this long.
MAX_NAME = 256


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _row(r: int, row_of: list[int] | None) -> int:
    """The file row of table row r (the header is row 1)."""
    return row_of[r] if row_of is not None else r + 2


def _natural(name: str) -> list:
    """Sort key that orders node-2 before node-10."""
    # (every odd piece is a run of decimal digits; isdigit() also takes '²', which int() refuses)
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", name))]


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


def _trace(worker, step, seconds, name: str, source: str, column: str,
           names: list[str] | None = None) -> Trace:
    """Lay the steps end to end: compute from the step's start, the all-reduce to its end
    (`worker`: ids, or names, which become ranks in natural name order and the workers'
    hosts; `names`: the names of ids 0, 1, … where a wide table's header gave them)."""
    by_name = worker.dtype == object
    if by_name:
        order = sorted(set(worker.tolist()), key=_natural)
        names = order
        rank = {n: i for i, n in enumerate(order)}
        worker = np.array([rank[n] for n in worker.tolist()], dtype=np.int64)
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
    extra: dict = {"source_format": "step_times", "workers": [int(x) for x in workers]}
    if names is not None:
        named = [names[int(x)] for x in workers]
        extra.update(workers=named)
        if by_name:  # a host, host:port or pod: shown beside the rank (a wide table's
            # headers, `rank3`, would only repeat it)
            extra.update(layout=[{"rank": i, "dp_rank": i, "stage": 0, "host": n}
                                 for i, n in enumerate(named)])
    meta = JobMeta(name=name, dp_size=len(workers), pp_size=1, extra=extra)
    trace = Trace(ops, meta, source)
    if names is None:
        trace.note("layout", f"{len(workers)} workers read as the data-parallel ranks 0–"
                             f"{len(workers) - 1} of one stage (worker ids {int(workers[0])}–"
                             f"{int(workers[-1])} in file order)")
    else:
        shown = ", ".join(f"{i} {n}" for i, n in enumerate(extra["workers"][:4]))
        order_words = "in natural name order" if by_name else "in column order"
        trace.note("layout", f"{len(workers)} named workers read as the data-parallel ranks 0–"
                             f"{len(workers) - 1} of one stage, {order_words} ({shown}"
                             f"{', …' if len(workers) > 4 else ''})"
                             + ("; each name is shown as the worker's host" if by_name else ""))
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
