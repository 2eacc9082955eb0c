"""Our own run format: a directory with meta.json and Parquet op tables, one or more per rank."""

from __future__ import annotations

import json
import re
from pathlib import Path

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stragglers.errors import InputError
from stragglers.trace.columns import columns_to_table, table_to_columns
from stragglers.trace.model import (COLUMNS, NOTE_KINDS, OPTIONAL_COLUMNS, OPTIONAL_FILL, JobMeta,
                                    Note, Trace)

META_FILE = "meta.json"
# rank-00003.parquet, or rank-00003.part-000012.parquet when a recorder flushes in parts.
RANK_FILE = re.compile(r"^rank-(\d+)(?:\.part-(\d+))?\.parquet$")
# Parquet codec of the op tables written: LZ4 decodes a recorder's small parts 2.3× faster than
# zstd (zstd's per-page set-up is most of a few-hundred-row part's read) and a 1.2M-row table
# 2.2× faster, for files ~5–13% larger (BENCHMARKS.md, issue 14, "HTTP uploads as recorders
# send them, run-format parts in LZ4"); readers take any codec Parquet has, so runs written
# before keep reading.
CODEC = "lz4"
META_INT_FIELDS = ("dp_size", "pp_size", "tp_size", "dsp_size", "vpp_size", "ep_size",
                   "world_size")


def rank_file_name(rank: int, part: int | None = None) -> str:
    """File name of one rank's op table (or of one flushed part of it)."""
    return f"rank-{rank:05d}.parquet" if part is None else f"rank-{rank:05d}.part-{part:06d}.parquet"


def write_meta(directory: Path, meta: JobMeta, notes: list[Note] | None = None) -> Path:
    """Write meta.json atomically (write a temp file, then rename), with the reader's notes."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / META_FILE
    tmp = path.with_suffix(".json.tmp")
    raw = meta.to_dict()
    if notes:
        raw["notes"] = [msgspec.to_builtins(n) for n in notes]
    tmp.write_text(json.dumps(raw, indent=2, sort_keys=True))
    tmp.replace(path)
    return path


def read_meta(path: Path) -> JobMeta:
    """Read and validate a meta.json."""
    return meta_from_dict(_read_meta_json(path), path)


def _read_meta_json(path: Path) -> object:
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise InputError(path, None, "missing; a run directory needs meta.json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(path, None, f"not valid JSON ({exc})") from None


def notes_from_dict(raw: object, source: Path | str) -> list[Note]:
    """The reader notes stored beside job metadata ("notes": [{kind, message}])."""
    notes = raw.get("notes") if isinstance(raw, dict) else None
    if notes is None:
        return []
    try:
        read = msgspec.convert(notes, list[Note]) if isinstance(notes, list) else None
    except msgspec.ValidationError:
        read = None
    if read is None or any(n.kind not in NOTE_KINDS for n in read):
        raise InputError(source, "notes", "expected a list of {kind, message} with kind one of "
                         + ", ".join(NOTE_KINDS))
    return read


def meta_from_dict(raw: object, source: Path | str) -> JobMeta:
    """Validate a metadata mapping (meta.json or NDTimeline YAML) into JobMeta."""
    if not isinstance(raw, dict):
        raise InputError(source, None, "expected a mapping of job metadata")
    values = {}
    for key in META_INT_FIELDS:
        v = raw.get(key)
        if v is None:
            if key in ("dp_size", "pp_size"):
                got = "missing" if key not in raw else "null"
                raise InputError(source, key, f"{got}; expected a positive integer")
            continue  # an optional size left out or null: its default
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if key == "world_size" else 1):
            raise InputError(source, key, f"expected a positive integer, got {v!r}")
        values[key] = v
    extra = raw.get("extra") or {}
    if not isinstance(extra, dict):
        raise InputError(source, "extra", f"expected a mapping, got {type(extra).__name__}")
    name = raw.get("name", raw.get("trial_name"))
    meta = JobMeta(name=str(Path(str(source)).stem if name is None else name),
                   run_id=str(raw.get("run_id", "0")), extra=dict(extra), **values)
    expected = meta.dp_size * meta.pp_size * meta.tp_size * meta.dsp_size
    if meta.world_size != expected:
        raise InputError(source, "world_size", f"{meta.world_size} is inconsistent with the sizes: "
                         f"dp·pp·tp·dsp = {meta.dp_size}·{meta.pp_size}·{meta.tp_size}·"
                         f"{meta.dsp_size} = {expected}")
    if meta.world_size % meta.ep_size:
        raise InputError(source, "ep_size", f"{meta.ep_size} does not divide the world size "
                         f"{meta.world_size}; expected the size of one expert-parallel group")
    return meta


def check_against_meta(ops: dict[str, np.ndarray], meta: JobMeta, trace_source: Path | str,
                       meta_source: Path | str) -> None:
    """The table's DP ranks and stages must fit the metadata's sizes, and every stage be there.

    A stage missing from the trace (pp_size 4 in the metadata, 2 stages in the table) would
    silently change the pipeline the replay builds, so it is refused. DP ranks may be a subset
    (a partial capture); the report states which workers are missing.
    """
    for column, key in (("dp_rank", "dp_size"), ("stage", "pp_size")):
        size = getattr(meta, key)
        top = int(ops[column].max())
        if top >= size:
            raise InputError(trace_source, column, f"value {top} is outside {key}={size} from "
                             f"{meta_source}")
    stages = np.unique(ops["stage"])
    if len(stages) != meta.pp_size:
        missing = sorted(set(range(meta.pp_size)) - {int(s) for s in stages})
        raise InputError(meta_source, "pp_size", f"{meta.pp_size}, but {trace_source} holds "
                         f"{len(stages)} stage(s) ({', '.join(map(str, stages.tolist()))}); no ops "
                         f"for stage(s) {', '.join(map(str, missing))}; expected the metadata and "
                         "the trace to agree")


def write_rank(directory: Path, rank: int, ops: dict[str, np.ndarray], part: int | None = None) -> Path:
    """Write one rank's ops (or one part of them) atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / rank_file_name(rank, part)
    tmp = path.with_name(path.name + ".tmp")
    write_table(ops, tmp)
    tmp.replace(path)
    return path


