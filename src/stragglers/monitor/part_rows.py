"""A part's rows: decoded from Parquet (bounded first) and checked as one rank's ops."""

from __future__ import annotations

from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from stragglers.errors import InputError
from stragglers.monitor.part_files import WHOLE_READ_BYTES, checked_digest, file_bytes, \
    open_part_file, read_whole
from stragglers.monitor.part_limits import ALLOWED_COLUMNS, check_decode_budget, \
    check_op_spans, check_page_headers, check_part_rows, check_step_gaps, guarded, \
    screened_metadata
from stragglers.monitor.part_names import parse_part_name
from stragglers.trace.columns import table_to_columns
from stragglers.trace.model import OPTYPE_CODES, OPTYPES

if TYPE_CHECKING:
    from stragglers.monitor.part_footers import PartFile
    from stragglers.monitor.records import LayoutEntry
    from stragglers.trace.model import JobMeta


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
    cols = table_to_columns(table, source if isinstance(source, (Path, str)) else str(source))
    if len(cols["rank"]) and (cols["rank"] != rank).any():
        other = int(cols["rank"][cols["rank"] != rank][0])
        raise InputError(source, "rank", f"rows of rank {other} in a part of rank {rank}; "
                         "expected one rank per part")
    wild = check_step_gaps(cols["step"], -1, source)   # (before op ids: a wild step is named
    if wild is not None:                                # as such, not as ops it merged)
        raise wild
    check_op_ids(cols, source)
    spans = check_op_spans(cols, source)
    if spans is not None:
        raise spans
    return PartData(rank, part, cols, nbytes)


MAX_SEQ_ID = (1 << 24) - 1   # the what-if grid's op numbers (whatif.grid._SEQ_BITS)
_GC = OPTYPE_CODES["gc"]


def _name(code: int) -> str:
    """An op type's name, for errors."""
    return str(OPTYPES[code]) if 0 <= code < len(OPTYPES) else str(code)


def check_op_ids(cols: dict[str, np.ndarray], source: object) -> None:
    """InputError unless every op (gc pauses aside: the grid numbers those itself) has a
    seq_id in 0..MAX_SEQ_ID and no two share (dp_rank, stage, step, optype, seq_id): the
    analysis refuses both, and one such part failed the whole window of every rank."""
    keep = cols["optype"] != _GC
    seq = cols["seq_id"][keep].astype(np.int64)
    if not len(seq):
        return
    if int(seq.min()) < 0 or int(seq.max()) > MAX_SEQ_ID:
        bad = int(seq[(seq < 0) | (seq > MAX_SEQ_ID)][0])
        raise InputError(source, "seq_id", f"seq_id {bad}; expected 0..{MAX_SEQ_ID}")
    op = (cols["optype"][keep].astype(np.int64) << 24) | seq
    keys = (op, cols["step"][keep], cols["stage"][keep], cols["dp_rank"][keep])
    order = np.lexsort(keys)
    same = np.ones(len(order) - 1, dtype=bool)
    for k in keys:
        s = k[order]
        same &= s[1:] == s[:-1]
    if same.any():
        i = int(order[int(np.argmax(same))])
        raise InputError(source, "seq_id", f"two ops share (step {int(keys[1][i])}, seq_id "
                         f"{int(seq[i])}) on one worker; expected seq_id to number each op "
                         "type within a step and worker")
    # seq_id numbers an op type's ops of a step in start order (docs/whatif.md): one whose
    # start goes back as its seq_id goes up (times reversed in a part) made the engine find
    # cyclic dependencies, an error row for every rank of the window; the sort above is reused
    group = (keys[1][order][1:] == keys[1][order][:-1]) \
        & (keys[2][order][1:] == keys[2][order][:-1]) \
        & (keys[3][order][1:] == keys[3][order][:-1])
    kind = op[order] >> 24
    group &= kind[1:] == kind[:-1]
    start = cols["start_ts"][keep][order]
    back = group & (start[1:] < start[:-1])
    if back.any():
        j = int(np.argmax(back))
        i = int(order[j + 1])
        raise InputError(source, "start_ts", f"step {int(keys[1][i])}: op type "
                         f"{_name(int(kind[j + 1]))} #{int(seq[i])} starts before #"
                         f"{int(seq[order[j]])}; expected seq_id to number an op type's ops "
                         "of a step in start order")



