"""Our own run format: a directory with meta.json and Parquet op tables, one or more per rank."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stragglers.errors import InputError
from stragglers.smallfiles import load_json_file
from stragglers.trace.columns import columns_to_table, table_to_columns
from stragglers.trace.parquet_footer import read_checked_metadata
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
# Row groups: a rank file is written a row group per block of steps, so that a reader of some
# steps (a step partition, whatif/partitioned.py) decodes only the groups that hold them (the
# footer's step statistics say which). Each group read costs about as much as decoding this many
# more rows (its footer entry, page headers, a decoder set up per column: 0.45 ms a group against
# ~1 µs a row, 504K ops in 512 files written with 1, 2, 5 and 20 steps a group).
GROUP_COST_ROWS = 450
# The step partitions a reader is expected to cut a run into, at least: a Dask cluster's 2
# workers (a run under READ_PARTITION_ROWS read in one process is one partition, for which
# groups only cost: assuming more partitions would cut small runs finer for nothing).
MIN_READ_PARTITIONS = 2
# The rows of one step partition as whatif/partitioned.py sizes them (PARTITION_BYTES /
# BYTES_PER_ROW there): a bigger run is read in more partitions, so its groups hold fewer steps.
READ_PARTITION_ROWS = (1 << 30) // 200
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


# meta.json at most: its layout holds an entry per rank (~200 bytes), 100,000 ranks in 20 MB
MAX_META_BYTES = 64 << 20


def _read_meta_json(path: Path) -> object:
    # a regular file only, read without blocking and bounded: a FIFO named meta.json hung the
    # analysis for good and /dev/zero filled the memory
    return load_json_file(path, "the run's metadata as JSON (meta.json)", MAX_META_BYTES,
                          missing="missing; a run directory needs meta.json")


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
    check_layout_extra(meta, source)
    check_read_extra(meta.extra, source)
    return meta


class _ReadExtra(msgspec.Struct):
    """The keys of `extra` the what-if engine and `advise` read, typed as they use them
    (`extra.notes: 5` or `extra.ranks_missing: 5` failed deep in the analysis: `len()` of an
    int, iterating a bool; `extra.calibration: "x"` failed advise on `.get`); the engine checks
    the types of the others it reads itself (recorder, compute_from, ...), advise the values
    inside `calibration`."""

    ranks_missing: list[Any] | None = None   # counted (len)
    notes: list[Any] | None = None           # each one str()-ed into a note
    calibration: dict[str, Any] | None = None   # what a calibration step measured, by setting
    global_batch: int | float | None = None     # samples a global step (a finite count)


def check_read_extra(extra: dict, source: Path | str) -> None:
    """InputError naming the field unless the extra keys the analysis reads have its types."""
    try:
        typed = msgspec.convert(extra, _ReadExtra)
    except msgspec.ValidationError as exc:
        where = str(exc).rpartition("`$.")[2].rstrip("`") or None
        raise InputError(source, f"extra.{where}" if where else "extra",
                         f"{str(exc).partition(' - ')[0]} (the analysis reads it)") from None
    batch = typed.global_batch
    if batch is not None and not (math.isfinite(batch) and batch > 0):
        raise InputError(source, "extra.global_batch", f"{batch!r}; expected a positive number "
                         "of samples (or tokens) per global step")


# extra.parallel's degrees, as the recorder writes them (the report shows them)
DEGREES = ("dp", "tp", "cp", "ep", "pp")
# a layout entry's optional integer places and optional names
_ENTRY_PLACES = ("replica", "tp_rank", "cp_rank", "ep_rank")
_ENTRY_NAMES = ("host", "cpus", "device")
# a layout entry's `threads` (torch's intra-op threads of the rank) at most
_MOST_THREADS = 1 << 16


def _int_in(value: object, top: int) -> bool:
    """An int (not a bool) in 0..top-1."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < top