def write_table(ops: dict[str, np.ndarray], where) -> None:
    """An op table written as a rank file's Parquet (to a path or an Arrow output stream)."""
    pq.write_table(columns_to_table(ops), where, compression=CODEC)


def table_bytes(ops: dict[str, np.ndarray]) -> bytes:
    """An op table as the Parquet bytes of a rank file (what a recorder uploads as a part)."""
    sink = pa.BufferOutputStream()
    write_table(ops, sink)
    return sink.getvalue().to_pybytes()


def write_run(directory: Path | str, trace: Trace) -> Path:
    """Write a whole trace as a run directory (one Parquet file per rank)."""
    directory = Path(directory)
    write_meta(directory, trace.meta, trace.notes)
    ranks = trace.ops["rank"]
    order = np.argsort(ranks, kind="stable")
    sorted_ranks = ranks[order]
    bounds = np.flatnonzero(np.diff(sorted_ranks)) + 1
    for idx in np.split(order, bounds):
        if len(idx):
            write_rank(directory, int(ranks[idx[0]]), {k: v[idx] for k, v in trace.ops.items()})
    return directory


def run_contents(directory: Path) -> tuple[JobMeta, list[Note], list[Path]]:
    """(metadata, reader notes, rank files in name order) of a run directory, validated."""
    raw = _read_meta_json(directory / META_FILE)
    meta = meta_from_dict(raw, directory / META_FILE)
    notes = notes_from_dict(raw, directory / META_FILE)
    files = sorted(p for p in directory.iterdir() if RANK_FILE.match(p.name))
    if not files:
        raise InputError(directory, None, "holds no rank-NNNNN.parquet op tables")
    return meta, notes, files


def read_run(directory: Path | str) -> Trace:
    """Read a run directory; every Parquet file is validated and named in errors."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(directory, None, "not a run directory (expected a folder with meta.json)")
    meta, notes, files = run_contents(directory)
    ops = _read_all_at_once(directory, files)
    if ops is None:
        ops = _read_file_by_file(files)
    if len(ops["step"]) == 0:
        raise InputError(directory, None, "the op tables hold no ops")
    check_against_meta(ops, meta, directory, directory / META_FILE)
    return Trace(ops, meta, str(directory), notes)


def _read_all_at_once(directory: Path, files: list[Path]) -> dict[str, np.ndarray] | None:
    """Fast path: one multi-threaded read of every file; None when the files need a closer look."""
    try:
        schemas = {str(pq.read_schema(f)) for f in files}
        if len(schemas) != 1:
            return None
        table = pq.ParquetDataset(files).read(use_threads=True)
        return table_to_columns(table, directory)
    except (pa.ArrowException, OSError, ValueError, InputError):
        return None  # the file-by-file path names the file at fault


def _read_file_by_file(files: list[Path]) -> dict[str, np.ndarray]:
    """Read and validate each file on its own, so any error names it.

    An optional column that only some files carry (a recorder part without sequence lengths)
    is kept, filled with its "unknown" value where a file lacks it: nothing is dropped.
    """
    tables = [read_parquet(path) for path in files]
    total = sum(t.num_rows for t in tables)
    optional = [c for c in OPTIONAL_COLUMNS if any(c in t.column_names for t in tables)]
    ops = {c: np.empty(total, dtype=d) for c, d in COLUMNS.items()}
    ops.update({c: np.full(total, OPTIONAL_FILL[c], dtype=OPTIONAL_COLUMNS[c]) for c in optional})
    offset = 0
    for i, (path, table) in enumerate(zip(files, tables)):
        part = table_to_columns(table, path)
        tables[i] = None  # free the Arrow copy as we go
        for k, values in part.items():
            ops[k][offset:offset + len(values)] = values
        offset += len(part["step"])
    return ops


def read_parquet(path: Path) -> pa.Table:
    """Read a Parquet file, turning any Arrow failure into an error that names the file."""
    try:
        return pq.read_table(path)
    except FileNotFoundError:
        raise InputError(path, None, "no such file") from None
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(path, None, f"not a readable Parquet file ({first})") from None


__all__ = ["COLUMNS", "read_run", "write_run", "write_rank", "write_meta", "read_meta",
           "rank_file_name", "meta_from_dict", "notes_from_dict", "check_against_meta",
           "read_parquet"]
