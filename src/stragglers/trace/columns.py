"""Turn Arrow tables into validated op-table columns, with errors that name file and field."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stragglers.errors import InputError
from stragglers.trace.model import COLUMNS, OPTIONAL_COLUMNS, OPTIONAL_FILL, OPTYPES

_INTEGER_COLUMNS = [c for c, d in COLUMNS.items() if d.kind == "i" and c != "optype"]
# The op type names as Arrow strings, built once: pa.array() of a Python list without a type
# looks for pandas on every call (~130 µs; a failed import without it), which was a fifth of
# the time of checking an uploaded part.
OPTYPE_NAMES = pa.array(OPTYPES, type=pa.string())


def optype_codes(column: pa.ChunkedArray | pa.Array, source: Path | str) -> np.ndarray:
    """Map an optype column (string or dictionary) to codes; unknown names are an error."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    if (len(chunks) > 1 and pa.types.is_dictionary(chunks[0].type)
            and all(c.type == chunks[0].type for c in chunks)):
        # a table of many row groups or files: one dictionary for all its chunks, so the names
        # are mapped and checked once, not once per chunk
        nulls = sum(c.null_count for c in chunks)
        if nulls:
            raise InputError(source, "optype", f"{nulls} rows have no op type")
        chunks = pa.chunked_array(chunks, chunks[0].type).unify_dictionaries().chunks
        indices = np.concatenate([c.indices.to_numpy(zero_copy_only=False) for c in chunks])
        return _dictionary_codes(chunks[0].dictionary, indices, source)
    out = []
    for chunk in chunks:
        if pa.types.is_dictionary(chunk.type):
            # Map the (small) dictionary once, then gather by index: no per-row string work.
            names = chunk.dictionary
            lookup = _codes_of_strings(names, source) if len(names) else np.zeros(0, np.int8)
            if chunk.null_count:
                raise InputError(source, "optype", f"{chunk.null_count} rows have no op type")
            out.append(_dictionary_codes(names, chunk.indices.to_numpy(zero_copy_only=False),
                                         source, lookup))
        else:
            codes = _codes_of_strings(chunk, source)
            if (codes < 0).any():
                unknown = sorted({str(v) for v in np.asarray(chunk.to_pylist(), dtype=object)[codes < 0]})[:5]
                raise InputError(source, "optype", f"unknown op types {unknown}; expected one of "
                                 f"{', '.join(OPTYPES)}")
            out.append(codes.astype(np.int8))
    return np.concatenate(out) if out else np.zeros(0, np.int8)


def _dictionary_codes(names: pa.Array, indices: np.ndarray, source: Path | str,
                      lookup: np.ndarray | None = None) -> np.ndarray:
    """Codes of dictionary indices into `names` (`lookup`: the names' codes, where known);
    a used name that is no op type is an error."""
    if lookup is None:
        lookup = _codes_of_strings(names, source) if len(names) else np.zeros(0, np.int8)
    if not len(indices):
        return np.zeros(0, np.int8)
    # Parquet's reader checks neither: an index past the dictionary (one damaged byte) failed
    # as 'internal error: IndexError', a negative one inside bincount
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0 or hi >= len(names):
        raise InputError(source, "optype", f"a dictionary index {lo if lo < 0 else hi} outside "
                         f"its {len(names)} names; expected a readable Parquet file (damaged?)")
    # which names are used: a count per name (O(rows), no sort of the indices)
    used = np.flatnonzero(np.bincount(indices, minlength=len(names)))
    bad = used[lookup[used] < 0]
    if len(bad):
        unknown = sorted(_shown(names[int(i)]) for i in bad[:5])
        raise InputError(source, "optype", f"unknown op types {unknown}; expected one of "
                         f"{', '.join(OPTYPES)}")
    return lookup[indices].astype(np.int8)


def _shown(name: pa.Scalar) -> str:
    """A dictionary name as text (bytes that are not UTF-8 shown escaped: Parquet's reader
    does not check them, and str() of one failed as 'internal error: UnicodeDecodeError')."""
    try:
        return str(name)
    except UnicodeDecodeError:
        raw = name.cast(pa.binary()).as_py()
        return raw.decode("utf-8", "backslashreplace")


