"""Bounds a part must keep before it is decoded (rows, decoded bytes, footer, page headers)
or analysed (steps)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from stragglers.errors import InputError
from stragglers.monitor.pages import check_pages
from stragglers.trace.model import COLUMNS, OPTIONAL_COLUMNS
from stragglers.trace.parquet_footer import BadThrift, as_file, check_footer, footer_of


MAX_PART_ROWS = 1_000_000   # rows in one part (a recorder's flush holds hundreds to thousands)

# bytes a part may take once decoded, bounded from its footer before any page is decoded: the
# columns' declared uncompressed sizes plus 8 bytes per row and column of Arrow buffers (the op
# type is read as a dictionary, so 1M rows of one 1,000-byte name stay ~4 MB)
MAX_DECODED_BYTES = 384 * 2**20

# a part's steps may lie at most this far past the job's steps seen so far (or apart from each
# other): one wild number (a step of 2**63-1) would otherwise become the job's last analysed
# step, and every later row would be dropped as late
MAX_STEP_GAP = 1_000_000

# the largest step taken: past 2**53 a JSON reader (the dashboard) no longer holds a step
# exactly, and no training runs that long; a first part at 2**63-1 has no earlier step to be
# judged against by MAX_STEP_GAP
MAX_STEP = 2**53 - 1

ALLOWED_COLUMNS = (*COLUMNS, *OPTIONAL_COLUMNS)

# a part's schema elements: its root and one leaf per column it may have (no nesting)
MAX_SCHEMA_ELEMENTS = 1 + len(ALLOWED_COLUMNS)

# a part's Parquet footer (a recorder's is a few kB): a larger one is refused before it is
# parsed (its thrift decoding allocates per declared column and row group)
MAX_FOOTER_BYTES = 4 << 20



def footer_length(tail: bytes) -> int | None:
    """The footer length a Parquet file's last 8 bytes give, None when they are not Parquet's."""
    if len(tail) != 8 or tail[4:] != b"PAR1":
        return None
    return int.from_bytes(tail[:4], "little")



def screened_footer(data, source: object, field: str | None = None) -> bytes | InputError:
    """The footer's bytes of a part (`data`: its bytes, or part_files.FileBytes) once
    parquet_footer.check_footer passes them, else the InputError naming what is wrong: pyarrow
    walks no footer before this (a footer that disagrees with itself aborts the process)."""
    try:
        footer = footer_of(data)
        # the part's budgets, held by the screen as it reads (pyarrow then parses only a
        # footer of the columns a part may have: one of 4,096 declared columns, each chunk in
        # every row group, was parsed whole before its columns were refused)
        check_footer(footer, max_columns=MAX_SCHEMA_ELEMENTS, max_rows=MAX_PART_ROWS)
    except BadThrift as exc:
        return InputError(source, field, f"not a readable Parquet file (footer: {exc}; "
                          "nothing of the part was read)")
    return footer



def screened_metadata(data, source: object, field: str | None = None):
    """pyarrow's FileMetaData of a part's screened footer, parsed from the very bytes screened
    (a file changed since is not walked), or the InputError of screened_footer."""
    footer = screened_footer(data, source, field)
    if isinstance(footer, InputError):
        return footer
    import pyarrow as pa
    import pyarrow.parquet as pq
    return pq.read_metadata(pa.BufferReader(as_file(footer)))



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



def check_page_headers(meta, data, source: object) -> InputError | None:
    """A part whose page headers declare more than its footer (a page of 2 GB uncompressed, a
    page past its column chunk, a dictionary of 2**31 values) is refused before any page is
    decoded (pages.check_pages); `data`: the whole file (bytes or part_files.FileBytes)."""
    footer = footer_length(bytes(data[-8:])) if len(data) >= 12 else None
    if footer is None:
        return None   # no Parquet footer: the reader says so
    if bytes(data[:4]) != b"PAR1":   # (the reader looks at the footer's magic only)
        return InputError(source, None, "does not start with PAR1; expected a Parquet file")
    bad = check_pages(meta, data, len(data) - 8 - footer)
    if bad is None:
        return None
    column, problem = bad
    return InputError(source, column, f"page headers: {problem}; expected pages within the "
                      "sizes the footer declares (nothing of the part was decoded)")



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



# an op's end may pass the start of its rank's next step by at most one step (the earlier
# step's start to the next one's: work left on a device stream or a collective that overlaps)
# or this many seconds, whichever is more
OP_END_SLACK_S = 1.0

# no op lasts longer: a collective waits at most its process group's timeout (PyTorch's
# default: 10 min for NCCL, 30 min for gloo), and no kernel of a training step runs an hour
# (an op of 5e10 s, inside the times' finite bound, made a window's S 3.1e10 and fired alerts)
MAX_OP_SECONDS = 3600.0


def check_op_spans(cols: dict[str, np.ndarray], source: object) -> InputError | None:
    """A part with an op that does not fit its own step is refused, naming the row: one
    lasting more than MAX_OP_SECONDS, or ending after its rank's next step in the part began
    (plus OP_END_SLACK_S or one step) where the two steps run on one clock (OpSpans.chained):
    on a rank a step starts once the one before is done, so such an op's duration is not what
    happened, and one such op poisoned its window. Steps each timed from their own start
    (NDTimeline's samples) are bounded by the other ranks' same step in their window
    (windows.spans_past_others): a part holds one rank."""
    duration = cols["duration"]
    if not len(duration):
        return None
    long = np.flatnonzero(duration > MAX_OP_SECONDS)
    if len(long):
        i = int(long[0])
        return InputError(source, "duration", f"row {i} (step {int(cols['step'][i])}): "
                          f"{float(duration[i]):.6g} s; expected an op of at most "
                          f"{MAX_OP_SECONDS:g} s (MAX_OP_SECONDS)")
    sp = op_spans(cols)
    if not sp.over.any():
        return None
    j = int(np.argmax(sp.over))
    i, g = int(sp.order[j]), int(sp.group[j])
    return InputError(source, "duration", f"row {i} (rank {int(sp.rank[j])}, step "
                      f"{int(sp.step[j])}): an op of {float(duration[i]):.6g} s ending "
                      f"{float(cols['start_ts'][i] + duration[i] - sp.next_start[g]):.6g} s "
                      f"after the rank's step {int(sp.step[sp.head[g + 1]])} began, which "
                      "followed it on the same clock (it began after this step's ops' mean "
                      f"start); expected an op to end by then (plus {OP_END_SLACK_S:g} s or one "
                      "step)")


class OpSpans(NamedTuple):
    """op_spans' answer: rows in (rank, step) order, grouped by (rank, step)."""

    over: np.ndarray        # per row: its op ends past its chained next step's bound
    order: np.ndarray       # per row: its index in the columns
    rank: np.ndarray        # per row: its rank
    step: np.ndarray        # per row: its step
    group: np.ndarray       # per row: its (rank, step) group
    head: np.ndarray        # per group: its first row
    first: np.ndarray       # per group: its first start
    middle: np.ndarray      # per group: its ops' mean start
    next_start: np.ndarray  # per group: the first start of its rank's next step (inf: none)
    chained: np.ndarray     # per group: that next step followed it on one clock


def op_spans(cols: dict[str, np.ndarray]) -> OpSpans:
    """Which ops end after their rank's next step began (plus OP_END_SLACK_S or one step),
    where that next step follows on the same clock: it began after this step's ops' mean
    start (`chained`). Steps each timed from their own start (NDTimeline's sampled steps:
    every step begins near 0 s), or a clock set back, begin the next step before this one's
    bulk: "ends after the next step began" compares two clocks there, and is not judged (an
    op lasting to the end of its step would be). An op's duration does not move the mean
    start, so an op of 3,000 s on one clock stays judged (an op started far later to make
    its step look restarted spans it: windows.spans_past_others). Ops of a rank's last step
    here pass."""
    rank, step, start, duration = cols["rank"], cols["step"], cols["start_ts"], cols["duration"]
    order = np.lexsort((step, rank))   # (the start as a third key about doubled it, 291k rows)
    r, st, at = rank[order], step[order], start[order]
    head = np.flatnonzero(np.r_[True, (r[1:] != r[:-1]) | (st[1:] != st[:-1])])
    count = np.diff(np.r_[head, len(order)])
    first = np.minimum.reduceat(at, head)                     # each (rank, step)'s first start
    middle = np.add.reduceat(at, head) / count                # ... and its ops' mean start
    same_rank = np.r_[r[head][1:] == r[head][:-1], False]    # a next step of the same rank
    nxt = np.r_[first[1:], np.inf]
    chained = same_rank & (nxt > middle)
    allowed = np.where(chained, nxt + np.maximum(nxt - first, OP_END_SLACK_S), np.inf)
    group = np.repeat(np.arange(len(head)), count)
    over = (at + duration[order]) > allowed[group]
    return OpSpans(over, order, r, st, group, head, first, middle, nxt, chained)


def guarded(fn, arg, source):
    """fn(arg), or the InputError naming `source` for whatever it raised: one part that a
    check does not foresee is refused alone, never its whole batch (nor the ingest thread)."""
    try:
        return fn(arg)
    except InputError as exc:
        return exc
    except Exception as exc:   # noqa: BLE001
        return InputError(source, None, f"could not be checked ({type(exc).__name__}: "
                          f"{str(exc)[:120]}); expected an op-table Parquet file")
