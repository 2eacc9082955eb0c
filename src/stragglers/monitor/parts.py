"""One part (a flushed Parquet file of one rank): names, and the checks before it is stored."""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import stat
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stragglers.errors import InputError
from stragglers.monitor.pages import check_pages
from stragglers.trace.columns import (MAX_SECONDS, beyond_clock, check_finite_times,
                                      optype_codes, table_to_columns)
from stragglers.trace.model import COLUMNS, OPTIONAL_COLUMNS
from stragglers.trace.runformat import RANK_FILE, rank_file_name

# Job names become directory names: letters, digits, '.', '_', '-', no leading dot, bounded.
JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MAX_RANK = 9_999_999
MAX_PART = 999_999
MAX_WINDOW = 2**63 - 1  # a window index in a request: SQLite's largest integer
MAX_PART_ROWS = 1_000_000   # rows in one part (a recorder's flush holds hundreds to thousands)
# bytes a part may take once decoded, bounded from its footer before any page is decoded: the
# columns' declared uncompressed sizes plus 8 bytes per row and column of Arrow buffers (the op
# type is read as a dictionary, so 1M rows of one 1,000-byte name stay ~4 MB)
MAX_DECODED_BYTES = 384 * 2**20
MAX_PART_FILE_BYTES = 1 << 30   # a watched part file (an upload is bounded by max_part_bytes)
# a part's steps may lie at most this far past the job's steps seen so far (or apart from each
# other): one wild number (a step of 2**63-1) would otherwise become the job's last analysed
# step, and every later row would be dropped as late
MAX_STEP_GAP = 1_000_000
# the largest step taken: past 2**53 a JSON reader (the dashboard) no longer holds a step
# exactly, and no training runs that long; a first part at 2**63-1 has no earlier step to be
# judged against by MAX_STEP_GAP
MAX_STEP = 2**53 - 1
ALLOWED_COLUMNS = (*COLUMNS, *OPTIONAL_COLUMNS)
# a part's Parquet footer (a recorder's is a few kB): a larger one is refused before it is
# parsed (its thrift decoding allocates per declared column and row group)
MAX_FOOTER_BYTES = 4 << 20


def footer_length(tail: bytes) -> int | None:
    """The footer length a Parquet file's last 8 bytes give, None when they are not Parquet's."""
    if len(tail) != 8 or tail[4:] != b"PAR1":
        return None
    return int.from_bytes(tail[:4], "little")


class PartConflict(InputError):
    """A part number already stored with other bytes: answered 409, nothing is replaced."""


def fingerprint(body: bytes) -> str:
    """The digest that tells a retried upload (same bytes) from a different part."""
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def check_same_part(stored: str | None, digest: str | None, job: str, rank: int,
                    part: int) -> None:
    """PartConflict when an upload reuses a stored part's number with different bytes."""
    if stored is not None and digest is not None and stored != digest:
        raise PartConflict(f"part {job}/{rank}/{part}", None,
                           f"part {part} of rank {rank} is already stored with different "
                           "content; a restarted job that numbers its parts from 0 again "
                           "needs a new job name (nothing was replaced)")


def check_job_name(job: str, source: object = "job") -> str:
    """The job name if it is safe as a directory name, else InputError naming the problem."""
    if not isinstance(job, str) or not JOB_NAME.match(job) or ".." in job:
        raise InputError(source, "job", f"{str(job)[:80]!r} is not a valid job name: expected "
                         "1-128 letters, digits, '.', '_' or '-', starting with a letter or digit, "
                         "without '..' or path separators")
    return job


def parse_part_name(name: str) -> tuple[int, int] | None:
    """(rank, part) of a `rank-RRRRR.part-PPPPPP.parquet` file name, None for other files."""
    m = RANK_FILE.match(name)
    if m is None:
        return None
    return int(m[1]), int(m[2]) if m[2] is not None else 0


def is_whole_rank_file(path: Path | None) -> bool:
    """Whether a part file is a whole rank's ops (rank-RRRRR.parquet), written once a run ended."""
    if path is None:
        return False
    m = RANK_FILE.match(path.name)
    return m is not None and m[2] is None