def _codes_of_strings(values: pa.Array, source: Path | str) -> np.ndarray:
    """Codes of a string array (-1 for unknown names)."""
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        raise InputError(source, "optype", f"expected strings (op type names), got {values.type}")
    if values.null_count:
        raise InputError(source, "optype", f"{values.null_count} rows have no op type")
    codes = pc.index_in(values, value_set=OPTYPE_NAMES)
    return pc.fill_null(codes, -1).to_numpy(zero_copy_only=False).astype(np.int64)


# Seconds on any real clock (the epoch is ~1.8e9 s in 2026, monotonic clocks are smaller) lie
# far inside this bound; beyond it lie other units (ms, µs, ns read as seconds) or garbage whose
# squares and sums overflow the analysis.
MAX_SECONDS = 1e11


def beyond_clock(count: str, value: float) -> str:
    """The problem text for times beyond ±MAX_SECONDS (readers and the monitor say the same)."""
    return (f"{count} beyond ±{MAX_SECONDS:g} s ({value:g}); expected seconds (convert "
            "milliseconds, microseconds or nanoseconds first)")


# A 32-bit float keeps 24 significant bits: start times at epoch seconds (~1.8e9) are 128 s apart,
# but clocks that restart near 0 (NDTimeline's real traces time each sampled step from its own
# start, in float32) are exact enough: below FLOAT32_CLOCK_REACH_S its numbers are at most
# 6.1e-5 s apart, a sixteenth of the 1 ms within which one collective's ends agree across
# ranks (trace/kineto/align.END_TOLERANCE_S), so no wait the analysis reads moves by more.
# Past 2^24 (float32) or 2^11 (float16) whole numbers round to other whole numbers, which the
# check for whole numbers cannot tell. Durations and CPU seconds need only their relative
# precision (float32's ~6e-8), and stay accepted.
FLOAT32_CLOCK_REACH_S = 1024.0

# Columns in seconds: stored as integers they are whole seconds (nanoseconds lie past
# ±MAX_SECONDS), 1 s apart at any magnitude, 16,000 times float32's spacing near 0: one rank's
# start times so made a healthy job read S 1.22 and fire `straggling`, its durations so (every
# op 0 s) a critical `worker_fault` at an honest rank.
SECONDS_COLUMNS = ("start_ts", "duration", "cpu_wait", "cpu_time", "step_cpu")


def too_narrow(name: str, dtype: np.dtype, t: pa.DataType, reach: float | None = None
               ) -> str | None:
    """The problem when a column of contract dtype `dtype` stored as Arrow type `t` cannot hold
    its values as exactly as the analysis needs (`reach`: the start times' largest magnitude,
    None when not known yet); None when it can."""
    if name in SECONDS_COLUMNS and (pa.types.is_integer(t) or pa.types.is_boolean(t)):
        return (f"expected float64 seconds, got {t}: integers are whole seconds, 1 s apart "
                "(convert milliseconds, microseconds or nanoseconds to float seconds)")
    if not (pa.types.is_float32(t) or pa.types.is_float16(t)):
        return None
    if name == "start_ts":
        if pa.types.is_float32(t) and reach is not None and reach < FLOAT32_CLOCK_REACH_S:
            return None
        gap = float(np.spacing(np.float32(reach))) if reach is not None and \
            pa.types.is_float32(t) else None
        at = f"; values reach {reach:.6g} s, where its numbers are {gap:g} s apart" \
            if gap is not None else ""
        return (f"expected float64 seconds, got {t}{at} (32-bit floats are read only for "
                f"clocks within ±{FLOAT32_CLOCK_REACH_S:g} s, e.g. steps each timed from their "
                "own start)")
    if dtype.kind == "i":
        whole = "2^24 = 16,777,216" if pa.types.is_float32(t) else "2^11 = 2,048"
        return (f"expected integers (or float64 whole numbers), got {t} (it holds whole "
                f"numbers exactly only up to {whole})")
    return None


