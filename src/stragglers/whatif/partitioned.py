"""The what-if of a run directory in step partitions: each partition read and laid on the grid
where its Parquet files lie, the replays run per partition, the diagnosis on the assembled job.

Steps are independent in the replay (each starts from its own measured start), so a step
partition replays on its own and the per-step times it returns are bit for bit those of the
whole job's replay. What needs every step is small and gathered: the template ops and DP ranks
(keys), which steps are complete (a bool per cell), the timing grid that the dependency model,
the ideal costs (medians over all DP ranks and steps) and the diagnosis read. The trace itself
(every column, incomplete steps) never sits in one process: the driver keeps the grid and the
few columns the diagnosis looks up (rank, mb_id, mc and the optional per-op metadata).

Nothing here imports Dask: `whatif/dask_runner.py` maps these functions onto a cluster; any
map (a list comprehension in tests of the pieces) gives the same result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.model import COLUMNS, OPTIONAL_COLUMNS, OPTIONAL_FILL, Note, Trace
from stragglers.whatif.grid import (GC, _SEQ_BITS, _OPTYPE_BITS, LeftOdd, OpGrid,
                                    _check_stages, _complete_steps, dense_ids, gc_slots,
                                    leave_out_odd, one_op_per_cell, ops_warning,
                                    reference_chunks)
from stragglers.whatif.metrics import WhatIf
from stragglers.whatif.realign import realigned_seq
from stragglers.whatif._replay import ReplayPlan, replay
from stragglers.whatif.rebuild import rebuild_in_parts, with_group

# What the diagnosis looks up in the trace by a grid cell's row (whatif/causes).
# (gmc too: each template op's chunks are read from its stage's reference replica-step,
# grid.reference_chunks, once the partitions are joined)
DIAGNOSIS_COLUMNS = ("rank", "mb_id", "mc", "gmc", "attn_cost", "tokens", "sent", "cpu_wait")
# A grid cell's row in the assembled columns: 4 bytes a cell (2³¹ ops analysed at most).
ROW = np.int32


# --- the run's layout (driver) -----------------------------------------------------------
@dataclass
class RunLayout:
    """A run directory's metadata, rank files and step range, read without its op tables."""

    directory: str
    meta: Any
    notes: list[Note]
    files: list[str]
    optional: list[str]          # optional columns some file carries (filled elsewhere)
    steps: np.ndarray            # the steps to analyse (sorted), from the files' statistics
    # per file, its row groups as (first row, rows, lowest step, highest step): a partition
    # reads only the row groups that hold its steps
    groups: list[list[tuple[int, int, int, int]]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        """Ops in the run (every step, from the files' footers)."""
        return sum(g[1] for groups in self.groups for g in groups)


def run_layout(directory: Path | str, steps: list[int] | None = None) -> RunLayout:
    """meta.json, the rank files and their steps (Parquet statistics: no op table is read)."""
    import pyarrow as pa

    from stragglers.trace.runformat import META_FILE, run_contents

    directory = Path(directory)
    if not directory.is_dir() or not (directory / META_FILE).exists():
        raise InputError(directory, None, "a step-partitioned analysis reads a run directory "
                         "(meta.json and rank-NNNNN.parquet files); convert other traces with "
                         "`stragglers convert` first")
    meta, notes, files = run_contents(directory)
    optional: set[str] = set()
    groups = []
    for f in files:
        md = _metadata(f)
        names = md.schema.names
        optional |= {c for c in OPTIONAL_COLUMNS if c in names}
        if "step" not in names:
            raise InputError(f, "step", "missing column")
        kind = md.schema.to_arrow_schema().field("step").type
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind)):
            # (its statistics or values are read as steps before the op table is checked)
            raise InputError(f, "step", f"expected a number column, got {kind}")
        groups.append(_row_groups(md, names.index("step"), f))
    ranges = [(g[2], g[3]) for file_groups in groups for g in file_groups if g[1]]
    if not ranges:
        raise InputError(directory, None, "the op tables hold no ops")
    lo, hi = min(r[0] for r in ranges), max(r[1] for r in ranges)
    rows = sum(g[1] for file_groups in groups for g in file_groups)
    # every step between the statistics' ends, where they can all be there; a range wider than
    # the rows (sampled steps, or statistics one damaged byte set to 2**31) is read from the
    # step columns, which hold no more steps than rows: an arange over it asked for 16.9 GB
    every = (np.arange(lo, hi + 1, dtype=np.int64) if hi - lo < rows
             else _steps_held(files))
    chosen = every if steps is None else np.intersect1d(every, np.asarray(steps, np.int64))
    if steps is not None and not len(chosen):
        raise InputError(directory, "step", f"none of the requested steps are in the trace "
                         f"(it has steps {lo}–{hi})")
    return RunLayout(str(directory), meta, notes, [str(f) for f in files],
                     [c for c in OPTIONAL_COLUMNS if c in optional], chosen, groups)


def _steps_held(files: list[Path]) -> np.ndarray:
    """The distinct steps the rank files' step columns hold (read, not their statistics)."""
    import pyarrow.parquet as pq

    from stragglers.trace.columns import step_values

    held = []
    for f in files:
        try:
            column = pq.read_table(f, columns=["step"]).column("step")
        except Exception as exc:  # noqa: BLE001 - any Arrow failure names the file
            raise InputError(f, None, f"not a readable Parquet file ({exc})") from None
        held.append(np.unique(step_values(column, f)))
    return np.unique(np.concatenate(held)) if held else np.zeros(0, np.int64)


