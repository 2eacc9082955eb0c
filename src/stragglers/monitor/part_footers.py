"""A part known from its Parquet footer (schema, rows, per-column min/max), its rows left
unread until a window needs them."""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stragglers.errors import InputError
from stragglers.monitor.part_files import WHOLE_READ_BYTES, checked_digest, file_bytes, \
    open_part_file, read_whole
from stragglers.monitor.part_limits import ALLOWED_COLUMNS, MAX_FOOTER_BYTES, \
    check_decode_budget, check_page_headers, check_part_rows, footer_length, guarded, \
    screened_footer, screened_metadata
from stragglers.monitor.part_names import parse_part_name
from stragglers.monitor.part_rows import PartData, check_part, check_parts, misplaced, \
    parquet_file
from stragglers.monitor.records import LayoutEntry
from stragglers.monitor.step_sets import distinct
from stragglers.trace.columns import MAX_SECONDS, beyond_clock, too_narrow
from stragglers.trace.model import COLUMNS, OPTIONAL_COLUMNS, JobMeta


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
    # checked_digest of the bytes whose footer and page headers were checked (b"" when the
    # file was too large to be read whole): the analysis process does not check them again
    # in a file whose bytes give the same digest (part_rows.read_part_files)
    digest: bytes = b""
    # the least stage and DP rank of its rows (with max_stage/max_dp: the one place of its
    # rank, which its job's layout must agree with)
    min_stage: int = 0
    min_dp: int = 0
    # the folder the file must lie in once links are followed, each time it is opened ("":
    # anywhere): a watched file checked and then swapped for a link out of its folder
    within: str = ""
    # its distinct steps once read (step_sets.read_steps: a conflict with another part of its
    # rank is judged by them); None: only its footer's range first..last is known
    steps: np.ndarray | None = None



# the columns whose footer min/max a part is checked by: ids must be >= 0, times finite
_CHECKED = ("rank", "dp_rank", "stage", "step", "start_ts", "duration")



def read_part_footer(path: Path, within: str = "") -> PartFile | InputError | None:
    """A watched part checked from its footer: PartFile, the InputError naming what is wrong,
    or None when the footer cannot tell (no statistics, float ids, a step range wider than its
    rows) and the part must be read whole (read_part_files); `within`: the folder the opened
    file must lie in (open_part_file)."""
    ids = parse_part_name(path.name)
    if ids is None:
        return InputError(path, None, "not a rank-RRRRR.part-PPPPPP.parquet file")
    try:
        f, nbytes = open_part_file(path, within=within)
    except InputError as exc:
        return exc
    except FileNotFoundError:
        return InputError(path, None, "vanished before it could be read")
    except OSError as exc:
        return InputError(path, None, f"cannot be opened ({exc.strerror})")
    data = None
    try:
        with f:
            if nbytes <= WHOLE_READ_BYTES:
                # one read: the footer, the page headers and the digest from the same bytes
                data = read_whole(f, nbytes)
            tail = data[-8:] if data is not None else _tail(f, nbytes)
            if nbytes >= 8:
                footer = footer_length(tail)
                if footer is None or footer > MAX_FOOTER_BYTES:
                    return InputError(path, None, "not a readable Parquet file (no footer, or "
                                      f"one of more than {MAX_FOOTER_BYTES} bytes)")
            # the footer screened before pyarrow walks it (parquet_footer: one that disagrees
            # with itself aborts the process), and walked as the bytes screened
            if data is not None:
                screened = screened_footer(data, path)
                if isinstance(screened, InputError):
                    return screened
                meta = pq.read_metadata(pa.BufferReader(data))
                bad = check_page_headers(meta, data, path)
            else:
                with file_bytes(f, nbytes) as touched:
                    meta = screened_metadata(touched, path)
                    if isinstance(meta, InputError):
                        return meta
                    bad = check_page_headers(meta, touched, path)
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return InputError(path, None, f"not a readable Parquet file ({first[:200]})")
    got = bad or _check_footer(meta, ids, path, path, nbytes)
    if isinstance(got, PartFile):
        got.within = within
        if data is not None:
            got.digest = checked_digest(data)
    return got