def _ranges_shown(values: list[int], most: int = 200) -> str:
    """Sorted integers as ranges ('0-3, 7'), cut at about `most` characters with the count."""
    from stragglers.wording import ranges   # noqa: PLC0415

    text = ranges(values)
    return text if len(text) <= most else f"{text[:most].rpartition(',')[0]}, ... " \
        f"({len(values):,} in all)"


def _shown(value: object) -> str:
    return repr(str(value)[:40])


def check_layout_extra(meta: JobMeta, source: Path | str) -> None:
    """The layout a recorder writes into `extra` (layout, parallel, process_groups,
    group_sizes, mesh), checked against the job's sizes: InputError naming the field.

    The report and the diagnosis read them (a rank's host, the degrees in the header, the
    place of a rank): a hand-edited value of the wrong type failed deep inside the analysis,
    and a degree that does not fit the world was shown as the job's layout."""
    extra, world = meta.extra, meta.world_size
    layout = extra.get("layout")
    if layout is not None:
        _check_layout_entries(layout, meta, source)
    parallel = extra.get("parallel")
    if parallel is not None:
        _check_parallel(parallel, meta, source)
    groups = extra.get("process_groups")
    if groups is not None:
        if not isinstance(groups, list):
            raise InputError(source, "extra.process_groups", f"expected a list of rank lists, "
                             f"got {type(groups).__name__}")
        for i, g in enumerate(groups):
            if (not isinstance(g, list) or not g or not all(_int_in(r, world) for r in g)
                    or len(set(g)) != len(g)):
                raise InputError(source, f"extra.process_groups[{i}]", f"{_shown(g)}; expected "
                                 f"a list of distinct ranks in 0..{world - 1} (the world size)")
    for key in ("group_sizes", "mesh"):
        sizes = extra.get(key)
        if sizes is None:
            continue
        if not isinstance(sizes, dict):
            raise InputError(source, f"extra.{key}", f"expected a mapping of dimension name to "
                             f"size, got {type(sizes).__name__}")
        for name, size in sizes.items():
            if not _int_in(size, world + 1) or size < 1:
                raise InputError(source, f"extra.{key}.{str(name)[:40]}", f"{_shown(size)}; "
                                 f"expected a size in 1..{world} (the world size)")
    implied = extra.get("tp_size_implied")
    if implied is not None and not (_int_in(implied, world + 1) and implied >= 1):
        raise InputError(source, "extra.tp_size_implied", f"{_shown(implied)}; expected a "
                         f"size in 1..{world} (the world size)")
    split = extra.get("compute_split_at_collectives")
    if split is not None and not isinstance(split, bool):
        raise InputError(source, "extra.compute_split_at_collectives", f"{_shown(split)}; "
                         "expected true or false")


