"""The analysis reads no Parquet footer pyarrow cannot walk: a rank file whose footer disagrees
with itself gives one line naming the file and a non-zero exit, where pyarrow's metadata walk
aborted the process (SIGABRT, rc 134). Footers are made by changing a real file's bytes, or
written here with a few lines of thrift; every check that could abort runs in a child."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from stragglers.trace.parquet_footer import BadFooter, check_footer, parse_footer
from stragglers.trace.runformat import write_run
from stragglers.trace.synth import generate

STRAGGLERS = [sys.executable, "-c", "from stragglers.cli import main; main()"]


def _footer_start(body: bytes) -> int:
    return len(body) - 8 - int.from_bytes(body[-8:-4], "little")


def chunk_type_changed(body: bytes, column: bytes) -> bytes:
    """`column`'s ColumnMetaData type (the first field of a ColumnChunk's field 3) set to 0."""
    path = body.index(b"\x19\x18" + bytes([len(column)]) + column, _footer_start(body))
    at = body.rindex(b"\x1c\x15", _footer_start(body), path) + 2
    return body[:at] + b"\x00" + body[at + 1:]


def made_required(body: bytes, column: bytes) -> bytes:
    """`column`'s schema element turned from OPTIONAL to REQUIRED (its level histograms no
    longer fit)."""
    at = body.index(b"%\x02\x18" + bytes([len(column)]) + column, _footer_start(body))
    return body[:at + 1] + b"\x00" + body[at + 2:]


def statistic_shortened(body: bytes, column: bytes) -> bytes:
    """`column`'s statistics' max_value one byte short (the footer's length kept true)."""
    start = _footer_start(body)
    path = body.index(b"\x19\x18" + bytes([len(column)]) + column, start)
    at = body.index(b"\x28\x08", path)   # Statistics field 5 (max_value), 8 bytes (INT64)
    out = body[:at + 1] + b"\x07" + body[at + 2:at + 9] + body[at + 10:-8]
    return out + (len(out) - start).to_bytes(4, "little") + b"PAR1"


def a_run(directory: Path, corrupt) -> Path:
    """A run directory whose second rank file's footer is changed by `corrupt` (its step
    column: the one the partitioned analysis walks first)."""
    write_run(directory, generate(dp=2, pp=2, microbatches=4, steps=12, seed=0))
    victim = sorted(directory.glob("rank-*.parquet"))[1]
    victim.write_bytes(corrupt(victim.read_bytes(), b"step"))
    return victim


@pytest.mark.slow
@pytest.mark.parametrize("corrupt", [chunk_type_changed, made_required, statistic_shortened],
                         ids=["chunk-type", "level-histogram", "statistic-width"])
def test_analyze_names_the_rank_file_whose_footer_disagrees_with_itself(tmp_path, corrupt):
    victim = a_run(tmp_path / "run", corrupt)
    got = subprocess.run([*STRAGGLERS, "analyze", str(tmp_path / "run")], capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    assert got.returncode > 0, f"rc {got.returncode}: {got.stderr[-600:]}"
    lines = [line for line in got.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(victim) in lines[0], \
        got.stderr[-600:]
    assert "column step" in lines[0]


READ = r"""
import sys
from stragglers.errors import InputError
from stragglers.trace.runformat import read_run
from stragglers.whatif.partitioned import run_layout
for name, fn in (("read_run", read_run), ("run_layout", run_layout)):
    try:
        fn(sys.argv[1])
        print(name, "read")
    except InputError as exc:
        print(name, "InputError", exc)
"""


@pytest.mark.slow
def test_the_analysis_readers_refuse_it_with_an_error_naming_the_file(tmp_path):
    victim = a_run(tmp_path / "run", made_required)
    got = subprocess.run([sys.executable, "-c", READ, str(tmp_path / "run")],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert got.returncode == 0, f"rc {got.returncode}: {got.stderr[-600:]}"
    lines = got.stdout.splitlines()
    assert len(lines) == 2 and all(" InputError " in line and str(victim) in line
                                   for line in lines), got.stdout


# --- footers written here: the thrift compact protocol, a field (id, wire type, value) ------

STOP, I32, I64, BINARY, LIST, STRUCT = 0, 5, 6, 8, 9, 12


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _value(kind: int, v) -> bytes:
    if kind in (I32, I64):
        return _uvarint((v << 1) ^ (v >> 63))
    if kind == BINARY:
        return _uvarint(len(v)) + v
    if kind == STRUCT:
        return thrift(v)
    if isinstance(v, bytes):   # (a list written out already)
        return v
    element, items = v
    assert len(items) < 15
    return bytes([(len(items) << 4) | element]) + b"".join(_value(element, x) for x in items)


def thrift(fields) -> bytes:
    """A struct of `fields` (id, wire type, value) in their order (an id may repeat)."""
    out, last = bytearray(), 0
    for fid, kind, v in fields:
        if 0 < fid - last <= 15:
            out += bytes([((fid - last) << 4) | kind])
        else:   # (the long form: the id itself, a zigzag varint)
            out += bytes([kind]) + _uvarint(fid << 1)
        last = fid
        out += _value(kind, v)
    return bytes(out + bytes([STOP]))


def _chunk(name: bytes, *extra, codec: int = 0):
    """A ColumnChunk of one INT32 column `name`, its ColumnMetaData's fields then `extra`."""
    meta = [(1, I32, 1), (2, LIST, (I32, [0])), (3, LIST, (BINARY, [name])), (4, I32, codec),
            (5, I64, 1), (6, I64, 10), (7, I64, 10), (9, I64, 4), *extra]
    return [(2, I64, 4), (3, STRUCT, meta)]


def footer(chunks) -> bytes:
    """A FileMetaData of one OPTIONAL INT32 leaf `x` and a row group of `chunks`."""
    schema = [[(4, BINARY, b"schema"), (5, I32, 1)], [(1, I32, 1), (3, I32, 1), (4, BINARY, b"x")]]
    group = [(1, LIST, (STRUCT, chunks)), (2, I64, 10), (3, I64, 1)]
    return thrift([(1, I32, 2), (2, LIST, (STRUCT, schema)), (3, I64, 1),
                   (4, LIST, (STRUCT, [group])),
                   (6, BINARY, b"parquet-cpp-arrow version 26.0.1")])


def as_parquet(meta: bytes) -> bytes:
    return b"PAR1" + meta + len(meta).to_bytes(4, "little") + b"PAR1"


BUILT = {
    # more column chunks than schema leaves: pyarrow looks up a leaf that is not there
    "extra-chunk": footer([_chunk(b"x"), _chunk(b"x")]),
    # a ColumnMetaData sent twice, its bad histogram in the first copy only: thrift's reader
    # keeps the fields the second copy does not set
    "merged-copies": footer([_chunk(b"x", (16, STRUCT, [(3, LIST, (I64, [1, 2, 3]))]))
                             + [(3, STRUCT, _chunk(b"x")[1][2])]]),
    # a compression codec Parquet does not have: pyarrow 26 throws reading `.compression`
    "unknown-codec": footer([_chunk(b"x", codec=62)]),
}

ROUTES = r"""
import sys
from pathlib import Path
from stragglers.errors import InputError
from stragglers.monitor.part_footers import read_part_footer
path = Path(sys.argv[1])
print("watched", type(read_part_footer(path)).__name__, flush=True)
from stragglers.whatif.partitioned import _metadata
try:
    md = _metadata(str(path))
    print("analysis", [(md.row_group(0).column(i).statistics,
                        md.row_group(0).column(i).compression)
                       for i in range(md.row_group(0).num_columns)], flush=True)
except InputError as exc:
    print("analysis InputError", exc, flush=True)
"""


@pytest.mark.slow
@pytest.mark.parametrize("built", list(BUILT))
def test_footers_that_abort_pyarrows_walk_are_refused_before_it(tmp_path, built):
    with pytest.raises(BadFooter):
        check_footer(BUILT[built])
    path = tmp_path / "rank-00000.part-000000.parquet"
    path.write_bytes(as_parquet(BUILT[built]))
    got = subprocess.run([sys.executable, "-c", ROUTES, str(path)], capture_output=True,
                         text=True, cwd=REPO, timeout=300)
    assert got.returncode == 0, f"rc {got.returncode}: {got.stderr[-600:]}"
    assert got.stdout.splitlines() == ["watched InputError",
                                       got.stdout.splitlines()[1]], got.stdout
    assert got.stdout.splitlines()[1].startswith("analysis InputError"), got.stdout


def test_a_field_of_another_wire_type_is_skipped_as_thrift_skips_it():
    # the chunk's type sent as a binary: thrift leaves the field unset (BOOLEAN, its default),
    # so the screen may not read it as INT32
    chunk = [(2, I64, 4), (3, STRUCT, [(1, BINARY, b"\x02"), *_chunk(b"x")[1][2][1:]])]
    parsed = parse_footer(footer([chunk]))
    assert 1 not in parsed[4][0][1][0][3]
    with pytest.raises(BadFooter, match="column x: a column chunk without its metadata|type"):
        check_footer(footer([chunk]))
    check_footer(footer([_chunk(b"x")]))


# --- footers that declare more than the screen may hold --------------------------------------

def _list_of(element: int, n: int, items: bytes) -> bytes:
    """A thrift list header of `n` elements of wire type `element` (long form), then `items`."""
    return bytes([0xF0 | element]) + _uvarint(n) + items


def _one_leaf_schema() -> bytes:
    """FileMetaData's fields up to its schema (one INT32 leaf `x`), its STOP left off."""
    return thrift([(1, I32, 2), (2, LIST, (STRUCT, [[(4, BINARY, b"schema"), (5, I32, 1)],
                                                    [(1, I32, 1), (4, BINARY, b"x")]]))])[:-1]


def _peak_bytes(fn) -> tuple[int, Exception]:
    """The peak of Python allocations while `fn()` runs (tracemalloc), and what it raised."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
    except Exception as exc:   # noqa: BLE001 - returned: the caller asserts its class
        raised = exc
    else:
        raise AssertionError("not refused")
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, raised


def test_a_footer_of_millions_of_empty_column_chunks_is_refused_holding_none_of_them():
    # 4 MiB: four row groups of ~1M empty column chunks (a byte each) for a one-column schema;
    # every chunk was built as a dict (~300 MB) before the count was compared
    n = (1 << 20) - 16
    group = b"\x19" + _list_of(STRUCT, n, b"\x00" * n) + b"\x00"
    meta = _one_leaf_schema() + b"\x29" + bytes([(4 << 4) | STRUCT]) + group * 4 + b"\x00"
    assert len(meta) > 4 << 20 - 1
    peak, raised = _peak_bytes(lambda: check_footer(meta))
    assert isinstance(raised, BadFooter) and "row group 0 has 1048560 column chunks; the " \
        "schema has 1 columns" in str(raised), raised
    assert peak < 256 << 10, peak


@pytest.mark.parametrize("where", ["schema", "path", "histogram"])
def test_a_kept_list_longer_than_it_can_hold_is_refused_before_its_elements_are_read(where):
    # a million elements of a byte each (empty structs, names, zero counts) in a list the
    # screen keeps: refused at its header, whatever its bytes would allow
    n = 1 << 20
    if where == "schema":
        meta = thrift([(1, I32, 2)])[:-1] + b"\x19" + _list_of(STRUCT, n, b"\x00" * n) + b"\x00"
        expected = f"{n} schema elements; expected at most 4096"
    else:
        # a chunk whose ColumnMetaData's path (3), or its definition level histogram (16.3),
        # holds the million: sent again after the good chunk's fields (the last one counts)
        many = _list_of(BINARY if where == "path" else I64, n, b"\x00" * n)
        extra = (3, LIST, many) if where == "path" else (16, STRUCT, [(3, LIST, many)])
        meta = footer([_chunk(b"x", extra)])
        expected = ("names in a column's path; expected at most 101" if where == "path" else
                    "counts in a level histogram; expected at most 102")
    peak, raised = _peak_bytes(lambda: check_footer(meta))
    assert peak < 256 << 10, peak
    assert isinstance(raised, BadFooter) and expected in str(raised), raised


def test_the_callers_budget_bounds_columns_row_groups_and_rows():
    meta = footer([_chunk(b"x")])   # two schema elements, one row group of one row
    check_footer(meta, max_columns=2, max_row_groups=1, max_rows=1)
    for budget, expected in (({"max_columns": 1}, "2 schema elements; expected at most 1"),
                             ({"max_row_groups": 0}, "1 row groups; expected at most 0"),
                             ({"max_rows": 0}, "declares 1 rows; expected at most 0")):
        with pytest.raises(BadFooter, match=expected):
            check_footer(meta, **budget)


def test_row_groups_are_checked_against_the_schema_read_before_them():
    schema = [[(4, BINARY, b"schema"), (5, I32, 1)], [(1, I32, 1), (4, BINARY, b"x")]]
    group = [(1, LIST, (STRUCT, [_chunk(b"x")])), (2, I64, 10)]
    before = thrift([(1, I32, 2), (4, LIST, (STRUCT, [group])), (2, LIST, (STRUCT, schema))])
    with pytest.raises(BadFooter, match="row groups before the schema"):
        check_footer(before)
    # a second schema after the row groups (thrift keeps the last one): refused too
    after = thrift([(2, LIST, (STRUCT, schema)), (4, LIST, (STRUCT, [group])),
                    (2, LIST, (STRUCT, schema))])
    with pytest.raises(BadFooter, match="a schema after the row groups"):
        check_footer(after)
    check_footer(thrift([(2, LIST, (STRUCT, schema)), (4, LIST, (STRUCT, [group]))]))


def _row_groups_emptied(body: bytes) -> bytes:
    """A Parquet file whose FileMetaData keeps its row count but lists no row group (its field
    4 replaced by an empty list), the footer's length kept true."""
    from stragglers.trace.parquet_footer import skip

    start = _footer_start(body)
    meta, p, last = body[start:-8], 0, 0
    while True:
        head = meta[p]
        last += head >> 4
        p += 1
        if last == 4:
            end = skip(meta, p, head & 0x0F, 0, len(meta))
            meta = meta[:p] + bytes([STRUCT]) + meta[end:]   # (a list of no structs)
            return body[:start] + meta + len(meta).to_bytes(4, "little") + b"PAR1"
        p = skip(meta, p, head & 0x0F, 0, len(meta))


def test_a_file_whose_row_count_its_row_groups_do_not_hold_is_refused(tmp_path):
    # rows declared and no row group: the monitor's footer checks looked up statistics of
    # row groups that were not there (KeyError, "could not be checked")
    from stragglers.monitor.parts import read_upload

    write_run(tmp_path / "run", generate(dp=1, pp=1, microbatches=2, steps=2, seed=0))
    body = _row_groups_emptied((tmp_path / "run" / "rank-00000.parquet").read_bytes())
    with pytest.raises(BadFooter, match=r"the file declares \d+ rows; its row groups hold 0"):
        check_footer(body[_footer_start(body):-8])
    got = read_upload(body, "upload", 0, 0, tmp_path / "rank-00000.part-000000.parquet")
    assert "its row groups hold 0" in str(got) and "could not be checked" not in str(got), got