def table_to_columns(table: pa.Table, source: Path | str) -> dict[str, np.ndarray]:
    """Validate an Arrow op table and return numpy columns of the canonical dtypes."""
    missing = [c for c in COLUMNS if c not in table.column_names]
    if missing:
        raise InputError(source, missing[0], f"missing column (required: {', '.join(COLUMNS)}; "
                         f"found: {', '.join(table.column_names) or 'none'})")
    ops: dict[str, np.ndarray] = {}
    for name, dtype in COLUMNS.items():
        col = table.column(name)
        if name == "optype":
            ops[name] = optype_codes(col, source)
            continue
        ops[name] = _numeric(col, name, dtype, source)
    for name, dtype in OPTIONAL_COLUMNS.items():
        if name in table.column_names:
            ops[name] = _numeric(table.column(name), name, dtype, source, OPTIONAL_FILL[name])
    check_values(ops, source)
    return ops


def _numeric(col: pa.ChunkedArray, name: str, dtype: np.dtype, source, fill=None) -> np.ndarray:
    """One numeric column as numpy, refusing strings, nulls (unless a fill is given)."""
    if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)
            or pa.types.is_boolean(col.type)):
        raise InputError(source, name, f"expected a number column, got {col.type}")
    if name in SECONDS_COLUMNS and not pa.types.is_floating(col.type):   # (before a null fill
        raise InputError(source, name, too_narrow(name, dtype, col.type) or "")  # casts it)
    if col.null_count:
        if fill is None:
            raise InputError(source, name, f"{col.null_count} null values; expected numbers")
        if isinstance(fill, float) and not pa.types.is_floating(col.type):
            col = col.cast(pa.float64())   # (a NaN fill of integers with nulls: pandas' Int64)
        col = pc.fill_null(col, fill)
    arr = col.to_numpy()
    if arr.dtype.kind == "f" and arr.dtype.itemsize < 8:
        finite = arr[np.isfinite(arr)]
        narrow = too_narrow(name, dtype, col.type,
                            float(np.abs(finite).max()) if len(finite) else 0.0)
        if narrow is not None:
            raise InputError(source, name, narrow)
        arr = arr.astype(np.float64)   # (int64's bounds compared in float16 overflow: a warning)
    if dtype.kind == "i" and arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise InputError(source, name, "expected whole numbers")
    if dtype.kind == "i" and len(arr) and not np.can_cast(arr.dtype, dtype, "safe"):
        lo, hi = np.iinfo(dtype).min, np.iinfo(dtype).max
        if arr.min() < lo or arr.max() > hi:  # a silent wrap-around would corrupt ids
            raise InputError(source, name, f"values must lie in [{lo}, {hi}]")
    return arr.astype(dtype, copy=False)


def step_values(col: pa.ChunkedArray | pa.Array, source: Path | str) -> np.ndarray:
    """A step column as int64, checked as table_to_columns checks it (numbers, no nulls,
    whole): for readers of the step column alone (a run's step layout)."""
    return _numeric(pa.chunked_array([col]) if isinstance(col, pa.Array) else col, "step",
                    np.dtype(np.int64), source)


