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

import codecs
import csv
import itertools
import re
from array import array
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
            dialect = _dialect(fh.read(SNIFF_BYTES))
            fh.seek(0)
            return _read(_rows(csv.reader(fh, dialect), path), path, name)
    except UnicodeDecodeError:   # (past the bytes looks_like_step_times read)
        raise _not_utf8(path, _bad_byte(path)) from None


# The first bytes of a table from which its separator is sniffed.
SNIFF_BYTES = 1 << 16


def _rows(reader, path: Path):
    """The table's rows, read one at a time (the file is never held whole: a row's cells are
    kept only as the numbers they hold)."""
    try:
        yield from reader
    except csv.Error as exc:   # a cell over csv's field limit, a NUL byte
        if (bad := _bad_byte(path)) >= 0:   # text that is not UTF-8 further on is said first
            raise _not_utf8(path, bad) from None
        raise InputError(path, None, f"line {reader.line_num}: {exc}; expected a step-time "
                         "table (CSV)") from None


def _not_utf8(path: Path, offset: int) -> InputError:
    """The refusal of a file whose byte at `offset` is not UTF-8."""
    return InputError(path, None, f"not UTF-8 text (byte {offset:,}); expected a step-time "
                      "table (CSV)")


def _bad_byte(path: Path) -> int:
    """The offset (after a byte-order mark) of the file's first byte that is not UTF-8, or -1:
    its bytes decoded again, a chunk at a time."""
    decoder, fed = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as fh:
        if fh.read(3) != codecs.BOM_UTF8:
            fh.seek(0)
        while True:
            chunk = fh.read(1 << 20)
            held = len(decoder.getstate()[0])   # (the bytes of a character split by the chunk)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as exc:
                return fed - held + exc.start
            if not chunk:
                return -1
            fed += len(chunk)


def _read(rows, path: Path, name: str | None) -> Trace:
    """The table's header, then its rows as a long or a wide table."""
    head, first = next(rows, None), next(rows, None)
    if head is None or first is None:
        raise InputError(path, None, "no rows; expected a header and one row per worker and step")
    header = [h.strip().lower() for h in head]
    rows = itertools.chain([first], rows)
    try:
        wi, si, ti = _columns(header, path)
    except InputError:
        wide = _wide_columns(header)
        if wide is None:
            raise
        return _read_wide(rows, head, header, wide, path, name)
    worker, names, step, seconds = _read_long(rows, (wi, si, ti), header, path)
    seconds = seconds * _unit(header[ti])
    return _trace(worker, step, seconds, name or path.stem, str(path), header[ti],
                  names=names, by_name=names is not None)


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


class _Cells:
    """Two columns of numbers read row by row into flat arrays (8 bytes a number), and the first
    cell that is not a number (reported once the whole worker column has been read)."""

    def __init__(self, path: Path):
        self.path = path
        self.bad: InputError | None = None
        self.first, self.second = array("d"), array("d")

    def numbers(self, r: int, cells: tuple[tuple[str | None, str], ...]) -> list[float]:
        """The (cell, column) pairs of file row r as numbers, NaN for a cell that is not one
        (None: the row lacks it), the first such cell kept to report."""
        out = []
        for cell, column in cells:
            try:
                if cell is None:   # (the row lacks it)
                    raise TypeError
                out.append(float(cell))
            except (TypeError, ValueError):
                out.append(np.nan)
                if self.bad is None:
                    shown = "nothing" if cell is None else cell
                    self.bad = InputError(self.path, column, f"row {r}: {shown[:40]!r}; "
                                          "expected a number")
        return out

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """The two columns, or the first cell that is not a number raised."""
        if self.bad is not None:
            raise self.bad
        first, second = (np.frombuffer(out, dtype=np.float64) if len(out) else np.empty(0)
                         for out in (self.first, self.second))
        return first, second


def _read_wide(rows, head: list[str], header: list[str], wide: tuple[int, list[int]],
               path: Path, name: str | None) -> Trace:
    """A wide table (one time column per worker) read as the long one: an empty cell is a
    step that worker has no time for."""
    si, cols = wide
    worker, cells = array("i"), _Cells(path)   # (worker, step, seconds) per timed cell
    steps, times = cells.first.append, cells.second.append
    for r, row in enumerate(rows, start=2):
        step = row[si] if si < len(row) else ""
        for k, c in enumerate(cols):
            cell = row[c].strip() if c < len(row) else ""
            if cell:
                worker.append(k)
                try:
                    s, t = float(step), float(cell)
                except ValueError:
                    s, t = cells.numbers(r, ((step, header[si]), (cell, "seconds")))
                steps(s)
                times(t)
    step, sec = cells.arrays()
    if not len(worker):
        raise InputError(path, None, f"no times: every cell of its {len(cols)} worker columns "
                         "is empty; expected each worker's time per step (seconds)")
    ids = np.frombuffer(worker, dtype=np.int32).astype(np.int64)
    _check(ids, step, sec, ("worker", header[si], "seconds"), path)
    trace = _trace(ids, step.astype(np.int64), sec, name or path.stem, str(path), "seconds",
                   names=[head[c].strip() for c in cols])
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