def check_in_job(data: PartData, meta: JobMeta, source: object,
                 place: LayoutEntry | None = None) -> None:
    """InputError when a part's rows sit at a stage or DP rank its job's meta does not have,
    or, with its rank's layout entry (`place`), at another place than the layout's (the part
    is refused alone, rather than failing every window it would be analysed in)."""
    for column, size, name in (("stage", meta.pp_size, "pp_size"),
                               ("dp_rank", meta.dp_size, "dp_size")):
        values = data.columns[column]
        bad = np.flatnonzero(values >= size)
        if len(bad):
            raise InputError(source, column, f"value {int(values[bad[0]])} at row {int(bad[0])}; "
                             f"expected < {size} (the job's {name})")
    if place is None or not len(data.columns["stage"]):
        return
    for column, want in (("stage", place.stage), ("dp_rank", place.dp_rank)):
        values = data.columns[column]
        if want is not None and (values.min() != want or values.max() != want):
            raise misplaced(data.rank, column, int(values[values != want][0]), want, source)


def misplaced(rank: int, column: str, got: int, want: int, source: object) -> InputError:
    """A part whose rows sit at another place than its rank's layout entry: rank 0 sending
    rows of DP rank 1 shared every op of the worker there, and each window of the job failed
    ("two ops share ...") for every rank."""
    return InputError(source, column, f"rows at {column} {got}; rank {rank} is at {column} "
                      f"{want} in the job's layout (meta.json extra.layout)")



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
                out[i] = guarded(lambda t: check_part(t, sources[i], *ids[i], nbytes[i]),
                                  tables[i], sources[i])
            continue
        start = 0
        for i in members:
            end = start + tables[i].num_rows
            # copies, not views: a part held until its window closes must not pin the batch
            out[i] = PartData(*ids[i], {k: v[start:end].copy() for k, v in cols.items()},
                              nbytes[i])
            start = end
    return [o if o is not None else InputError("part", None, "not checked") for o in out]



def _check_group(tables: list[pa.Table], ranks: list[int]) -> dict[str, np.ndarray]:
    big = pa.concat_tables(tables).unify_dictionaries().combine_chunks()
    cols = table_to_columns(big, "batch")
    expected = np.repeat(np.asarray(ranks, dtype=cols["rank"].dtype),
                         [t.num_rows for t in tables])
    if (cols["rank"] != expected).any():
        raise InputError("batch", "rank", "rows of another rank")
    check_op_ids(cols, "batch")   # (ranks differ in their rows' dp_rank or stage)
    if check_op_spans(cols, "batch") is not None:
        raise InputError("batch", "duration", "an op that does not fit its step")
    return cols



def parquet_file(source, metadata=None) -> pq.ParquetFile:
    """A ParquetFile whose op type column is read as a dictionary (its names decoded once,
    not once per row); a file without that column opens as it is (its check names it);
    `metadata`: its FileMetaData, already read (from screened bytes)."""
    try:
        return pq.ParquetFile(source, read_dictionary=["optype"], metadata=metadata)
    except KeyError:
        if hasattr(source, "seek"):
            source.seek(0)
        return pq.ParquetFile(source, metadata=metadata)



def read_small_parquet(source, name: object = None, data=None, checked: bool = False
                       ) -> pa.Table:
    """One small Parquet file, read on this thread: for parts of a few thousand rows this is
    ~5× faster than pq.read_table (no dataset discovery, no thread-pool hand-offs). A file of
    more than MAX_PART_ROWS rows, one that could take more than MAX_DECODED_BYTES decoded, or
    one with columns outside the op table's is refused (InputError naming `name`) before any
    of it is decoded, and so is one whose page headers pass its footer (with `data`, the
    file's bytes); the op type is read as a dictionary (its names, once). `checked`: these
    very bytes passed those checks already (their digest says so), which are not run again;
    else `data` is required: its footer is screened (part_limits.screened_footer) before pyarrow
    walks it, and walked as the bytes screened."""
    where = source if name is None else name
    meta = None
    if not checked:
        meta = screened_metadata(data, where)
        if isinstance(meta, InputError):
            raise meta
    f = parquet_file(source, meta)
    refused = None if checked else (
        check_part_rows(f.metadata.num_rows, where) or
        check_decode_budget(f.metadata, where) or
        check_page_headers(f.metadata, data, where))
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
        return guarded(lambda b: _read_bytes(b, u[1]), u[0], u[1])

    parsed = list(pool.map(parse, uploads) if pool is not None else map(parse, uploads))
    good = [i for i, t in enumerate(parsed) if not isinstance(t, InputError)]
    checked = check_parts([parsed[i] for i in good], [uploads[i][1] for i in good],
                          [(uploads[i][2], uploads[i][3]) for i in good],
                          [len(uploads[i][0]) for i in good])
    for i, result in zip(good, checked):
        parsed[i] = result
    return parsed