def whole_step(value: object, source: Path | str) -> int:
    """A step bound from a file's statistics as an int; InputError naming `step` unless a
    whole number within int64 (a float column's NaN or infinity, a string column's text)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return int(value)
    if isinstance(value, (float, np.floating)):
        number = float(value)
        if math.isfinite(number) and number.is_integer() and abs(number) < 2.0 ** 63:
            return int(number)
    raise InputError(source, "step", f"expected whole numbers, got {str(value)[:40]!r}")


def check_values(ops: dict[str, np.ndarray], source: Path | str) -> None:
    """Reject NaN/inf/negative times, unresolvable timestamps and negative ids."""
    check_finite_times(ops, source)
    check_time_resolution(ops, source)
    neg = ops["duration"] < 0
    if neg.any():
        first = float(ops["duration"][neg][0])
        raise InputError(source, "duration", f"{int(neg.sum())} negative durations (first at row "
                         f"{int(np.argmax(neg))}: {first:g} s); expected >= 0 s")
    for name in ("rank", "dp_rank", "stage", "step"):
        neg = ops[name] < 0
        if neg.any():
            raise InputError(source, name, f"negative value at row {int(np.argmax(neg))}; "
                             "expected >= 0")
    for name in ("cpu_wait", "cpu_time", "step_cpu"):
        # seconds measured by the recorder, NaN where unknown: an infinite, negative or
        # absurd one would silently move a prediction (a CPU floor of 1e6 s a step)
        values = ops.get(name)
        if values is None:
            continue
        bad = ~np.isnan(values) & ~((values >= 0) & (values <= MAX_SECONDS))
        if bad.any():
            first = int(np.argmax(bad))
            raise InputError(source, name, f"{int(bad.sum())} rows are negative, infinite or "
                             f"beyond {MAX_SECONDS:g} s (first at row {first}: "
                             f"{float(values[first]):g}); expected seconds >= 0, or empty")


    costs = ops.get("attn_cost")
    if costs is not None:
        # Σ s² of a microbatch's sequences (a count of token pairs), NaN where unknown: a
        # negative or absurd one overflowed the balancing's division (a warning line)
        bad = ~np.isnan(costs) & ~((costs >= 0) & (costs <= MAX_ATTN_COST))
        if bad.any():
            first = int(np.argmax(bad))
            raise InputError(source, "attn_cost", f"{int(bad.sum())} rows are negative, "
                             f"infinite or beyond {MAX_ATTN_COST:g} (first at row {first}: "
                             f"{float(costs[first]):g}); expected Σ s² of the microbatch's "
                             "sequence lengths, or empty")


# Σ s² of one microbatch at most: 10^6 sequences of 10^12 tokens
MAX_ATTN_COST = 1e30


def check_finite_times(ops: dict[str, np.ndarray], source: Path | str) -> None:
    """Reject NaN, infinite or implausibly large start_ts / duration."""
    for name in ("start_ts", "duration"):
        values = ops[name]
        bad = ~(np.abs(values) <= MAX_SECONDS)  # one pass: NaN compares false too
        if not bad.any():
            continue
        nonfinite = ~np.isfinite(values)
        if nonfinite.any():
            raise InputError(source, name, f"{int(nonfinite.sum())} rows are NaN or infinite "
                             f"(first at row {int(np.argmax(nonfinite))}); expected finite "
                             "seconds")
        first = int(np.argmax(bad))
        raise InputError(source, name, beyond_clock(f"{int(bad.sum())} rows lie (first at row "
                                                    f"{first})", float(values[first])))


def check_time_resolution(ops: dict[str, np.ndarray], source: Path | str) -> None:
    """Reject timestamps so large that float64 cannot tell the ops' typical durations apart."""
    start, duration = ops["start_ts"], ops["duration"]
    # a strided sample of ≤ 65,536 rows tells the typical duration (a full median of 10M
    # rows cost 6x the rest of the checks)
    sample = duration[::max(1, len(duration) // 65536)]
    positive = sample[sample > 0]
    if not len(positive):
        positive = duration[duration > 0]
    if not len(start) or not len(positive):
        return  # nothing to resolve (an all-zero trace is refused where durations are used)
    # Why: start + duration is rounded to a multiple of float64's spacing at that size; once
    # the spacing reaches a typical op's length every end time, gap and replay is noise.
    reach = max(float(start.max()), -float(start.min())) + float(duration.max())
    spacing = float(np.spacing(reach))
    typical = float(np.median(positive))
    if spacing >= typical:
        raise InputError(source, "start_ts", f"timestamps reach {reach:.3g} s, where float64 "
                         f"steps by {spacing:.3g} s, no finer than the ops' median duration "
                         f"({typical:.3g} s); expected seconds on one clock (epoch or monotonic)")


def columns_to_table(ops: dict[str, np.ndarray]) -> pa.Table:
    """Numpy op columns to an Arrow table with optype as a dictionary of names."""
    arrays, names = [], []
    for name in list(COLUMNS) + [c for c in OPTIONAL_COLUMNS if c in ops]:
        if name == "optype":
            arr = pa.DictionaryArray.from_arrays(pa.array(ops[name], pa.int8()), OPTYPE_NAMES)
        else:
            arr = pa.array(ops[name])
        arrays.append(arr)
        names.append(name)
    return pa.table(arrays, names=names)