def _read_long(rows, cols: tuple[int, int, int], header: list[str], path: Path):
    """(worker, names, step, seconds): workers as numbers, or, where no cell is one, as codes
    into `names` (in the order first seen); a cell that is not a number names its row and
    column, a worker column mixing ids and names the first row of the kind few rows have."""
    wi, si, ti = cols
    ids, cells = array("d"), _Cells(path)
    names: dict[str, int] = {}
    steps, times = cells.first.append, cells.second.append
    first: dict[bool, tuple[int, str]] = {}   # the first row giving a number, and a name
    numbers, bad_name = 0, None
    for r, row in enumerate(rows, start=2):
        cell = row[wi] if wi < len(row) else ""
        try:
            ids.append(float(cell))
            numbers += 1
            first.setdefault(True, (r, cell))
        except ValueError:
            first.setdefault(False, (r, cell))
            key = cell.strip()
            if not key or len(key) > MAX_NAME:
                bad_name = bad_name or (r, key)
                key = ""
            ids.append(names.setdefault(key, len(names)))
        try:
            s, t = float(row[si]), float(row[ti])
        except (IndexError, ValueError):
            s, t = cells.numbers(r, ((row[si] if si < len(row) else None, header[si]),
                                     (row[ti] if ti < len(row) else None, header[ti])))
        steps(s)
        times(t)
    if 0 < numbers < len(ids):
        minority = numbers <= len(ids) / 2
        r, cell = first[minority]
        raise InputError(path, header[wi], f"row {r}: {cell[:40]!r}; expected every worker "
                         f"given {'by name' if minority else 'as a number'}, as most rows "
                         "give it")
    if not numbers and bad_name:
        raise InputError(path, header[wi], f"row {bad_name[0]}: {bad_name[1][:40]!r}; expected "
                         f"a worker id or a name of 1-{MAX_NAME} characters")
    step, seconds = cells.arrays()
    worker = np.frombuffer(ids, dtype=np.float64)
    _check(worker if numbers else None, step, seconds, (header[wi], header[si], header[ti]), path)
    return (worker.astype(np.int64), None if numbers else list(names), step.astype(np.int64),
            seconds)


def _check(worker: np.ndarray | None, step: np.ndarray, seconds: np.ndarray,
           columns: tuple[str, str, str], path: Path) -> None:
    """Worker ids (None where workers are named) and steps whole numbers ≥ 0, times finite."""
    checked = ((step, columns[1]),) if worker is None else ((worker, columns[0]),
                                                             (step, columns[1]))
    for values, col in checked:
        if not np.all(np.isfinite(values)) or np.any(values != np.round(values)) \
                or np.any(values < 0) or np.any(values > 2**31):
            raise InputError(path, col, "expected whole numbers ≥ 0")
    if not np.all(np.isfinite(seconds)) or np.any(seconds < 0) or np.any(seconds > 1e7):
        raise InputError(path, columns[2], "expected finite times ≥ 0")


# A worker's name (a host, host:port, a pod) at most this long.
MAX_NAME = 256


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
    # one key per (worker, step), both whole numbers in [0, 2**31]: sorted as the pairs are
    keys = (worker.astype(np.uint64) << np.uint64(32)) | step.astype(np.uint64)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    if len(first) == len(worker):
        return worker, step, seconds, 0
    low, high = np.full(len(first), np.inf), np.full(len(first), -np.inf)
    np.minimum.at(low, inverse, seconds)
    np.maximum.at(high, inverse, seconds)
    for k in np.flatnonzero(high > low)[:1]:
        same = inverse == k
        raise InputError(source, "step", f"worker {worker[first[k]]} has {int(same.sum())} "
                         f"rows for step {step[first[k]]} with different times "
                         f"({', '.join(f'{x:g}' for x in seconds[same][:4])}); expected one")
    keep = np.sort(first)
    return worker[keep], step[keep], seconds[keep], len(worker) - len(keep)


def _trace(worker, step, seconds, name: str, source: str, column: str,
           names: list[str] | None = None, by_name: bool = False) -> Trace:
    """Lay the steps end to end: compute from the step's start, the all-reduce to its end
    (`worker`: ids 0, 1, … of `names` where given: a wide table's headers, or, `by_name`,
    the workers' own names, which become ranks in natural name order and the workers'
    hosts)."""
    if by_name:
        assert names is not None   # (by_name: the workers' own names)
        order = sorted(names, key=_natural)
        rank = {n: i for i, n in enumerate(order)}
        worker = np.array([rank[n] for n in names], dtype=np.int64)[worker]
        names = order
    worker, step, seconds, repeated = _unique_rows(worker, step, seconds, source)
    workers, w_idx = np.unique(worker, return_inverse=True)
    steps, s_idx = np.unique(step, return_inverse=True)
    # synchronous DP: a step ends when its slowest worker's compute does (per step, not a
    # workers x steps matrix: a table of one worker per step would square its size)
    span = np.full(len(steps), -np.inf)
    np.maximum.at(span, s_idx, seconds)
    start = np.concatenate([[0.0], np.cumsum(np.maximum(span, 0.0))[:-1]])
    comp = OPTYPE_CODES["forward-compute"]
    ar = OPTYPE_CODES["grads-all-reduce"]
    n = len(worker)
    from stragglers.trace.model import COLUMNS

    # each column made in its own type as it is built (not all as float64 first)
    ops = {k: np.zeros(2 * n, dtype=t) for k, t in COLUMNS.items()
           if k in ("stage", "seq_id", "mc", "gmc")}
    ops["rank"] = np.tile(w_idx.astype(COLUMNS["rank"]), 2)
    ops["dp_rank"] = ops["rank"].copy()
    ops["step"] = np.tile(steps[s_idx].astype(COLUMNS["step"]), 2)
    ops["optype"] = np.repeat(np.array([comp, ar], dtype=COLUMNS["optype"]), n)
    ops["start_ts"] = np.concatenate([start[s_idx], start[s_idx] + seconds])
    ops["duration"] = np.concatenate([seconds, span[s_idx] - seconds])
    ops["mb_id"] = np.repeat(np.array([0, -1], dtype=COLUMNS["mb_id"]), n)
    ops = {k: ops[k] for k in COLUMNS}
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