def _read_sized(path: Path, digest: bytes = b"", within: str = ""
                ) -> tuple[pa.Table, int] | InputError:
    try:
        return _read_file(path, digest, within)
    except InputError as exc:
        return exc



def _read_file(path: Path, digest: bytes = b"", within: str = "") -> tuple[pa.Table, int]:
    """A part file's table and size (InputError naming the file when it cannot be had);
    `digest`: the checked_digest of bytes whose footer and page headers were checked (by the
    ingest), not checked again when the file's bytes give it: each check runs once per part,
    and a file changed since (in place or replaced) is checked again; `within`: the folder the
    opened file must lie in (open_part_file)."""
    if parse_part_name(path.name) is None:
        raise InputError(path, None, "not a rank-RRRRR.part-PPPPPP.parquet file")
    try:
        f, size = open_part_file(path, within=within)
    except FileNotFoundError:
        raise InputError(path, None, "vanished before it could be read") from None
    except OSError as exc:
        raise InputError(path, None, f"cannot be opened ({exc.strerror})") from None
    try:
        with f:
            if size > WHOLE_READ_BYTES:
                with file_bytes(f, size) as touched:
                    return read_small_parquet(f, path, touched), size
            # one read: the digest, the checks and the rows are of the same bytes (a writer
            # changing the file between a check and the decode changes neither)
            data = read_whole(f, size)
        same = bool(digest) and checked_digest(data) == digest
        return read_small_parquet(pa.BufferReader(data), path, data, same), size
    except (pa.ArrowException, OSError, ValueError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise InputError(path, None, f"not a readable Parquet file ({first[:200]})") from None



def read_part_file(path: Path, within: str = "") -> PartData:
    """Read and validate a part file of a run directory (lying in `within`, when given)."""
    table, nbytes = _read_file(path, within=within)
    ids = _ids(path)
    return check_part(table, path, ids[0], ids[1], nbytes)


def _ids(path: Path) -> tuple[int, int]:
    """(rank, part) of a part file (callers pass only files named as parts)."""
    ids = parse_part_name(path.name)
    if ids is None:
        raise InputError(path, None, "not a part file name (rank-RRRRR.part-PPPPPP.parquet)")
    return ids



def read_part_files(paths: list[Path], pool: Executor | None = None,
                    digests: list[bytes] | None = None, within: list[str] | None = None
                    ) -> list[PartData | InputError]:
    """Read part files of run directories (on `pool`'s threads: Parquet decoding releases the
    GIL) and validate them together (check_parts); `digests`: each file's PartFile.digest
    (b"": none), whose bytes' footer and page headers are not checked again; `within`: the
    folder each opened file must lie in (PartFile.within; "": anywhere)."""
    tables: list[pa.Table] = []
    sources: list[Path] = []
    ids: list[tuple[int, int]] = []
    sizes: list[int] = []
    out: dict[int, PartData | InputError | None] = {}

    def read_one(job: tuple[Path, bytes, str]):
        return guarded(lambda j: _read_sized(*j), job, job[0])

    jobs = list(zip(paths, digests if digests is not None else [b""] * len(paths),
                    within if within is not None else [""] * len(paths)))
    read = pool.map(read_one, jobs) if pool is not None else map(read_one, jobs)
    for i, (path, got) in enumerate(zip(paths, read)):
        if isinstance(got, InputError):
            out[i] = got
            continue
        table, size = got
        tables.append(table)
        sizes.append(size)
        sources.append(path)
        ids.append(_ids(path))
        out[i] = None
    checked = iter(check_parts(tables, sources, ids, sizes))
    return [next(checked) if v is None else v for _, v in sorted(out.items(), key=lambda kv: kv[0])]



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
    ready.update(zip((str(f.path) for f in rest), read_part_files(
        [f.path for f in rest], pool, [f.digest for f in rest], [f.within for f in rest])))
    for f in files:
        data = ready[str(f.path)]
        if isinstance(data, InputError):
            refused.append((str(f.path), data.named))
            continue
        keep = np.isin(data.columns["step"], wanted)
        if keep.any():
            chunks.append({k: v[keep] for k, v in data.columns.items()})
    return chunks, refused