def part_path(directory: Path, rank: int, part: int) -> Path:
    """Where a stored part's file is: its part file, or for part 0 a whole-rank file
    (rank-RRRRR.parquet names part 0 too; rebuilding the part-file name for it lost a watched
    run's unanalysed tail at every restart)."""
    path = directory / rank_file_name(rank, part)
    if part == 0 and not os.path.lexists(path):
        whole = directory / rank_file_name(rank)
        if os.path.lexists(whole):
            return whole
    return path


@dataclass
class PartData:
    """A checked part: its op columns and what the store keeps about it."""

    rank: int
    part: int
    columns: dict[str, np.ndarray]
    nbytes: int

    @property
    def records(self) -> int:
        return int(len(self.columns["step"]))

    @property
    def first_step(self) -> int:
        return int(self.columns["step"].min()) if self.records else -1

    @property
    def last_step(self) -> int:
        return int(self.columns["step"].max()) if self.records else -1


def check_part(table: pa.Table, source: object, rank: int, part: int, nbytes: int) -> PartData:
    """Validate an op table as one rank's part (schema, values, and that it is that rank's)."""
    cols = table_to_columns(table, source)
    if len(cols["rank"]) and (cols["rank"] != rank).any():
        other = int(cols["rank"][cols["rank"] != rank][0])
        raise InputError(source, "rank", f"rows of rank {other} in a part of rank {rank}; "
                         "expected one rank per part")
    return PartData(rank, part, cols, nbytes)


def check_in_job(data: PartData, meta, source: object) -> None:
    """InputError when a part's rows sit at a stage or DP rank its job's meta does not have
    (the part is refused alone, rather than failing every window it would be analysed in)."""
    for column, size, name in (("stage", meta.pp_size, "pp_size"),
                               ("dp_rank", meta.dp_size, "dp_size")):
        values = data.columns[column]
        bad = np.flatnonzero(values >= size)
        if len(bad):
            raise InputError(source, column, f"value {int(values[bad[0]])} at row {int(bad[0])}; "
                             f"expected < {size} (the job's {name})")


def check_parts(tables: list[pa.Table], sources: list, ids: list[tuple[int, int]],
                nbytes: list[int]) -> list[PartData | InputError]:
    """Validate many parts at once: each result is the part's PartData or the InputError that
    names what is wrong with it.

    Parts with the same columns are concatenated and checked as one table: checking a column
    costs the same fixed overhead for 2,000 rows as for 2,000,000, and that overhead was most
    of the ingest time. Only a group that fails is checked again part by part, to name the part.
    """
    out: list[PartData | InputError | None] = [None] * len(tables)
    groups: dict[tuple, list[int]] = {}
    for i, t in enumerate(tables):
        groups.setdefault(tuple((f.name, str(f.type)) for f in t.schema), []).append(i)
    for members in groups.values():
        try:
            cols = _check_group([tables[i] for i in members], [ids[i][0] for i in members])
        except (InputError, pa.ArrowException, ValueError):
            for i in members:  # one of them is bad: find which, keep the others
                out[i] = _guarded(lambda t: check_part(t, sources[i], *ids[i], nbytes[i]),
                                  tables[i], sources[i])
            continue
        start = 0
        for i in members:
            end = start + tables[i].num_rows
            # copies, not views: a part held until its window closes must not pin the batch
            out[i] = PartData(*ids[i], {k: v[start:end].copy() for k, v in cols.items()},
                              nbytes[i])
            start = end
    return out


def _check_group(tables: list[pa.Table], ranks: list[int]) -> dict[str, np.ndarray]:
    big = pa.concat_tables(tables).unify_dictionaries().combine_chunks()
    cols = table_to_columns(big, "batch")
    expected = np.repeat(np.asarray(ranks, dtype=cols["rank"].dtype),
                         [t.num_rows for t in tables])
    if (cols["rank"] != expected).any():
        raise InputError("batch", "rank", "rows of another rank")
    return cols