def _tail(f, nbytes: int) -> bytes:
    """The last 8 bytes of an open file of `nbytes` (its Parquet footer's length and magic)."""
    if nbytes < 8:
        return b""
    f.seek(nbytes - 8)
    tail = f.read(8)
    f.seek(0)
    return tail



def read_upload(body: bytes, source: object, rank: int, part: int, path: Path
                ) -> PartFile | InputError | None:
    """An uploaded part checked without decoding it whole: its footer (as read_part_footer)
    and the three columns a footer cannot vouch for — op type names, and NaN in start_ts and
    duration (Parquet's min/max leave NaN out) — so a bad part is still refused before it is
    acknowledged. PartFile (at `path`, where it is to be written), the InputError naming what
    is wrong, or None when the footer cannot tell (read it whole: read_uploads)."""
    return check_uploads([(body, source, rank, part, path)])[0]



def check_uploads(uploads: list[tuple[bytes, object, int, int, Path]],
                  pool: Executor | None = None) -> list[PartFile | InputError | None]:
    """read_upload of many parts (body, source, rank, part, path): each one's footer and page
    headers checked and its rows decoded alone (on `pool`'s threads), the rows of all checked
    together (check_parts: a column's check costs about the same for 455 rows as for 50,000,
    ~0.5 ms a part alone against ~0.07 ms in a batch of 64); a bad part is still named alone
    and refused without its batch."""
    got = list(pool.map(_guarded_upload, uploads) if pool is not None
               else map(_guarded_upload, uploads))
    decoded = [i for i, g in enumerate(got) if isinstance(g, tuple)]
    checked = _check_rows([got[i][1] for i in decoded], [uploads[i] for i in decoded])
    out = [g if not isinstance(g, tuple) else None for g in got]
    for i, rows in zip(decoded, checked):
        out[i] = rows if isinstance(rows, InputError) else \
            _rows_agree(got[i][0], rows, uploads[i][1])
    return out



def _guarded_upload(upload: tuple[bytes, object, int, int, Path]):
    return guarded(lambda u: _decoded_upload(*u), upload, upload[1])



def _check_rows(tables: list[pa.Table], uploads: list[tuple[bytes, object, int, int, Path]]
                ) -> list[PartData | InputError]:
    """check_parts of decoded uploads; should it fail as a whole (what no check foresaw),
    each part is checked alone, so one part never refuses its batch."""
    if len(tables) == 1:   # (alone: no batch to concatenate)
        u = uploads[0]
        return [guarded(lambda t: check_part(t, u[1], u[2], u[3], len(u[0])), tables[0], u[1])]
    try:
        return check_parts(tables, [u[1] for u in uploads], [(u[2], u[3]) for u in uploads],
                           [len(u[0]) for u in uploads])
    except Exception:   # noqa: BLE001
        return [guarded(lambda t: check_part(t, u[1], u[2], u[3], len(u[0])), t, u[1])
                for t, u in zip(tables, uploads)]



def _decoded_upload(body: bytes, source: object, rank: int, part: int, path: Path
                    ) -> PartFile | InputError | None | tuple[PartFile, pa.Table]:
    """An upload's footer and page headers checked, then its rows decoded: (PartFile, rows to
    check), or what read_upload answers when no rows need checking."""
    footer = footer_length(body[-8:])
    if footer is None or footer > MAX_FOOTER_BYTES:
        return InputError(source, "body", "not a readable Parquet file (no footer, or one of "
                          f"more than {MAX_FOOTER_BYTES} bytes)")
    screened = screened_footer(body, source, "body")   # (before pyarrow walks it)
    if isinstance(screened, InputError):
        return screened
    try:
        f = parquet_file(pa.BufferReader(body))
        meta = f.metadata
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return InputError(source, "body", f"not a readable Parquet file ({first[:200]})")
    got = check_page_headers(meta, body, source) or \
        _check_footer(meta, (rank, part), source, path, len(body))
    if not isinstance(got, PartFile):
        return got
    got.digest = checked_digest(body)   # the file written is these bytes
    if got.records == 0:
        return got
    try:
        # every column decoded (a corrupt page in any column is found before the part is
        # acknowledged; the footer bounded what this takes); the op type as a dictionary
        return got, f.read(use_threads=False)
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return InputError(source, "body", f"not a readable Parquet file ({first[:200]})")