def _check_layout_entries(layout: object, meta: JobMeta, source: Path | str) -> None:
    """One entry per rank at most, each rank at its own place inside the job's sizes."""
    if not isinstance(layout, list):
        raise InputError(source, "extra.layout", f"expected a list of rank entries, got "
                         f"{type(layout).__name__}")
    seen: set[int] = set()
    places: dict[tuple[int, int], int] = {}
    for i, e in enumerate(layout):
        field = f"extra.layout[{i}]"
        if not isinstance(e, dict):
            raise InputError(source, field, f"expected a mapping, got {type(e).__name__}")
        rank = e.get("rank")
        if not _int_in(rank, meta.world_size):
            raise InputError(source, f"{field}.rank", f"{_shown(rank)}; expected an integer "
                             f"in 0..{meta.world_size - 1} (the world size)")
        assert isinstance(rank, int)  # (_int_in)
        if rank in seen:
            raise InputError(source, f"{field}.rank", f"rank {rank} listed twice")
        seen.add(rank)
        for key, top, name in (("dp_rank", meta.dp_size, "dp_size"),
                               ("stage", meta.pp_size, "pp_size")):
            if key in e and not _int_in(e[key], top):
                raise InputError(source, f"{field}.{key}", f"{_shown(e[key])}; expected an "
                                 f"integer in 0..{top - 1} (the job's {name})")
        if "dp_rank" in e and "stage" in e:
            # the analysis takes one worker per place
            other = places.setdefault((e["dp_rank"], e["stage"]), rank)
            if other != rank:
                raise InputError(source, field, f"rank {rank} at dp_rank {e['dp_rank']}, stage "
                                 f"{e['stage']}, the place of rank {other}; expected one rank "
                                 "per place (tensor-parallel ranks are workers of their own: "
                                 "dp_size counts them)")
        for key in _ENTRY_PLACES:
            if key in e and not _int_in(e[key], meta.world_size):
                raise InputError(source, f"{field}.{key}", f"{_shown(e[key])}; expected an "
                                 f"integer in 0..{meta.world_size - 1} (the world size)")
        threads = e.get("threads")
        if threads is not None and not _int_in(threads, _MOST_THREADS + 1) or threads == 0:
            raise InputError(source, f"{field}.threads", f"{_shown(threads)}; expected an "
                             f"integer in 1..{_MOST_THREADS} (the rank's compute threads)")
        for key in _ENTRY_NAMES:
            if e.get(key) is not None and not isinstance(e[key], str):
                raise InputError(source, f"{field}.{key}", f"expected a string, got "
                                 f"{type(e[key]).__name__}")


def _check_parallel(parallel: object, meta: JobMeta, source: Path | str) -> None:
    """Degrees among dp, tp, cp, ep, pp that multiply to the world and fit the table."""
    if not isinstance(parallel, dict):
        raise InputError(source, "extra.parallel", f"expected a mapping of {', '.join(DEGREES)} "
                         f"to degrees, got {type(parallel).__name__}")
    for key, value in parallel.items():
        if key not in DEGREES:
            raise InputError(source, f"extra.parallel.{str(key)[:40]}", f"not a degree; "
                             f"expected keys among {', '.join(DEGREES)}")
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise InputError(source, f"extra.parallel.{key}", f"{_shown(value)}; expected a "
                             "positive integer")
    world = meta.world_size
    d = {k: parallel.get(k, 1) for k in DEGREES}
    for key in ("tp", "cp", "ep", "pp"):
        if world % d[key]:
            raise InputError(source, f"extra.parallel.{key}", f"{d[key]} does not divide the "
                             f"world size {world}")
    if "dp" in parallel and d["dp"] * d["tp"] * d["cp"] * d["pp"] != world:
        raise InputError(source, "extra.parallel", f"dp·tp·cp·pp = {d['dp']}·{d['tp']}·"
                         f"{d['cp']}·{d['pp']} = {d['dp'] * d['tp'] * d['cp'] * d['pp']}; "
                         f"expected the world size {world}")
    if d["pp"] != meta.pp_size:
        raise InputError(source, "extra.parallel.pp", f"{d['pp']}, but pp_size is "
                         f"{meta.pp_size}; expected the same number of pipeline stages")


# Process-group ids at or above this are a group made after the recorder gathered the job's
# groups (FALLBACK_BASE + a hash of its ranks, record/modelparallel.py): not in the list
PG_LATE_BASE = 1 << 20