@dataclass
class PartFile:
    """A part (watched or uploaded) known from its Parquet footer: its rows are read when a
    window needs them.

    Decoding a 455-row part costs ~1.2 ms, reading its footer ~70 µs; a part's rows are needed
    only once, by the window that analyses them, so the ingest reads the footer (schema, row
    count, per-column min/max) and the window reads the rows, in the analysis process.
    """

    rank: int
    part: int
    path: Path
    records: int
    first_step: int
    last_step: int
    nbytes: int
    max_stage: int
    max_dp: int


# the columns whose footer min/max a part is checked by: ids must be >= 0, times finite
_CHECKED = ("rank", "dp_rank", "stage", "step", "start_ts", "duration")


def open_part_file(path: Path, limit: int = MAX_PART_FILE_BYTES):
    """(binary file, size) of a part file, opened without blocking and only if it is a
    regular file of at most `limit` bytes (a FIFO named like a part would block the ingest
    thread for good); InputError naming the file otherwise (FileNotFoundError passes)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(path, None, "not a regular file (a FIFO, device or directory "
                             "named like a part); expected a Parquet file")
        if st.st_size > limit:
            raise InputError(path, None, f"{st.st_size} bytes; expected at most {limit}")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb"), st.st_size


def read_part_footer(path: Path) -> PartFile | InputError | None:
    """A watched part checked from its footer: PartFile, the InputError naming what is wrong,
    or None when the footer cannot tell (no statistics, float ids, a step range wider than its
    rows) and the part must be read whole (read_part_files)."""
    ids = parse_part_name(path.name)
    if ids is None:
        return InputError(path, None, "not a rank-RRRRR.part-PPPPPP.parquet file")
    try:
        f, nbytes = open_part_file(path)
    except InputError as exc:
        return exc
    except FileNotFoundError:
        return InputError(path, None, "vanished before it could be read")
    except OSError as exc:
        return InputError(path, None, f"cannot be opened ({exc.strerror})")
    try:
        with f:
            if nbytes >= 8:
                f.seek(nbytes - 8)
                footer = footer_length(f.read(8))
                if footer is None or footer > MAX_FOOTER_BYTES:
                    return InputError(path, None, "not a readable Parquet file (no footer, or "
                                      f"one of more than {MAX_FOOTER_BYTES} bytes)")
                f.seek(0)
            meta = pq.read_metadata(f)
            with _mapped(f, nbytes) as data:
                bad = check_page_headers(meta, data, path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return InputError(path, None, f"not a readable Parquet file ({first[:200]})")
    return bad or _check_footer(meta, ids, path, path, nbytes)


def _mapped(f, size: int):
    """The bytes of an open file, mapped (only the page headers are touched)."""
    if size == 0:
        return contextlib.nullcontext(b"")
    return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def read_upload(body: bytes, source: object, rank: int, part: int, path: Path
                ) -> PartFile | InputError | None:
    """An uploaded part checked without decoding it whole: its footer (as read_part_footer)
    and the three columns a footer cannot vouch for — op type names, and NaN in start_ts and
    duration (Parquet's min/max leave NaN out) — so a bad part is still refused before it is
    acknowledged. PartFile (at `path`, where it is to be written), the InputError naming what
    is wrong, or None when the footer cannot tell (read it whole: read_uploads)."""
    footer = footer_length(body[-8:])
    if footer is None or footer > MAX_FOOTER_BYTES:
        return InputError(source, "body", "not a readable Parquet file (no footer, or one of "
                          f"more than {MAX_FOOTER_BYTES} bytes)")
    try:
        f = parquet_file(pa.BufferReader(body))
        meta = f.metadata
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return InputError(source, "body", f"not a readable Parquet file ({first[:200]})")
    got = check_page_headers(meta, body, source) or \
        _check_footer(meta, (rank, part), source, path, len(body))
    if not isinstance(got, PartFile) or got.records == 0:
        return got
    try:
        # every column decoded (a corrupt page in any column is found before the part is
        # acknowledged; the footer bounded what this takes); the op type as a dictionary
        t = f.read(use_threads=False)
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return InputError(source, "body", f"not a readable Parquet file ({first[:200]})")
    try:
        # every value checked (op types, NaN times, negative ids, the rank), and the rows
        # must say what the footer's statistics said: the window trusts the footer's steps
        rows = check_part(t, source, rank, part, len(body))
    except InputError as exc:
        return exc
    stage, dp = (int(rows.columns[c].max()) for c in ("stage", "dp_rank"))
    if (rows.first_step, rows.last_step) != (got.first_step, got.last_step) or \
            stage != got.max_stage or dp != got.max_dp:
        return InputError(source, "body", "the footer's statistics disagree with the rows "
                          f"(steps {rows.first_step}..{rows.last_step}, footer "
                          f"{got.first_step}..{got.last_step}); expected a file as written")
    return got


def _check_footer(meta, ids: tuple[int, int], source: object, path: Path,
                  nbytes: int) -> PartFile | InputError | None:
    """What a part's footer tells: PartFile, the InputError naming a problem (in `source`), or
    None when the footer cannot tell."""
    too_many = check_part_rows(meta.num_rows, source) or check_decode_budget(meta, source)
    if too_many is not None:
        return too_many
    verdict, where = _schema_facts(meta)
    if verdict == "whole":
        return None   # whole numbers stored as floats: checked row by row
    if verdict is not None:
        column, problem = verdict
        return InputError(source, column, problem)
    if meta.num_rows == 0:
        return PartFile(*ids, path, 0, -1, -1, nbytes, -1, -1)
    lo, hi = _footer_ranges(meta, where)
    if lo is None:
        return None
    for name in ("rank", "dp_rank", "stage", "step"):
        if lo[name] < 0:
            return InputError(source, name, "negative value; expected >= 0")
        info = np.iinfo(COLUMNS[name])
        if hi[name] > info.max:
            return InputError(source, name, f"values must lie in [{info.min}, {info.max}]")
    for name in ("start_ts", "duration"):
        if not (np.isfinite(lo[name]) and np.isfinite(hi[name])):
            return InputError(source, name, "infinite values; expected finite seconds")
        reach = max(abs(lo[name]), abs(hi[name]))
        if reach > MAX_SECONDS:
            return InputError(source, name, beyond_clock("values reach", reach))
    if lo["duration"] < 0:
        return InputError(source, "duration", f"negative durations (down to {lo['duration']:g} "
                          "s); expected >= 0 s")
    if lo["rank"] != ids[0] or hi["rank"] != ids[0]:
        other = lo["rank"] if lo["rank"] != ids[0] else hi["rank"]
        return InputError(source, "rank", f"rows of rank {int(other)} in a part of rank "
                          f"{ids[0]}; expected one rank per part")
    first, last = int(lo["step"]), int(hi["step"])
    if last - first + 1 > meta.num_rows:
        return None   # steps with gaps wider than its rows: the steps are read, not assumed
    return PartFile(*ids, path, int(meta.num_rows), first, last, nbytes, int(hi["stage"]),
                    int(hi["dp_rank"]))


def check_page_headers(meta, data, source: object) -> InputError | None:
    """A part whose page headers declare more than its footer (a page of 2 GB uncompressed, a
    page past its column chunk, a dictionary of 2**31 values) is refused before any page is
    decoded (pages.check_pages); `data`: the whole file (bytes or an mmap)."""
    footer = footer_length(bytes(data[-8:])) if len(data) >= 12 else None
    if footer is None:
        return None   # no Parquet footer: the reader says so
    bad = check_pages(meta, data, len(data) - 8 - footer)
    if bad is None:
        return None
    column, problem = bad
    return InputError(source, column, f"page headers: {problem}; expected pages within the "
                      "sizes the footer declares (nothing of the part was decoded)")


def check_part_rows(rows: int, source: object) -> InputError | None:
    """A part of more than MAX_PART_ROWS rows is refused before it is decoded: a few kB of
    Parquet can hold millions of identical rows (a 0.8 MB file decodes to 1 GB)."""
    if rows > MAX_PART_ROWS:
        return InputError(source, None, f"{rows} rows in one part; expected at most "
                          f"{MAX_PART_ROWS} (a recorder writes a part per flush, far fewer)")
    return None


def decoded_bound(meta) -> int:
    """An upper bound of the bytes a part takes decoded, from its footer alone."""
    declared = 0
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        declared += sum(max(group.column(i).total_uncompressed_size, 0)
                        for i in range(group.num_columns))
    return declared + int(meta.num_rows) * 8 * (meta.num_columns + 1)


def check_decode_budget(meta, source: object) -> InputError | None:
    """A part whose decoded size could pass MAX_DECODED_BYTES is refused before it is decoded."""
    bound = decoded_bound(meta)
    if bound > MAX_DECODED_BYTES:
        return InputError(source, None, f"would take up to {bound} bytes decoded (its columns' "
                          f"declared sizes); expected at most {MAX_DECODED_BYTES}")
    return None


def check_step_gaps(steps: np.ndarray, known: int, source: object) -> InputError | None:
    """A part whose steps lie more than MAX_STEP_GAP apart, or past `known` (the job's last
    step seen so far, -1 for none) by more than that, is refused: see MAX_STEP_GAP."""
    if not len(steps):
        return None
    u = np.unique(steps)
    if int(u[-1]) > MAX_STEP:
        return InputError(source, "step", f"step {int(u[-1])}; expected at most {MAX_STEP} "
                          "(2**53-1: the largest step a JSON reader keeps exact)")
    gaps = np.diff(u)
    if len(gaps) and int(gaps.max()) > MAX_STEP_GAP:
        at = int(np.argmax(gaps))
        return InputError(source, "step", f"steps jump from {int(u[at])} to {int(u[at + 1])}; "
                          f"expected at most {MAX_STEP_GAP} steps apart")
    if known >= 0 and int(u[0]) - known > MAX_STEP_GAP:
        return InputError(source, "step", f"first step {int(u[0])} is more than {MAX_STEP_GAP} "
                          f"steps past the job's last step so far ({known})")
    return None


# The checks that depend on a part's schema alone, for the last schemas seen (a job's parts
# share one): they were ~40% of the footer check's time, repeated for every part. A schema is
# the Parquet schema and the file's key-value metadata (which holds the Arrow schema the
# columns are read as), compared with .equals and == (~0.1 µs; hashing one costs ~13 µs).
_SCHEMA_FACTS: list[tuple[object, object, tuple]] = []
_SCHEMAS_KEPT = 8


def _schema_facts(meta) -> tuple:
    """(verdict, where) for a part's footer `meta`: verdict None (the columns are fine),
    "whole" (an integer column stored as floats: read the rows), or (column, problem); where
    maps each checked column to its Parquet leaf index (None when one is not a leaf)."""
    parquet_schema, extra = meta.schema, meta.metadata
    for known, known_extra, facts in list(_SCHEMA_FACTS):
        if known_extra == extra and known.equals(parquet_schema):
            return facts
    facts = (_schema_verdict(parquet_schema.to_arrow_schema()), _checked_leaves(parquet_schema))
    _SCHEMA_FACTS.insert(0, (parquet_schema, extra, facts))
    del _SCHEMA_FACTS[_SCHEMAS_KEPT:]
    return facts


def _schema_verdict(schema: pa.Schema):
    """None, "whole" or (column, problem): see _schema_facts."""
    names = schema.names
    unknown = [c for c in names if c not in ALLOWED_COLUMNS]
    if unknown or len(set(names)) != len(names):
        name = unknown[0] if unknown else next(n for n in names if names.count(n) > 1)
        return name, (f"unexpected column (or one named twice); expected only "
                      f"{', '.join(ALLOWED_COLUMNS)}")
    missing = [c for c in COLUMNS if c not in names]
    if missing:
        return missing[0], (f"missing column (required: {', '.join(COLUMNS)}; found: "
                            f"{', '.join(names) or 'none'})")
    for name in [*COLUMNS, *(c for c in OPTIONAL_COLUMNS if c in names)]:
        if name == "optype":
            continue   # its names are checked when the rows are read
        t = schema.field(name).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
            return name, f"expected a number column, got {t}"
        if COLUMNS.get(name, OPTIONAL_COLUMNS.get(name)).kind == "i" and not pa.types.is_integer(t):
            return "whole"
    return None


def _checked_leaves(parquet_schema) -> dict | None:
    """The Parquet leaf index of each checked column (an Arrow field index differs once a
    column is nested), None when one of them is not a leaf."""
    leaves = {parquet_schema.column(i).path: i for i in range(len(parquet_schema))}
    if any(name not in leaves for name in _CHECKED):
        return None
    return {name: leaves[name] for name in _CHECKED}


def _footer_ranges(meta, where: dict | None) -> tuple[dict | None, dict | None]:
    """min and max of the checked columns (`where`: their leaf indices) over every row group,
    (None, None) if a row group has no statistics for one of them (or has nulls in it)."""
    if where is None:
        return None, None
    lo: dict = {}
    hi: dict = {}
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for name, i in where.items():
            st = group.column(i).statistics
            if st is None or not st.has_min_max or st.null_count:
                return None, None
            lo[name] = min(lo.get(name, st.min), st.min)
            hi[name] = max(hi.get(name, st.max), st.max)
    return lo, hi


def read_part_footers(paths: list[Path], pool: Executor | None = None
                      ) -> list[PartFile | InputError | None]:
    """read_part_footer of many files (on `pool`'s threads)."""
    return list(pool.map(_guarded_footer, paths) if pool is not None
                else map(_guarded_footer, paths))


def _guarded_footer(path: Path) -> PartFile | InputError | None:
    return _guarded(read_part_footer, path, path)


def _guarded(fn, arg, source):
    """fn(arg), or the InputError naming `source` for whatever it raised: one part that a
    check does not foresee is refused alone, never its whole batch (nor the ingest thread)."""
    try:
        return fn(arg)
    except InputError as exc:
        return exc
    except Exception as exc:   # noqa: BLE001
        return InputError(source, None, f"could not be checked ({type(exc).__name__}: "
                          f"{str(exc)[:120]}); expected an op-table Parquet file")


def check_file_in_job(part: PartFile, meta, source: object) -> None:
    """check_in_job for a part known by its footer."""
    for value, size, column, name in ((part.max_stage, meta.pp_size, "stage", "pp_size"),
                                      (part.max_dp, meta.dp_size, "dp_rank", "dp_size")):
        if value >= size:
            raise InputError(source, column, f"values up to {value}; expected < {size} "
                             f"(the job's {name})")


def read_window_rows(files: list[PartFile], steps: list[int], pool: Executor | None = None,
                     ready: dict | None = None
                     ) -> tuple[list[dict[str, np.ndarray]], list[tuple[str, str]]]:
    """The rows at `steps` of parts known by their footers (those not `ready` — path → what was
    read ahead — read on `pool`'s threads, checked together), and (file, problem) for each part
    whose rows turn out bad (NaN times, unknown op types): those are left out of the window."""
    chunks, refused = [], []
    wanted = np.asarray(steps, dtype=np.int64)
    ready = dict(ready or {})
    rest = [f for f in files if str(f.path) not in ready]
    ready.update(zip((str(f.path) for f in rest), read_part_files([f.path for f in rest], pool)))
    for f in files:
        data = ready[str(f.path)]
        if isinstance(data, InputError):
            refused.append((str(f.path), data.problem))
            continue
        keep = np.isin(data.columns["step"], wanted)
        if keep.any():
            chunks.append({k: v[keep] for k, v in data.columns.items()})
    return chunks, refused


def read_part_files(paths: list[Path], pool: Executor | None = None
                    ) -> list[PartData | InputError]:
    """Read part files of run directories (on `pool`'s threads: Parquet decoding releases the
    GIL) and validate them together (check_parts)."""
    tables, sources, ids, sizes, out = [], [], [], [], {}
    def read_one(path):
        return _guarded(_read_sized, path, path)

    read = pool.map(read_one, paths) if pool is not None else map(read_one, paths)
    for i, (path, got) in enumerate(zip(paths, read)):
        if isinstance(got, InputError):
            out[i] = got
            continue
        table, size = got
        tables.append(table)
        sizes.append(size)
        sources.append(path)
        ids.append(parse_part_name(path.name))
        out[i] = None
    checked = iter(check_parts(tables, sources, ids, sizes))
    return [next(checked) if v is None else v for _, v in sorted(out.items())]


def parquet_file(source) -> pq.ParquetFile:
    """A ParquetFile whose op type column is read as a dictionary (its names decoded once,
    not once per row); a file without that column opens as it is (its check names it)."""
    try:
        return pq.ParquetFile(source, read_dictionary=["optype"])
    except KeyError:
        if hasattr(source, "seek"):
            source.seek(0)
        return pq.ParquetFile(source)


def read_small_parquet(source, name: object = None, data=None) -> pa.Table:
    """One small Parquet file, read on this thread: for parts of a few thousand rows this is
    ~5× faster than pq.read_table (no dataset discovery, no thread-pool hand-offs). A file of
    more than MAX_PART_ROWS rows, one that could take more than MAX_DECODED_BYTES decoded, or
    one with columns outside the op table's is refused (InputError naming `name`) before any
    of it is decoded, and so is one whose page headers pass its footer (with `data`, the
    file's bytes); the op type is read as a dictionary (its names, once)."""
    f = parquet_file(source)
    where = source if name is None else name
    refused = check_part_rows(f.metadata.num_rows, where) or \
        check_decode_budget(f.metadata, where) or \
        (check_page_headers(f.metadata, data, where) if data is not None else None)
    if refused is not None:
        raise refused
    unknown = [c for c in f.schema_arrow.names if c not in ALLOWED_COLUMNS]
    if unknown:
        raise InputError(where, unknown[0], "unexpected column; expected only "
                         f"{', '.join(ALLOWED_COLUMNS)}")
    return f.read(use_threads=False)


def _read_bytes(data: bytes, source: object) -> pa.Table:
    try:
        return read_small_parquet(pa.BufferReader(data), source, data)
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(source, "body", f"not a readable Parquet file ({first[:200]})") from None


def read_uploads(uploads: list[tuple[bytes, object, int, int]], pool: Executor | None = None
                 ) -> list[PartData | InputError]:
    """Parse uploaded parts (bytes, source, rank, part) on `pool`'s threads and validate them
    together (check_parts)."""
    def parse(u):
        return _guarded(lambda b: _read_bytes(b, u[1]), u[0], u[1])

    parsed = list(pool.map(parse, uploads) if pool is not None else map(parse, uploads))
    good = [i for i, t in enumerate(parsed) if not isinstance(t, InputError)]
    checked = check_parts([parsed[i] for i in good], [uploads[i][1] for i in good],
                          [(uploads[i][2], uploads[i][3]) for i in good],
                          [len(uploads[i][0]) for i in good])
    for i, result in zip(good, checked):
        parsed[i] = result
    return parsed


def _read_sized(path: Path) -> tuple[pa.Table, int] | InputError:
    try:
        return _read_file(path)
    except InputError as exc:
        return exc


def _read_file(path: Path) -> tuple[pa.Table, int]:
    """A part file's table and size (InputError naming the file when it cannot be had)."""
    if parse_part_name(path.name) is None:
        raise InputError(path, None, "not a rank-RRRRR.part-PPPPPP.parquet file")
    try:
        f, size = open_part_file(path)
    except FileNotFoundError:
        raise InputError(path, None, "vanished before it could be read") from None
    except OSError as exc:
        raise InputError(path, None, f"cannot be opened ({exc.strerror})") from None
    try:
        with f, _mapped(f, size) as data:
            return read_small_parquet(f, path, data), size
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(path, None, f"not a readable Parquet file ({first[:200]})") from None


def read_part_file(path: Path) -> PartData:
    """Read and validate a part file of a run directory."""
    table, nbytes = _read_file(path)
    ids = parse_part_name(path.name)
    return check_part(table, path, ids[0], ids[1], nbytes)


def write_part_file(directory: Path, rank: int, part: int, data: bytes,
                    sync_dir: bool = True) -> Path:
    """Put uploaded bytes in the run format, atomically and durably (fsync, then rename; with
    sync_dir=False the caller fsyncs the directory, once for many files)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / rank_file_name(rank, part)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{id(data):x}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)   # a full disk leaves no half-written file behind
        raise
    if sync_dir:
        sync_directory(directory)
    return path


def sync_directory(directory: Path) -> None:
    """fsync a directory: the renames in it survive a power cut before a part is acknowledged."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