def _row_groups(md, column: int, path) -> list[tuple[int, int, int, int]]:
    """(first row, rows, min step, max step) of each row group of a file, from its statistics
    (the step column is read where a row group has none)."""
    from stragglers.trace.columns import step_values, whole_step

    out, first = [], 0
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        rows = rg.num_rows
        st = rg.column(column).statistics
        if rows and (st is None or not st.has_min_max):
            import pyarrow.parquet as pq
            try:
                values = pq.ParquetFile(path).read_row_group(g, columns=["step"])
            except Exception as exc:  # noqa: BLE001 - any Arrow failure names the file
                raise InputError(path, None, f"not a readable Parquet file ({exc})") from None
            values = step_values(values.column("step"), path)
            lo, hi = int(values.min()), int(values.max())
        else:
            lo, hi = (whole_step(st.min, path), whole_step(st.max, path)) if rows else (0, -1)
        out.append((first, rows, lo, hi))
        first += rows
    return out


def step_partitions(steps: np.ndarray, n: int, layout: RunLayout | None = None
                    ) -> list[np.ndarray]:
    """The steps cut into at most n contiguous partitions of (nearly) equal size; with a
    `layout`, each cut moved to the nearest step where no row group holds steps on both sides
    (within a quarter of a partition): then no row group is read twice or read in part."""
    n = max(1, min(n, len(steps)))
    cuts = np.cumsum([len(p) for p in np.array_split(steps, n)])[:-1]
    if layout is not None and n > 1:
        cuts = _aligned_cuts(layout, steps, cuts, max(0, len(steps) // n // 4))
    return [p for p in np.split(steps, cuts) if len(p)]


def _aligned_cuts(layout: RunLayout, steps: np.ndarray, cuts: np.ndarray, reach: int
                  ) -> np.ndarray:
    """Each cut (an index into steps: a partition starts there) moved by at most `reach` to
    one that no row group straddles, where there is one."""
    bounds = np.array([(g[2], g[3]) for groups in layout.groups for g in groups if g[1]],
                      dtype=np.int64).reshape(-1, 2)
    order = np.argsort(bounds[:, 0], kind="stable")
    low, reach_hi = bounds[order, 0], np.maximum.accumulate(bounds[order, 1])
    # a cut between steps[j-1] and steps[j] is straddled by a group with low <= steps[j-1]
    # and high >= steps[j]: the highest high among the groups starting by steps[j-1] tells
    at = np.searchsorted(low, steps[:-1], side="right") - 1
    straddled = (at >= 0) & (reach_hi[np.maximum(at, 0)] >= steps[1:])
    clean = np.flatnonzero(~straddled) + 1            # cut indices no group straddles
    out, last = [], 0
    for cut in cuts:
        best = int(cut)
        if len(clean):
            k = np.searchsorted(clean, cut)
            near = [int(clean[i]) for i in (k - 1, k) if 0 <= i < len(clean)]
            near = [c for c in near if abs(c - cut) <= reach and c > last]
            if near:
                best = min(near, key=lambda c: (abs(c - cut), c))
        best = max(best, last + 1)
        out.append(best)
        last = best
    return np.array([c for c in out if c < len(steps)], dtype=np.int64)


# Bytes one op row takes while its partition is read and laid on the grid (the Arrow table,
# its columns, the grid cells and the indices placing them), measured on synthetic runs.
BYTES_PER_ROW = 200
# What one partition may take: the run is cut into as many step partitions as this needs.
PARTITION_BYTES = 1 << 30


def partitions_for(layout: RunLayout, budget: int = PARTITION_BYTES) -> int:
    """How many step partitions keep one partition's reading under `budget` bytes."""
    # (Python ints: steps near int64's ends overflow numpy's subtraction)
    every = (max(1, int(layout.steps.max()) - int(layout.steps.min()) + 1)
             if len(layout.steps) else 1)
    rows = layout.rows * len(layout.steps) / every
    return max(1, int(np.ceil(rows * BYTES_PER_ROW / budget)))


def _metadata(path):
    """A rank file's footer (FileMetaData), screened before pyarrow walks it: a footer that
    disagrees with itself makes pyarrow's metadata walk abort the process
    (trace/parquet_footer.py); InputError naming the file when it cannot be had."""
    from stragglers.trace.parquet_footer import read_checked_metadata

    try:
        return read_checked_metadata(path)
    except FileNotFoundError:
        raise InputError(path, None, "no such file") from None
    except Exception as exc:  # noqa: BLE001 - any failure (Arrow's, the screen's) names the file
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(path, None, f"not a readable Parquet file ({first})") from None


def _parquet(path: str, metadata=None):
    """A rank file opened with its op type read as a dictionary (its names decoded once per
    page, not once per row: 4× faster to read); `metadata`: its screened footer (_metadata)."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path, read_dictionary=["optype"], metadata=metadata)
    except KeyError:   # no optype column: table_to_columns names it
        return pq.ParquetFile(path, metadata=metadata)


# --- a partition (worker) ----------------------------------------------------------------
@dataclass
class Partition:
    """One step partition's ops, with each row's place in the run (file, row in file)."""

    ops: dict[str, np.ndarray]
    position: np.ndarray         # file index << 40 | row in file: the whole trace's row order
    source: str
    rows_read: int = 0           # rows decoded (its steps' and others' sharing their row groups)
    bytes_read: int = 0          # compressed bytes of the column chunks decoded


def read_partition(layout: RunLayout, steps: np.ndarray, pool=None) -> Partition:
    """The rows of these steps from every rank file, in the order read_run reads them (the
    files read on `pool`'s threads where given: Parquet decoding releases the GIL)."""
    from stragglers.trace.runformat import (check_against_meta, check_file_ranks,
                                            check_process_groups)

    lo, hi = int(steps.min()), int(steps.max())
    every = len(steps) == hi - lo + 1
    jobs = [(i, f, [(k, g) for k, g in enumerate(groups) if g[1] and g[2] <= hi and g[3] >= lo])
            for i, (f, groups) in enumerate(zip(layout.files, layout.groups))]
    jobs = [j for j in jobs if j[2]]
    if not jobs:
        empty = {c: np.empty(0, dtype=COLUMNS.get(c, OPTIONAL_COLUMNS.get(c)))
                 for c in read_columns(layout)}
        return Partition(empty, np.empty(0, np.int64), layout.directory)
    wanted = read_columns(layout)
    read = list(pool.map(lambda job: _read_table(job[1], [k for k, _ in job[2]], wanted), jobs)
                if pool is not None else (_read_table(f, [k for k, _ in g], wanted)
                                          for _, f, g in jobs))
    tables = [t for t, _ in read]
    check_file_ranks([j[1] for j in jobs], tables)
    bytes_read = sum(b for _, b in read)
    del read
    rows_read = sum(t.num_rows for t in tables)
    # the files differ in schema or one holds a bad value: file by file, naming the file
    ops = _columns_at_once(layout, tables) or _columns_by_file(layout, [j[1] for j in jobs],
                                                                tables)
    del tables
    # Arrow keeps freed buffers for reuse: hand them back before the grid is laid beside these
    import pyarrow as pa
    pa.default_memory_pool().release_unused()
    position = _positions(jobs)
    step = ops["step"]
    keep = (step >= lo) & (step <= hi)
    if not every:
        keep &= np.isin(step, steps)
    if not keep.all():
        ops = {c: v[keep] for c, v in ops.items()}
        position = position[keep]
    if not len(position):
        return Partition(ops, position, layout.directory, rows_read, bytes_read)
    # the ranges only: whether every stage holds ops is a question for the whole run (assemble)
    every_stage = np.arange(layout.meta.pp_size, dtype=ops["stage"].dtype)
    check_against_meta({"rank": ops["rank"], "dp_rank": ops["dp_rank"],
                        "stage": np.concatenate([ops["stage"], every_stage])},
                       layout.meta, layout.directory, Path(layout.directory) / "meta.json")
    # each row's process group one of the run's listed groups, holding its rank (as read_run)
    check_process_groups(ops, layout.meta, Path(layout.directory))
    return Partition(ops, position, layout.directory, rows_read, bytes_read)


# Optional columns the partitioned analysis reads: the diagnosis's and the grid's process
# groups; the others (bytes) stay on disk.
ANALYSED_OPTIONAL = tuple(c for c in OPTIONAL_COLUMNS if c in DIAGNOSIS_COLUMNS or c == "pg")


def read_columns(layout: RunLayout) -> list[str]:
    """The columns a partition reads: the required ones and the optional ones analysed."""
    return list(COLUMNS) + [c for c in layout.optional if c in ANALYSED_OPTIONAL]


def _read_table(path: str, groups: list[int], columns: list[str]):
    """(Arrow table, compressed bytes decoded) of row groups of one rank file (the columns of
    `columns` it has), on this thread: the reading threads are the caller's, not Arrow's nested
    in each (2 cores)."""
    import pyarrow as pa

    md = _metadata(path)   # (walked below: screened first, and the reader given it)
    try:
        f = _parquet(path, md)
        names = f.schema_arrow.names          # (schema_arrow is rebuilt on every access)
        use = [c for c in columns if c in names]
        table = f.read_row_groups(groups, columns=use, use_threads=False)
        at = [names.index(c) for c in use]
        # (an Arrow column is one Parquet leaf column in the op tables: no nested types)
        return table, sum(md.row_group(g).column(i).total_compressed_size
                          for g in groups for i in at)
    except FileNotFoundError:
        raise InputError(path, None, "no such file") from None
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(path, None, f"not a readable Parquet file ({first})") from None


def _columns_at_once(layout: RunLayout, tables: list) -> dict[str, np.ndarray] | None:
    """The files' tables checked and converted as one (one pass per column, not one per file
    and column); None where their schemas differ or a value is refused (the file-by-file path
    then names the file)."""
    import pyarrow as pa

    from stragglers.trace.columns import table_to_columns

    try:
        table = pa.concat_tables(tables)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    try:
        cols = table_to_columns(table, layout.directory)
    except InputError:
        return None
    del table
    return _filled(layout, cols)


def _columns_by_file(layout: RunLayout, paths: list[str], tables: list
                     ) -> dict[str, np.ndarray]:
    """Each file's table checked and converted on its own (errors name the file), joined."""
    from stragglers.trace.columns import table_to_columns

    got = [_filled(layout, table_to_columns(t, p)) for p, t in zip(paths, tables)]
    return {c: np.concatenate([g[c] for g in got]) for c in got[0]}


def _filled(layout: RunLayout, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The optional columns analysed that some file of the run has, filled where these rows
    lack them; the others dropped."""
    n = len(cols["step"])
    out = {c: cols[c] for c in COLUMNS}
    for c in layout.optional:
        if c in ANALYSED_OPTIONAL:
            out[c] = cols[c] if c in cols else np.full(n, OPTIONAL_FILL[c],
                                                        dtype=OPTIONAL_COLUMNS[c])
    return out


def _positions(jobs: list) -> np.ndarray:
    """file index << 40 | row in file of every row the jobs' row groups hold, in read order."""
    first = np.array([(i << 40) + g[0] for i, _, groups in jobs for _, g in groups], np.int64)
    rows = np.array([g[1] for _, _, groups in jobs for _, g in groups], np.int64)
    before = np.cumsum(rows) - rows          # rows read before each group
    return np.repeat(first - before, rows) + np.arange(int(rows.sum()), dtype=np.int64)


def node_keys(part: Partition) -> np.ndarray:
    """The (stage, optype, seq) key of every row, gc pauses keyed by their slot (grid.build_grid)."""
    ops = part.ops
    seq = ops["seq_id"].astype(np.int64)
    is_gc = ops["optype"] == GC
    if is_gc.any():
        _, d_idx = dense_ids(ops["dp_rank"])
        step_ids, t_idx = dense_ids(ops["step"])
        worker_step = (d_idx.astype(np.int64) * (int(ops["stage"].max()) + 1)
                       + ops["stage"]) * len(step_ids) + t_idx
        trace = Trace(ops, None, part.source)  # type: ignore[arg-type]
        seq = np.where(is_gc, gc_slots(trace, worker_step), seq)
    if len(seq) and (seq.min() < 0 or seq.max() >= (1 << _SEQ_BITS)):
        raise InputError(part.source, "seq_id", f"expected 0 ≤ seq_id < {1 << _SEQ_BITS}")
    if len(seq):   # (a step partition holds whole steps: realigned as the whole trace is)
        dp_ranks, d_idx = dense_ids(ops["dp_rank"])
        step_ids, t_idx = dense_ids(ops["step"])
        again = realigned_seq(ops, seq, d_idx, t_idx, len(dp_ranks), len(step_ids),
                              int(ops["mc"].max()) > 0)
        seq = seq if again is None else again
    return ((ops["stage"].astype(np.int64) << (_SEQ_BITS + _OPTYPE_BITS))
            | (ops["optype"].astype(np.int64) << _SEQ_BITS) | seq)


@dataclass
class PartitionSummary:
    """What the driver needs from a partition to agree on the job's template."""

    keys: np.ndarray             # sorted template keys
    last_position: np.ndarray    # [K] position of each key's last row
    last_mc: np.ndarray          # [K] mc of that row
    last_gmc: np.ndarray         # [K] gmc of that row
    dp_ranks: np.ndarray
    cells: np.ndarray            # unique dp_rank·pp_size + stage (job_info)
    ranks: np.ndarray            # unique global ranks
    stages: np.ndarray
    rows: int
    rows_read: int = 0           # rows decoded to read it (Partition.rows_read)
    bytes_read: int = 0          # compressed bytes decoded


def summarise(part: Partition, pp_size: int, keys: np.ndarray | None = None,
              node: np.ndarray | None = None) -> PartitionSummary:
    """The partition's template keys, DP ranks and the facts job_info reads (`keys`, `node`:
    node_keys(part) and each row's index in their sorted unique values, where known)."""
    ops = part.ops
    keys = node_keys(part) if keys is None else keys
    if node is not None and _increasing(part.position):
        # rows in run order (read_partition's): a key's last row is its highest row index
        uniq = np.zeros(int(node.max()) + 1 if len(node) else 0, dtype=keys.dtype)
        uniq[node] = keys
        rows = np.full(len(uniq), -1, dtype=np.int64)
        np.maximum.at(rows, node, np.arange(len(node), dtype=np.int64))
    else:
        order = np.lexsort((part.position, keys))
        k = keys[order]
        last = np.ones(len(k), bool)
        last[:-1] = k[1:] != k[:-1]
        uniq, rows = k[last], order[last]
    cells = _unique(ops["dp_rank"].astype(np.int64) * pp_size + ops["stage"])
    return PartitionSummary(uniq, part.position[rows], ops["mc"][rows], ops["gmc"][rows],
                            _unique(ops["dp_rank"]), cells, _unique(ops["rank"]),
                            _unique(ops["stage"]), len(keys), part.rows_read, part.bytes_read)


def _increasing(values: np.ndarray) -> bool:
    """Whether values are strictly increasing."""
    return bool(np.all(values[1:] > values[:-1]))


def _unique(values: np.ndarray) -> np.ndarray:
    """np.unique of integers, by a table where their range is small (ranks, stages: O(n))."""
    if not len(values):
        return values[:0]
    lo, hi = int(values.min()), int(values.max())
    if hi - lo >= _DENSE_RANGE:
        return np.unique(values)
    seen = np.zeros(hi - lo + 1, dtype=bool)
    seen[values - lo] = True
    return (np.flatnonzero(seen) + lo).astype(values.dtype)


# Integer ranges _unique counts by a table (bytes of that table); beyond, np.unique sorts.
_DENSE_RANGE = 1 << 24


def _key_index(keys: np.ndarray) -> np.ndarray:
    """Each key's index in the sorted unique keys: by a table on (stage, optype, seq) packed
    densely (O(n), no sort), where that packing is small."""
    seq = keys & ((1 << _SEQ_BITS) - 1)
    kind = keys >> _SEQ_BITS                        # stage · 2^optype bits + optype
    span = int(seq.max()) + 1
    if (int(kind.max()) + 1) * span < _DENSE_RANGE:
        # the packed value orders like the key: (stage, optype) first, then seq
        return dense_ids(kind * span + seq)[1]
    return np.unique(keys, return_inverse=True)[1]


@dataclass
class Template:
    """The job's template ops and DP ranks, agreed over every partition."""

    keys: np.ndarray
    dp_ranks: np.ndarray
    node_mc_raw: np.ndarray      # mc / gmc of each key's last row in the whole trace
    node_gmc_raw: np.ndarray


def merge_summaries(summaries: list[PartitionSummary]) -> Template:
    """One template from the partitions' (each key's values from its last row in the run)."""
    keys = np.concatenate([s.keys for s in summaries])
    pos = np.concatenate([s.last_position for s in summaries])
    mc = np.concatenate([s.last_mc for s in summaries])
    gmc = np.concatenate([s.last_gmc for s in summaries])
    order = np.lexsort((pos, keys))
    k = keys[order]
    last = np.ones(len(k), bool)
    last[:-1] = k[1:] != k[:-1]
    rows = order[last]
    dp = np.unique(np.concatenate([s.dp_ranks for s in summaries]))
    return Template(k[last], dp, mc[rows], gmc[rows])


@dataclass
class PlacedPartition:
    """A partition on the job's grid: every step of it, complete or not."""

    steps: np.ndarray            # [Tp]
    start: np.ndarray            # [N, D, Tp]
    duration: np.ndarray
    present: np.ndarray
    row: np.ndarray              # index into `columns` (-1 where absent)
    pg: np.ndarray | None        # [N, D] max pg over the partition's steps (-1 none)
    columns: dict[str, np.ndarray]   # DIAGNOSIS_COLUMNS of the partition's rows
    keys: np.ndarray             # [N] the template ops it was laid on
    dp_ranks: np.ndarray         # [D] ... and DP ranks


def place(part: Partition, template: Template, node: np.ndarray | None = None
          ) -> PlacedPartition:
    """Lay the partition's rows on the template's grid; two rows in one cell are refused
    (`node`: each row's template op, where known)."""
    ops = part.ops
    n, d = len(template.keys), len(template.dp_ranks)
    if node is None:
        node = np.searchsorted(template.keys, node_keys(part))
    d_idx = np.searchsorted(template.dp_ranks, ops["dp_rank"])
    steps, t_idx = dense_ids(ops["step"])
    t = len(steps)
    flat = (node.astype(np.int64) * d + d_idx) * t + t_idx
    counts = one_op_per_cell(flat, n * d * t, Trace(ops, None, part.source))  # type: ignore[arg-type]
    start = np.full(n * d * t, np.nan)
    start[flat] = ops["start_ts"]
    duration = np.zeros(n * d * t)
    duration[flat] = ops["duration"]
    row = np.full(n * d * t, -1, dtype=ROW)
    row[flat] = np.arange(len(flat), dtype=ROW)
    pg = None
    if "pg" in ops:
        cell = np.full(n * d * t, -1, dtype=np.int64)
        cell[flat] = ops["pg"]
        pg = cell.reshape(n, d, t).max(axis=2)
    shape = (n, d, t)
    columns = {c: ops[c] for c in DIAGNOSIS_COLUMNS if c in ops}
    return PlacedPartition(steps, start.reshape(shape), duration.reshape(shape),
                           (counts > 0).reshape(shape), row.reshape(shape), pg, columns,
                           template.keys, template.dp_ranks)


def read_and_place(layout: RunLayout, steps: np.ndarray, pool=None
                   ) -> tuple[PartitionSummary, PlacedPartition | None]:
    """One step partition read, summarised and laid on a grid of its own template ops and DP
    ranks (assemble lays it on the job's): one pass over the run, no partition kept."""
    return place_partition(layout, read_partition(layout, steps, pool))


def place_partition(layout: RunLayout, part: Partition
                    ) -> tuple[PartitionSummary, PlacedPartition | None]:
    """A partition read, summarised and laid on a grid of its own template ops and DP ranks."""
    if not len(part.position):
        return summarise(part, layout.meta.pp_size), None
    keys = node_keys(part)
    node = _key_index(keys)            # (the keys once: summarise and place both need them)
    summary = summarise(part, layout.meta.pp_size, keys, node)
    own = Template(summary.keys, summary.dp_ranks, summary.last_mc, summary.last_gmc)
    return summary, place(part, own, node)


def on_template(p: PlacedPartition, template: Template) -> PlacedPartition:
    """A placed partition on the job's template (a partition may lack some ops or DP ranks)."""
    if np.array_equal(p.keys, template.keys) and np.array_equal(p.dp_ranks, template.dp_ranks):
        return p
    at = np.ix_(np.searchsorted(template.keys, p.keys),
                np.searchsorted(template.dp_ranks, p.dp_ranks))
    shape = (len(template.keys), len(template.dp_ranks), len(p.steps))

    def spread(values, fill, dtype, dims=shape):
        out = np.full(dims, fill, dtype=dtype)
        out[at] = values
        return out

    return PlacedPartition(p.steps, spread(p.start, np.nan, float), spread(p.duration, 0.0, float),
                           spread(p.present, False, bool), spread(p.row, -1, p.row.dtype),
                           None if p.pg is None else spread(p.pg, -1, np.int64, shape[:2]),
                           p.columns, template.keys, template.dp_ranks)


# --- the job assembled (driver) ----------------------------------------------------------
@dataclass
class Assembled:
    """The job's grid (complete steps), the trace rows the diagnosis reads, the job's facts."""

    grid: OpGrid
    trace: Trace                 # DIAGNOSIS_COLUMNS of the partitions' rows; grid.row indexes it
    job_trace: Any               # what job_info reads: unique cells and ranks of the whole run


def assemble(layout: RunLayout, template: Template, placed: list[PlacedPartition],
             summaries: list[PartitionSummary]) -> Assembled:
    """The grid build_grid would make of the whole run, from its partitions (in step order;
    their grid arrays are consumed: each is freed once copied into the job's)."""
    meta = layout.meta
    keys = template.keys
    node_stage = (keys >> (_SEQ_BITS + _OPTYPE_BITS)).astype(np.int32)
    node_optype = ((keys >> _SEQ_BITS) & ((1 << _OPTYPE_BITS) - 1)).astype(np.int8)
    node_seq = (keys & ((1 << _SEQ_BITS) - 1)).astype(np.int64)
    stages = np.unique(np.concatenate([s.stages for s in summaries]))
    from stragglers.trace.runformat import check_against_meta
    check_against_meta({"dp_rank": template.dp_ranks, "stage": stages}, meta, layout.directory,
                       Path(layout.directory) / "meta.json")
    placed = [on_template(p, template) for p in placed]
    steps = np.concatenate([p.steps for p in placed])
    present = np.concatenate([p.present for p in placed], axis=2)
    warnings: list[str] = []
    dp_ranks, mc_raw, gmc_raw = template.dp_ranks, template.node_mc_raw, template.node_gmc_raw
    interleaved = meta.vpp_size > 1 or int(mc_raw.max(initial=0)) > 0
    complete = _complete_steps(present, node_optype, node_stage, dp_ranks, steps, warnings,
                               node_seq, interleaved)
    odd = None
    if not complete.any():
        odd = leave_out_odd(present, node_optype, node_stage, node_seq, dp_ranks, steps,
                            _placed_ranks(placed, node_stage, len(dp_ranks)), interleaved)
        if odd is None:
            raise InputError(layout.directory, None, "no step has ops from every worker; "
                             + (warnings[0] if warnings else "cannot analyse"))
        if odd.lost is not None and odd.lost.any():
            _rebuild(placed, present, odd, node_stage, node_optype, node_seq)
        # (the odd workers' replicas, and ops only they ran, left out as build_grid does)
        present, complete, warnings = odd.present, odd.complete, odd.warnings
        at = np.ix_(odd.keep_nodes, odd.keep_dp)
        for p in placed:
            p.start, p.duration, p.row = p.start[at], p.duration[at], p.row[at]
            p.pg = None if p.pg is None else p.pg[at]
        node_stage, node_optype, node_seq, mc_raw, gmc_raw = (
            a[odd.keep_nodes] for a in (node_stage, node_optype, node_seq, mc_raw, gmc_raw))
        dp_ranks = dp_ranks[odd.keep_dp]
    present = present[:, :, complete]
    offsets = np.cumsum([0] + [len(p.columns["rank"]) for p in placed])
    if offsets[-1] > np.iinfo(ROW).max:
        raise InputError(layout.directory, None, f"{offsets[-1]:,} ops in the analysed steps; "
                         f"expected at most {np.iinfo(ROW).max:,} (select fewer with --steps)")
    for p, off in zip(placed, offsets):   # (a copy: arrays from Dask workers are read-only)
        p.row = np.where(p.row >= 0, p.row + ROW(off), ROW(-1))
    start = _joined(placed, "start", complete)
    duration = _joined(placed, "duration", complete)
    row = _joined(placed, "row", complete)
    columns = {c: np.concatenate([p.columns[c] for p in placed]) for c in placed[0].columns}
    pp = max(meta.pp_size, int(node_stage.max()) + 1)
    node_mc = np.maximum(mc_raw, 0).astype(np.int64)
    node_gmc = gmc_raw.astype(np.int64)
    node_gmc = np.where(node_gmc < 0, node_mc * pp + node_stage, node_gmc)
    vpp = max(meta.vpp_size, int(node_mc.max()) + 1)
    node_pg = None
    pgs = [p.pg for p in placed if p.pg is not None]
    if pgs and len(pgs) == len(placed):
        node_pg = np.max(np.stack(pgs), axis=0)
    grid = OpGrid(node_stage, node_optype, node_seq, dp_ranks, steps[complete],
                  start, duration, present, row, pp_size=pp, node_mc=node_mc, node_gmc=node_gmc,
                  vpp_size=vpp, warnings=warnings,
                  compute_by_index=bool(meta.extra.get("compute_split_at_collectives")),
                  node_pg=node_pg, left_out=[] if odd is None else odd.left_out)
    reference_chunks(grid, columns["mc"], columns.get("gmc"))
    trace = Trace(columns, meta, layout.directory, list(layout.notes))
    _check_stages(grid, trace)
    cells = np.unique(np.concatenate([s.cells for s in summaries]))
    job_trace = Trace({"dp_rank": cells // pp, "stage": cells % pp,
                       "rank": np.unique(np.concatenate([s.ranks for s in summaries])),
                       "step": cells}, meta, layout.directory, list(layout.notes))
    return Assembled(grid, trace, job_trace)


def _rebuild(placed: list[PlacedPartition], present: np.ndarray, odd: LeftOdd,
             node_stage: np.ndarray, node_optype: np.ndarray, node_seq: np.ndarray) -> None:
    """The collectives some workers lost rebuilt there, as build_grid rebuilds them
    (whatif/rebuild.py), partition by partition, in place: the partitions' cells, `present`
    (every op, every step) and odd's kept ops, present and first warning. (Left out instead,
    a healthy rank's wait for a straggler in a collective it lost became a launch delay: a run
    directory named it a host stall where the trace read whole did not.)"""
    if odd.lost is None:
        return
    parts, at = [], 0
    for p in placed:
        t = p.present.shape[2]
        for name in ("start", "duration", "row"):   # (arrays from Dask workers are read-only)
            if not getattr(p, name).flags.writeable:
                setattr(p, name, getattr(p, name).copy())
        parts.append((p.start, p.duration, p.row, present[:, :, at:at + t],
                      odd.complete[at:at + t]))
        at += t
    rebuilt = rebuild_in_parts(parts, node_stage, node_optype, node_seq, odd.lost)
    if rebuilt.any():   # (kept, with every worker's cell and a cross-stage group's other ends)
        rebuilt = with_group(rebuilt, odd.keep_nodes, node_optype, node_seq)
        odd.keep_nodes = odd.keep_nodes | rebuilt
        odd.present = present[odd.keep_nodes]
        odd.warnings[0] = ops_warning(odd.said, ~odd.keep_nodes | rebuilt, rebuilt)


def _placed_ranks(placed: list[PlacedPartition], node_stage: np.ndarray, d: int) -> np.ndarray:
    """[D, P] the global rank of each worker in the placed partitions (-1: none)."""
    out = np.full((d, int(node_stage.max()) + 1), -1, dtype=np.int64)
    for p in placed:
        n, a, _ = np.nonzero(p.row >= 0)
        out[a, node_stage[n]] = p.columns["rank"][p.row[p.row >= 0]]
    return out


def _joined(placed: list[PlacedPartition], name: str, complete: np.ndarray) -> np.ndarray:
    """The partitions' `name` arrays joined along steps (complete steps only), each freed once
    copied: the job's grid is built beside one array of it, not beside a second grid."""
    first = getattr(placed[0], name)
    out = np.empty(first.shape[:2] + (int(complete.sum()),), dtype=first.dtype)
    at = to = 0
    for p in placed:
        values = getattr(p, name)
        keep = complete[at:at + values.shape[2]]
        at += values.shape[2]
        out[:, :, to:to + int(keep.sum())] = values if keep.all() else values[:, :, keep]
        to += int(keep.sum())
        setattr(p, name, None)
    return out


# --- replays by step partition -----------------------------------------------------------
@dataclass
class ReplayShard:
    """What one worker holds to replay its steps: the plan, costs and delays of those steps."""

    plan: ReplayPlan
    cost: np.ndarray             # [N, D, Ts]
    delay: np.ndarray            # [N, D, Ts]
    ideal: np.ndarray            # [N, 1, 1]
    step_start: np.ndarray       # [Ts]
    scratch: Scratch = field(default_factory=lambda: Scratch(), repr=False, compare=False)

    def restored(self, nodes: np.ndarray) -> np.ndarray:
        """Per-step times with ideal costs except `nodes` (bool [N]) measured."""
        cost = self.scratch.ideal_cells(self)
        cost[nodes] = self.cost[nodes]
        try:
            return replay(self.plan, cost, self.step_start)
        finally:
            cost[nodes] = np.broadcast_to(self.ideal, self.cost.shape)[nodes]


class Scratch:
    """A buffer of ideal costs the 'restored' replays of shards share (each sets its rows to
    measured and back): one buffer for a job's shards in a process, not one per replay. A
    shard's replays run one at a time (replay_all waits for each). Never pickled."""

    def __init__(self) -> None:
        self.owner: ReplayShard | None = None
        self.buffer: np.ndarray | None = None

    def __getstate__(self) -> dict:
        return {}

    def __setstate__(self, state: dict) -> None:
        self.owner, self.buffer = None, None

    def release(self) -> None:
        """Free the buffer (the next 'restored' replay makes a new one)."""
        self.owner, self.buffer = None, None

    def ideal_cells(self, shard: ReplayShard) -> np.ndarray:
        """The shard's cells at ideal cost (the buffer refilled when the shard changes)."""
        if self.owner is shard and self.buffer is not None:
            return self.buffer
        if self.buffer is None or self.buffer.shape != shard.cost.shape:
            self.buffer = None               # the old one freed before the new one is made
            self.buffer = np.empty(shard.cost.shape)
        np.copyto(self.buffer, np.broadcast_to(shard.ideal, shard.cost.shape))
        self.owner = shard
        return self.buffer


def shard_replay(shard: ReplayShard, kind: str, nodes: np.ndarray | None = None) -> np.ndarray:
    """Per-step times of one replay of the shard's steps ([Ts], or [D, Ts] for `pairs`).

    kind: "delay" (measured, launch delays), "nodelay", "ideal", "restored" (ideal but
    `nodes` measured), "pairs" (each DP rank measured next to one ideal replica).
    """
    s = shard
    if kind != "restored":
        s.scratch.release()        # the 'restored' series is over: its buffer is not kept
    if kind == "delay":
        return replay(s.plan, s.cost, s.step_start, s.delay)
    if kind == "nodelay":
        return replay(s.plan, s.cost, s.step_start)
    if kind == "ideal":
        return replay(s.plan, s.ideal, s.step_start)
    if kind == "restored":
        if nodes is None:
            raise ValueError("a 'restored' replay needs the nodes kept measured")
        return s.restored(nodes)
    if kind == "pairs":
        n, d, t = s.cost.shape
        pairs = np.empty((n, d, 2, t))
        pairs[:, :, 0, :] = s.cost
        pairs[:, :, 1, :] = s.ideal
        return replay(s.plan, pairs.reshape(n, 2 * d, t), s.step_start, jobs=d)
    raise ValueError(f"unknown replay kind {kind!r}")


# A function that runs shard_replay(kind, nodes) on every shard and returns the per-step
# results concatenated along the step axis, in step order.
ReplayAll = Callable[[str, "np.ndarray | None"], np.ndarray]


@dataclass
class PartitionedWhatIf(WhatIf):
    """A WhatIf whose attribution replays run by step partition (same numbers, bit for bit:
    the per-step times are the whole job's, and every mean is taken over all of them)."""

    # always set by its maker; a dataclass field after defaulted ones needs a default
    replay_all: ReplayAll = field(default=None, repr=False)  # type: ignore[assignment]

    def restored(self, nodes: np.ndarray) -> float:
        """S_g, replayed by step partition."""
        return float(self.replay_all("restored", nodes).mean() / self.t_ideal.mean())

    def by_dp_rank(self) -> dict[int, float]:
        """S per DP rank, every rank's pair replayed by step partition in one pass."""
        self.progress(f"attribution: {len(self.grid.dp_ranks)} dp ranks")
        d = len(self.grid.dp_ranks)
        times = self.replay_all("pairs", None)
        ratio = np.reshape(times, (d, -1)).mean(axis=1) / self.t_ideal.mean()
        return {int(r): float(v) for r, v in zip(self.grid.dp_ranks, ratio)}


def make_builder(load: Callable[[ReplayPlan, np.ndarray, np.ndarray, np.ndarray, np.ndarray],
                                ReplayAll]) -> Callable[..., WhatIf]:
    """A WhatIf.build whose replays run on the shards `load` places (it returns replay_all)."""
    from stragglers.whatif.metrics import model_and_costs
    from stragglers.whatif.timing import base_step_times

    def build(grid: OpGrid, dsp_size: int = 1, progress=None) -> WhatIf:
        """The model, costs and ideal costs of the job; the three top-level replays by shard."""
        tick = progress or (lambda _msg: None)
        model, plan, cost, delay, gaps, start, ideal, values, left = model_and_costs(
            grid, dsp_size, tick)
        replay_all = load(plan, cost, delay, ideal, start)
        tick("replay with launch delays")
        t_replay = replay_all("delay", None)
        tick("replay without launch delays")
        t_nodelay = replay_all("nodelay", None)
        tick("ideal replay")
        t_ideal = replay_all("ideal", None)
        return PartitionedWhatIf(grid, model, cost, ideal, values, start, base_step_times(grid),
                                 t_replay, t_nodelay, t_ideal, delay, gaps, plan, tick,
                                 computes_left_out=left, replay_all=replay_all)

    return build


# --- the analysis of a run by step partitions (driver) -----------------------------------
# (layout, partitions, progress) → [(summary, placed partition or None)] in step order
ReadAll = Callable[[RunLayout, list, Callable[[str], None]], list]
# threads reading one partition's rank files here (Parquet decoding releases the GIL)
READ_THREADS = 4


def analyze_run(path: Path | str, steps=None, progress: Callable[[str], None] | None = None,
                config=None, *, read_all: ReadAll | None = None, load=None,
                partitions: int | None = None, min_partitions: int = 1,
                where: str = "in this process"):
    """(AnalysisResult, WhatIf) of a run directory by step partitions: the numbers of
    analyze_with_model(read_run(path)), the trace never held whole (only the grid the
    diagnosis reads). `read_all` reads and places the partitions (default: one at a time in
    this process), `load` places the replay shards (default: step slices here);
    whatif/dask_runner.py gives both on a cluster. `partitions` default: enough to keep one
    partition's reading under PARTITION_BYTES, at least `min_partitions`."""
    from stragglers.whatif._analyze import analyze_grid
    from stragglers.whatif.config import DEFAULT

    cfg = config or DEFAULT
    tick = progress or (lambda _msg: None)
    if isinstance(steps, str) and steps != "all":
        raise InputError(path, "steps", f"expected a list of steps, None or 'all', got {steps!r}")
    layout = run_layout(path, None if isinstance(steps, str) else steps)
    if not partitions:   # a multiple of min_partitions: as many partitions on every worker
        need = partitions_for(layout)
        partitions = max(1, min_partitions) * -(-need // max(1, min_partitions))
    parts = step_partitions(layout.steps, partitions, layout)
    tick(f"reading {len(layout.files)} rank files in {len(parts)} step partitions {where}")
    got = (read_all or read_here)(layout, parts, tick)
    summaries = [s for s, _ in got]
    placed = [p for _, p in got if p is not None]
    del got
    tick(f"read {sum(s.rows_read for s in summaries):,} rows "
         f"({sum(s.bytes_read for s in summaries):,} bytes) for "
         f"{sum(s.rows for s in summaries):,} ops of the selected steps")
    if not placed:
        raise InputError(layout.directory, "step", "the selected steps hold no ops")
    template = merge_summaries(summaries)
    tick("assembling the grid")
    job = assemble(layout, template, placed, summaries)
    del placed
    # the partitions' columns, read into Arrow's pool, are copied into the job's: hand their
    # pages back (the pool keeps freed pages for reuse: 0.15 GB through the analysis at 16M ops)
    import pyarrow as pa
    pa.default_memory_pool().release_unused()
    return analyze_grid(job.trace, job.grid, steps, tick, cfg, build=make_builder(load or shards_here),
                        job_trace=job.job_trace)


def read_here(layout: RunLayout, parts: list, tick: Callable[[str], None]) -> list:
    """ReadAll in this process: one partition at a time, its files on a few threads (reading
    the next partition while this one is laid on the grid gained no wall time on 2 shared
    cores and held two partitions: 1.67 vs 1.47 GB at 16M ops)."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow as pa

    out = []
    with ThreadPoolExecutor(READ_THREADS) as pool:
        for i, steps in enumerate(parts, 1):
            out.append(read_and_place(layout, steps, pool))
            # Arrow keeps freed buffers for reuse: hand them back before the next partition
            pa.default_memory_pool().release_unused()
            tick(f"{i}/{len(parts)} step partitions read")
    return out


def shards_here(plan: ReplayPlan, cost: np.ndarray, delay: np.ndarray, ideal: np.ndarray,
                start: np.ndarray) -> ReplayAll:
    """The replay_all of step slices of the costs in this process: an attribution replay's
    copies (restored costs, pairs of replicas) are a slice's, not the job's."""
    from stragglers.whatif._replay import CHUNK_BYTES

    n, d, t = cost.shape
    span = max(1, CHUNK_BYTES // max(1, n * d * 16))   # 'pairs' replays twice the DP ranks
    shared = Scratch()     # one buffer for every slice's 'restored' replays
    shards = [ReplayShard(plan, cost[:, :, lo:lo + span], delay[:, :, lo:lo + span], ideal,
                          start[lo:lo + span], shared) for lo in range(0, t, span)]

    def replay_all(kind: str, nodes) -> np.ndarray:
        """One replay on every slice, per-step results in step order."""
        return np.concatenate([shard_replay(s, kind, nodes) for s in shards], axis=-1)

    return replay_all