def check_process_groups(ops: dict[str, np.ndarray], meta: JobMeta, directory: Path) -> None:
    """A recorded run's pg column against `extra.process_groups`: each id one of the listed
    groups (or a group made later), and the rank of each row one of its members. A rank's
    collective named in a group without it (or an id listed nowhere) was read as a collective
    of its own, and the rank named as a communication straggler."""
    groups = meta.extra.get("process_groups")
    if "pg" not in ops or not isinstance(groups, list):
        return
    pg, rank = ops["pg"].astype(np.int64), ops["rank"].astype(np.int64)
    listed = (pg >= 0) & (pg < PG_LATE_BASE)
    if not listed.any():
        return
    pairs = np.unique(np.stack([rank[listed], pg[listed]], axis=1), axis=0)
    for r, g in pairs.tolist():
        where = f"{directory / f'rank-{r:05d}'}*.parquet"
        if g >= len(groups):
            raise InputError(where, "pg", f"process group {g}, but {directory / META_FILE} lists "
                             f"{len(groups)} (extra.process_groups); expected an id among them "
                             f"or -1")
        if r not in groups[g]:
            raise InputError(where, "pg", f"rank {r}'s rows name process group {g} "
                             f"{groups[g][:8]}, which does not hold rank {r}; expected one of "
                             "its own groups")


def check_file_ranks(files: list, tables: list) -> None:
    """Every row of a rank file is the rank its name says (rank-00003*.parquet: rank 3), as the
    monitor refuses rows of another rank in a part: a file whose rows named rank 9 in a world
    of 4 was analysed as a fifth rank, and a diagnosis could name a rank that does not exist."""
    import pyarrow.compute as pc

    for path, table in zip(files, tables):
        m = RANK_FILE.match(Path(path).name)
        if m is None or "rank" not in table.column_names or not table.num_rows \
                or not pa.types.is_integer(table.schema.field("rank").type):
            continue   # (not a rank file's name, or a column table_to_columns refuses)
        low, high = (v.as_py() for v in pc.min_max(table.column("rank")).values())
        want = int(m.group(1))
        if low != want or high != want:
            other = low if low != want else high
            raise InputError(path, "rank", f"rows of rank {other} in the file of rank {want}; "
                             f"expected every row to be rank {want}")


def check_against_meta(ops: dict[str, np.ndarray], meta: JobMeta, trace_source: Path | str,
                       meta_source: Path | str) -> None:
    """The table's DP ranks and stages must fit the metadata's sizes, and every stage be there.

    A stage missing from the trace (pp_size 4 in the metadata, 2 stages in the table) would
    silently change the pipeline the replay builds, so it is refused. DP ranks may be a subset
    (a partial capture); the report states which workers are missing.
    """
    for column, key in (("rank", "world_size"), ("dp_rank", "dp_size"), ("stage", "pp_size")):
        if column not in ops or not len(ops[column]):
            continue
        size = getattr(meta, key)
        top = int(ops[column].max())
        if top >= size:
            raise InputError(trace_source, column, f"value {top} is outside {key}={size} from "
                             f"{meta_source}")
    stages = np.unique(ops["stage"])
    if len(stages) != meta.pp_size:
        # as ranges ('2-99999'): a run missing 99,998 stages was refused in one 689 KB line
        missing = np.setdiff1d(np.arange(meta.pp_size), stages).tolist()
        raise InputError(meta_source, "pp_size", f"{meta.pp_size}, but {trace_source} holds "
                         f"{len(stages)} stage(s) ({_ranges_shown(stages.tolist())}); no ops "
                         f"for stage(s) {_ranges_shown(missing)}; expected the metadata and "
                         "the trace to agree")


