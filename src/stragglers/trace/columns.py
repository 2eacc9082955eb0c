"""Turn Arrow tables into validated op-table columns, with errors that name file and field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stragglers.errors import InputError
from stragglers.trace.model import COLUMNS, OPTIONAL_COLUMNS, OPTIONAL_FILL, OPTYPE_CODES, OPTYPES

_INTEGER_COLUMNS = [c for c, d in COLUMNS.items() if d.kind == "i" and c != "optype"]


def optype_codes(column: pa.ChunkedArray | pa.Array, source: Path | str) -> np.ndarray:
    """Map an optype column (string or dictionary) to codes; unknown names are an error."""
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type) if isinstance(column, pa.Array) \
            else pc.cast(column, column.type.value_type)
    if not (pa.types.is_string(column.type) or pa.types.is_large_string(column.type)):
        raise InputError(source, "optype", f"expected strings (op type names), got {column.type}")
    if column.null_count:
        raise InputError(source, "optype", f"{column.null_count} rows have no op type")
    names = pa.array(OPTYPES)
    codes = pc.index_in(column, value_set=names)
    if codes.null_count:
        unknown = sorted(set(pc.filter(column, pc.is_null(codes)).to_pylist()))[:5]
        raise InputError(source, "optype", f"unknown op types {unknown}; expected one of "
                         f"{', '.join(OPTYPES)}")
    return np.asarray(codes.to_numpy(zero_copy_only=False), dtype=np.int8)


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
    if col.null_count:
        if fill is None:
            raise InputError(source, name, f"{col.null_count} null values; expected numbers")
        col = pc.fill_null(col, fill)
    arr = col.to_numpy()
    if dtype.kind == "i" and arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or np.any(arr != np.round(arr)):
            raise InputError(source, name, "expected whole numbers")
    return arr.astype(dtype, copy=False)


def check_values(ops: dict[str, np.ndarray], source: Path | str) -> None:
    """Reject NaN/inf/negative times and negative ids."""
    for name in ("start_ts", "duration"):
        bad = ~np.isfinite(ops[name])
        if bad.any():
            raise InputError(source, name, f"{int(bad.sum())} rows are NaN or infinite "
                             f"(first at row {int(np.argmax(bad))}); expected finite seconds")
    neg = ops["duration"] < 0
    if neg.any():
        raise InputError(source, "duration", f"{int(neg.sum())} negative durations (first at row "
                         f"{int(np.argmax(neg))}: {ops['duration'][neg][0]!r}); expected >= 0 s")
    for name in ("rank", "dp_rank", "stage", "step"):
        neg = ops[name] < 0
        if neg.any():
            raise InputError(source, name, f"negative value at row {int(np.argmax(neg))}; "
                             "expected >= 0")


def columns_to_table(ops: dict[str, np.ndarray]) -> pa.Table:
    """Numpy op columns to an Arrow table with optype as a dictionary of names."""
    arrays, names = [], []
    for name in list(COLUMNS) + [c for c in OPTIONAL_COLUMNS if c in ops]:
        if name == "optype":
            arr = pa.DictionaryArray.from_arrays(pa.array(ops[name], pa.int8()), pa.array(OPTYPES))
        else:
            arr = pa.array(ops[name])
        arrays.append(arr)
        names.append(name)
    return pa.table(arrays, names=names)


def known_optype(name: str) -> bool:
    """Whether a name is one of the canonical op types."""
    return name in OPTYPE_CODES
