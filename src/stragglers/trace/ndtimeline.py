"""NDTimeline / StragglerAnalysis format: one Parquet op table plus a meta-<name>.yaml."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from stragglers.errors import InputError
from stragglers.smallfiles import load_yaml_file
from stragglers.trace.columns import OPTYPE_NAMES, table_to_columns
from stragglers.trace.model import COLUMNS, OPTIONAL_COLUMNS, JobMeta, Trace
from stragglers.trace.runformat import (check_against_meta, meta_from_dict, notes_from_dict,
                                        read_parquet)

# NDTimeline stores narrow types; we write them back the same way so the files stay familiar.
_NDT_TYPES = {"dp_rank": pa.int16(), "stage": pa.int16(), "rank": pa.int32(), "step": pa.int64(),
              "start_ts": pa.float64(), "duration": pa.float64(), "seq_id": pa.int32(),
              "mc": pa.int16(), "mb_id": pa.int32(), "gmc": pa.int32()}


def meta_path_for(trace_path: Path) -> Path:
    """The metadata file beside a trace: trace-ST.parquet → meta-ST.yaml."""
    stem = trace_path.stem
    name = stem[len("trace-"):] if stem.startswith("trace-") else stem
    for suffix in (".yaml", ".yml"):
        candidate = trace_path.with_name(f"meta-{name}{suffix}")
        if candidate.exists():
            return candidate
    return trace_path.with_name(f"meta-{name}.yaml")


def read_meta_yaml(path: Path) -> JobMeta:
    """Read NDTimeline job metadata (trial_name, run_id, *_size, world_size)."""
    return meta_from_dict(_load_yaml(path), path)


def _load_yaml(path: Path) -> object:
    return load_yaml_file(path, "a metadata YAML file",
                          missing="metadata file not found (give it with --meta)")


def read_ndtimeline(trace_path: Path | str, meta_path: Path | str | None = None) -> Trace:
    """Read an NDTimeline Parquet trace and its YAML metadata, validating both."""
    trace_path = Path(trace_path)
    meta_path = Path(meta_path) if meta_path else meta_path_for(trace_path)
    raw = _load_yaml(meta_path)
    meta = meta_from_dict(raw, meta_path)
    notes = notes_from_dict(raw, meta_path)
    table = read_parquet(trace_path)
    if table.num_rows == 0:
        raise InputError(trace_path, None, "holds no ops (empty table)")
    ops = table_to_columns(table, trace_path)
    check_against_meta(ops, meta, trace_path, meta_path)
    return Trace(ops, meta, str(trace_path), notes)


def write_ndtimeline(trace: Trace, trace_path: Path | str) -> tuple[Path, Path]:
    """Write a trace as NDTimeline Parquet plus meta-<name>.yaml beside it, losing nothing.

    The NDTimeline columns keep their narrow types (widened where a value would not fit);
    our optional columns (attn_cost, tokens, bytes) follow them, and the reader's notes and
    metadata extras go into the YAML, so reading the pair back gives the same trace.
    """
    trace_path = Path(trace_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    arrays, names = [], []
    for name in list(COLUMNS) + [c for c in OPTIONAL_COLUMNS if c in trace.ops]:
        values = trace.ops[name]
        if name == "optype":
            arr = pa.DictionaryArray.from_arrays(pa.array(values, pa.int8()), OPTYPE_NAMES)
        elif name in _NDT_TYPES:
            arr = pa.array(values).cast(_fitting(_NDT_TYPES[name], values))
        else:
            arr = pa.array(values)
        arrays.append(arr)
        names.append(name)
    pq.write_table(pa.table(arrays, names=names), trace_path)
    meta = trace.meta
    meta_path = meta_path_for(trace_path)
    raw = {"trial_name": meta.name, "run_id": meta.run_id, "dp_size": meta.dp_size,
           "dsp_size": meta.dsp_size, "pp_size": meta.pp_size, "tp_size": meta.tp_size,
           "vpp_size": meta.vpp_size, "world_size": meta.world_size}
    if meta.extra:
        raw["extra"] = meta.extra
    if trace.notes:
        raw["notes"] = [asdict(n) for n in trace.notes]
    meta_path.write_text(yaml.safe_dump(raw, sort_keys=False, allow_unicode=True), encoding="utf-8")
    return trace_path, meta_path


def _fitting(narrow: pa.DataType, values: np.ndarray) -> pa.DataType:
    """The NDTimeline type of a column, or int32 where its values do not fit (ids past 32767)."""
    if pa.types.is_integer(narrow) and len(values):
        info = np.iinfo(narrow.to_pandas_dtype())
        if values.min() < info.min or values.max() > info.max:
            return pa.int32() if narrow.bit_width < 32 else pa.int64()
    return narrow