def write_rank(directory: Path, rank: int, ops: dict[str, np.ndarray], part: int | None = None,
               group_steps: int | None = None) -> Path:
    """Write one rank's ops (or one part of them) atomically; with `group_steps`, a row group
    per that many steps (group_bounds)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / rank_file_name(rank, part)
    tmp = path.with_name(path.name + ".tmp")
    write_table(ops, tmp, group_steps)
    tmp.replace(path)
    return path


def write_table(ops: dict[str, np.ndarray], where, group_steps: int | None = None) -> None:
    """An op table written as a rank file's Parquet (to a path or an Arrow output stream): one
    row group, or with `group_steps` a row group per block of that many steps (group_bounds).
    A recorder's part is one group: its flushes already cut the rank's steps into files."""
    table = columns_to_table(ops)
    bounds = (np.array([0, table.num_rows]) if group_steps is None
              else group_bounds(ops["step"], group_steps))
    with pq.ParquetWriter(where, table.schema, compression=CODEC) as writer:
        if len(bounds) <= 2:        # one group (up to Arrow's default size, as before)
            writer.write_table(table)
            return
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            writer.write_table(table.slice(lo, hi - lo), row_group_size=hi - lo)


def steps_per_group(rows_per_step: float, steps: int, partitions: int) -> int:
    """Steps a row group holds: what minimises the rows a partitioned read decodes, a group's
    cost counted as GROUP_COST_ROWS rows. Read in P partitions, a file of T steps of r rows in
    groups of g steps costs about (T/g + P)·GROUP_COST_ROWS + (T + P·g)·r (each partition
    decodes its groups, one cut through at each end): least at g = √(T·GROUP_COST_ROWS / (P·r))."""
    if steps <= 1 or rows_per_step <= 0:
        return 1
    best = np.sqrt(steps * GROUP_COST_ROWS / (max(1, partitions) * rows_per_step))
    return int(min(steps, max(1, round(best))))


def group_bounds(step: np.ndarray, width: int) -> np.ndarray:
    """Row offsets [0, …, n] of a file's row groups: one per block of `width` steps, blocks
    starting at multiples of `width` (every file of a run cut at the same steps, so a reader's
    partitions can start where no group of any file straddles). Rows not in step order are
    one group (a cut would not keep a partition's steps in a few groups)."""
    n = len(step)
    if n == 0 or width < 1 or not bool(np.all(step[1:] >= step[:-1])):
        return np.array([0, n], dtype=np.int64)
    first, last = int(step[0]), int(step[-1])
    edges = np.arange((first // width + 1) * width, last + 1, width, dtype=np.int64)
    return np.unique(np.concatenate([[0], np.searchsorted(step, edges), [n]])).astype(np.int64)


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
    width = run_group_steps(trace.ops["step"], len(bounds) + 1)
    for idx in np.split(order, bounds):
        if len(idx):
            write_rank(directory, int(ranks[idx[0]]), {k: v[idx] for k, v in trace.ops.items()},
                       group_steps=width)
    return directory


def run_group_steps(step: np.ndarray, files: int) -> int:
    """Steps a row group of a run's rank files holds (steps_per_group for the run's size: a
    rank file's rows a step on average, read in the partitions a reader cuts it into)."""
    if not len(step):
        return 1
    steps = int(step.max()) - int(step.min()) + 1
    partitions = max(MIN_READ_PARTITIONS, -(-len(step) // READ_PARTITION_ROWS))
    return steps_per_group(len(step) / (max(1, files) * steps), steps, partitions)


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
    ops = _read_files(directory, files)
    if len(ops["step"]) == 0:
        raise InputError(directory, None, "the op tables hold no ops")
    check_against_meta(ops, meta, directory, directory / META_FILE)
    check_process_groups(ops, meta, directory)
    # (a converted run keeps the notes it was read with: each said once)
    return Trace(ops, meta, str(directory),
                 notes + [n for n in crowded_hosts(meta) if n not in notes])


def crowded_hosts(meta: JobMeta) -> list[Note]:
    """A note per host whose ranks outnumber the CPUs they may use together (`crowded`).

    There the ranks compute in turns: a rank that waits gives its core to another, so a fix
    that evens out their work (balanced routing or sequences) gains less than the what-if says,
    which gives every rank its own speed as a device or core of its own would.
    """
    return [Note("layout", f"host {host[:64]}: {len(ranks)} ranks share {n} CPU"
                 f"{'s' if n > 1 else ''}: they compute in turns, so evening out their work "
                 "(balanced routing or sequences) gains less than predicted, which gives each "
                 "rank a core or device of its own")
            for host, (ranks, n) in crowded(meta).items()]


def crowded(meta: JobMeta) -> dict[str, tuple[list[int], int]]:
    """host → (its ranks, the CPUs they may use together) for each host whose ranks outnumber
    those CPUs, in a job timed on the CPU (the recorder's layout: each rank's host and its CPU
    affinity, "0-3,8"); {} where the layout lacks them (a recorder before `cpus`, a GPU
    recorder's, a layout written by hand)."""
    recorder = meta.extra.get("recorder")
    if not isinstance(recorder, dict) or recorder.get("timer") == "cuda-events":
        return {}
    ranks: dict[str, list[int]] = {}
    cpus: dict[str, set[int]] = {}
    for entry in meta.extra.get("layout") or []:
        if not isinstance(entry, dict):
            return {}
        host, ids, rank = entry.get("host"), _cpu_list(entry.get("cpus")), entry.get("rank")
        if not isinstance(host, str) or ids is None or type(rank) is not int:
            return {}
        ranks.setdefault(host, []).append(rank)
        cpus.setdefault(host, set()).update(ids)
    return {host: (r, len(cpus[host])) for host, r in sorted(ranks.items())
            if len(r) > len(cpus[host])}


def _cpu_list(text: object, most: int = 1 << 16) -> set[int] | None:
    """The CPU ids of a kernel-style list ("0-3,8"), or None where it is not one (or names
    more than `most` CPUs)."""
    if not isinstance(text, str) or len(text) > 4096:
        return None
    ids: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"(\d{1,6})(?:-(\d{1,6}))?", part, re.ASCII)
        if m is None:
            return None
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo or len(ids) + hi - lo + 1 > most:
            return None
        ids.update(range(lo, hi + 1))
    return ids


# Threads reading a run's files (Parquet decoding releases the GIL; more gain nothing on the
# few cores a what-if runs on, and each holds a file's table).
READ_THREADS = 4


def _read_files(directory: Path, files: list[Path]) -> dict[str, np.ndarray]:
    """Every file opened and read once (on a few threads), then converted as one table where
    their schemas agree and every value is accepted, else file by file so errors name it."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(READ_THREADS, len(files))) as pool:
        # optype read as a dictionary: its names decoded once per page, not once per row
        tables = list(pool.map(lambda f: read_parquet(f, use_threads=False,
                                                      read_dictionary=["optype"]), files))
    check_file_ranks(files, tables)
    if len({t.schema for t in tables}) == 1:
        try:
            return table_to_columns(pa.concat_tables(tables), directory)
        except (pa.ArrowException, InputError):
            pass  # the file-by-file conversion names the file at fault
    return _columns_by_file(files, tables)


def _columns_by_file(files: list[Path], tables: list) -> dict[str, np.ndarray]:
    """Convert and validate each file's table on its own, so any error names it.

    An optional column that only some files carry (a recorder part without sequence lengths)
    is kept, filled with its "unknown" value where a file lacks it: nothing is dropped.
    """
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


def read_parquet(path: Path, use_threads: bool = True,
                 read_dictionary: list[str] | None = None) -> pa.Table:
    """Read a Parquet file, turning any Arrow failure into an error that names the file; its
    footer is screened first (parquet_footer: one that disagrees with itself is refused here,
    never handed to pyarrow)."""
    try:
        read_checked_metadata(path)
        return pq.read_table(path, use_threads=use_threads, read_dictionary=read_dictionary)
    except FileNotFoundError:
        raise InputError(path, None, "no such file") from None
    except (pa.ArrowException, OSError, ValueError) as exc:   # (BadFooter: a ValueError)
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(path, None, f"not a readable Parquet file ({first})") from None


__all__ = ["COLUMNS", "read_run", "write_run", "write_rank", "write_meta", "read_meta",
           "rank_file_name", "meta_from_dict", "notes_from_dict", "check_against_meta",
           "check_file_ranks",
           "read_parquet"]