def _rows_agree(got: PartFile, rows: PartData, source: object) -> PartFile | InputError:
    """`got` when an upload's checked rows (op types, NaN times, negative ids, the rank) say
    what its footer's statistics said (the window trusts the footer's steps)."""
    cols = rows.columns
    stage, dp = (int(cols[c].max()) for c in ("stage", "dp_rank"))
    low = (int(cols["stage"].min()), int(cols["dp_rank"].min()))
    if (rows.first_step, rows.last_step) != (got.first_step, got.last_step) or \
            stage != got.max_stage or dp != got.max_dp or low != (got.min_stage, got.min_dp):
        return InputError(source, "body", "the footer's statistics disagree with the rows "
                          f"(steps {rows.first_step}..{rows.last_step}, footer "
                          f"{got.first_step}..{got.last_step}); expected a file as written")
    got.steps = distinct(cols["step"])   # (decoded already: its conflicts judged by them)
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
        return PartFile(*ids, path, 0, -1, -1, nbytes, -1, -1, min_stage=-1, min_dp=-1)
    lo, hi = _footer_ranges(meta, where)
    if lo is None or hi is None:
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
                    int(hi["dp_rank"]), min_stage=int(lo["stage"]), min_dp=int(lo["dp_rank"]))



# The checks that depend on a part's schema alone, for the last schemas seen (a job's parts
# share one): they were ~40% of the footer check's time, repeated for every part. A schema is
# the Parquet schema and the file's key-value metadata (which holds the Arrow schema the
# columns are read as), compared with .equals and == (~0.1 µs; hashing one costs ~13 µs).
_SCHEMA_FACTS: list[tuple[Any, object, tuple]] = []   # (pyarrow.parquet schema: untyped)

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
    """None, "whole" or (column, problem): see _schema_facts (a float32 start_ts is "whole":
    its rows tell whether its values stay where float32 is exact enough)."""
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
    whole = False
    for name in [*COLUMNS, *(c for c in OPTIONAL_COLUMNS if c in names)]:
        if name == "optype":
            continue   # its names are checked when the rows are read
        t = schema.field(name).type
        if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)):
            return name, f"expected a number column, got {t}"
        if pa.types.is_float16(t):   # (numpy's checks take no half floats: a TypeError once)
            return name, f"expected 32- or 64-bit floats or integers, got {t}"
        dtype = COLUMNS[name] if name in COLUMNS else OPTIONAL_COLUMNS[name]
        if name == "start_ts" and pa.types.is_float32(t):
            whole = True   # (read row by row: float32 clocks are read only near 0, too_narrow)
            continue
        narrow = too_narrow(name, dtype, t)
        if narrow is not None:
            return name, narrow
        # (every column's type checked before the answer: a float id once answered "whole"
        # before start_ts's type was looked at)
        whole = whole or (dtype.kind == "i" and not pa.types.is_integer(t))
    return "whole" if whole else None



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



def read_part_footers(paths: list[Path], pool: Executor | None = None,
                      within: list[str] | None = None) -> list[PartFile | InputError | None]:
    """read_part_footer of many files (on `pool`'s threads), each lying in its `within`."""
    jobs = list(zip(paths, within if within is not None else [""] * len(paths)))
    return list(pool.map(_guarded_footer, jobs) if pool is not None
                else map(_guarded_footer, jobs))



def _guarded_footer(job: tuple[Path, str]) -> PartFile | InputError | None:
    return guarded(lambda j: read_part_footer(*j), job, job[0])



def check_file_in_job(part: PartFile, meta: JobMeta, source: object,
                      place: LayoutEntry | None = None) -> None:
    """check_in_job for a part known by its footer (its min/max of stage and DP rank)."""
    for value, size, column, name in ((part.max_stage, meta.pp_size, "stage", "pp_size"),
                                      (part.max_dp, meta.dp_size, "dp_rank", "dp_size")):
        if value >= size:
            raise InputError(source, column, f"values up to {value}; expected < {size} "
                             f"(the job's {name})")
    if place is not None and part.records:
        for low, high, want, column in ((part.min_stage, part.max_stage, place.stage, "stage"),
                                        (part.min_dp, part.max_dp, place.dp_rank, "dp_rank")):
            if want is not None and (low, high) != (want, want):
                raise misplaced(part.rank, column, low if low != want else high, want, source)
