"""A Parquet file's footer (its thrift FileMetaData) checked before pyarrow walks it.

pyarrow trusts the footer where its metadata is walked from Python: a column chunk's type that
is not its schema leaf's, a level histogram of the wrong length, a statistic of the wrong width
make `FileMetaData.row_group(i).column(j)` (or its `.statistics`) throw a C++ exception through
a frame that may not throw, and the process aborts (std::terminate: nothing Python can catch).
Reading a table goes through Arrow's status-returning code and raises; the walk does not. So
untrusted bytes reach pyarrow only once this screen has read the footer as pyarrow's thrift
reader does (a field of an unexpected wire type is skipped, a list read as its declared field's
elements) and found none of what pyarrow 26 throws on while walking it (parquet/metadata.cc,
statistics.cc, size_statistics.cc): one column chunk per schema leaf in every row group, each
with its metadata, of its leaf's physical type; fixed-width statistics of their type's width;
level histograms empty or one count per level; no encrypted or geospatial metadata; a schema
tree that is whole and shallow (pyarrow unflattens it recursively); the file's row count its
row groups' (one of rows and no row group had the monitor look up statistics not there). Anything else a
well-written op table holds is left to pyarrow, which raises on it.

What the screen holds stays within a budget, not the footer's size: every list it keeps is
refused when its header declares more elements than the list can hold (schema elements: the
caller's column budget; a column chunk's path and level histograms: the schema's depth), and
row groups are checked one column chunk at a time as they are read, none kept (a 4 MiB footer
of 4M empty column chunks took 300 MB of Python objects, and a second, before it was refused).

The field loop (read_struct) and the compact-protocol primitives here are also the
page-header reader's (monitor/pages.py).
"""

from __future__ import annotations

import os
import stat
from typing import Any

STOP, TRUE, FALSE, BYTE, I16, I32, I64, DOUBLE, BINARY, LIST, SET, MAP, STRUCT = range(13)
INTS = (I16, I32, I64)

# nesting of thrift structs and lists followed (pyarrow's thrift reader stops at 64)
MAX_DEPTH = 32
# elements in one thrift list: a footer's lists hold a few per column or row group
MAX_LIST = 1 << 20
# schema elements (columns, their groups and the root) a footer may declare unless its caller
# says otherwise: an op table has about twenty; each is kept while its row groups are checked
MAX_COLUMNS = 4096
# nesting of the Parquet schema: pyarrow builds its tree recursively, one C++ frame per level
# (it refuses one deeper than 100 itself); a path is kept per level, so deeper is refused here
MAX_SCHEMA_DEPTH = 100
# the bytes a value of each fixed-width physical type takes in the statistics (INT96: 12)
_WIDTH = {0: 1, 1: 4, 2: 8, 3: 12, 4: 4, 5: 8}
_BOOLEAN, _FLOAT, _DOUBLE, _BYTE_ARRAY, _FLBA = 0, 4, 5, 6, 7
_LAST_CODEC = 7   # LZ4_RAW: Parquet's compression codecs are 0..7
_TYPE_NAMES = ("BOOLEAN", "INT32", "INT64", "INT96", "FLOAT", "DOUBLE", "BYTE_ARRAY",
               "FIXED_LEN_BYTE_ARRAY")


class BadThrift(ValueError):
    """Thrift bytes that cannot be read (or read within their bounds)."""


class BadFooter(BadThrift):
    """A footer that pyarrow's metadata walk could not be trusted with."""


class Short(Exception):
    """A thrift value runs past the bytes it is read from."""


def varint(b: bytes, p: int) -> tuple[int, int]:
    """(value, next position) of the unsigned varint at b[p] (IndexError past b's end)."""
    x = b[p]
    if x < 0x80:
        return x, p + 1
    value, shift = x & 0x7F, 7
    while True:
        p += 1
        x = b[p]
        value |= (x & 0x7F) << shift
        if x < 0x80:
            return value, p + 1
        shift += 7
        if shift > 63:
            raise BadThrift("a thrift number of more than 64 bits")


def zigzag(b: bytes, p: int) -> tuple[int, int]:
    """(value, next position) of the zigzag varint (a thrift integer) at b[p]."""
    v, p = varint(b, p)
    return (v >> 1) ^ -(v & 1), p


def skip(b: bytes, p: int, kind: int, depth: int, limit: int) -> int:
    """The position after a value of thrift wire type `kind` at b[p] (not past `limit`)."""
    if depth > MAX_DEPTH:
        raise BadThrift("a thrift value nests too deep")
    if kind in INTS:
        return varint(b, p)[1]
    if kind == TRUE or kind == FALSE:
        return p
    if kind == BYTE:
        return _past(b, p, 1, limit)
    if kind == DOUBLE:
        return _past(b, p, 8, limit)
    if kind == BINARY:
        n, p = varint(b, p)
        return _past(b, p, n, limit)
    if kind == LIST or kind == SET:
        n, element, p = _list_head(b, p, limit)
        if element in INTS:
            for _ in range(n):
                while b[p] & 0x80:
                    p += 1
                p += 1
            return p
        if element == STRUCT:
            for _ in range(n):
                p = _skip_struct(b, p, depth + 1, limit)
            return p
        if element == TRUE or element == FALSE:
            element = BYTE   # (a list's booleans take a byte each)
        for _ in range(n):
            p = skip(b, p, element, depth + 1, limit)
        return p
    if kind == MAP:
        n, p = varint(b, p)
        _count(n, p, limit)
        kinds = 0
        if n:
            kinds = b[p]
            p += 1
        # (a map's booleans take a byte each, as a list's do: skipped as none, a count of
        # 2**63 entries would loop without moving)
        key, value = (k if k not in (TRUE, FALSE) else BYTE for k in (kinds >> 4, kinds & 15))
        for _ in range(n):
            p = skip(b, p, key, depth + 1, limit)
            p = skip(b, p, value, depth + 1, limit)
        return p
    if kind == STRUCT:
        return _skip_struct(b, p, depth + 1, limit)
    raise BadThrift(f"an unknown thrift type {kind}")


def _past(b: bytes, p: int, n: int, limit: int) -> int:
    if p + n > limit:
        raise BadThrift("a thrift value runs past the bytes it belongs to")
    if p + n > len(b):
        raise Short
    return p + n


def _count(n: int, p: int, limit: int) -> None:
    """A container of more elements than bytes left is refused before it is looped over (each
    element takes a byte at least), and so is one past MAX_LIST."""
    if n > limit - p or n > MAX_LIST:
        raise BadThrift(f"a thrift container of {n} elements in {max(limit - p, 0)} bytes")


def _list_head(b: bytes, p: int, limit: int) -> tuple[int, int, int]:
    head = b[p]
    p += 1
    n = head >> 4
    if n == 15:
        n, p = varint(b, p)
    _count(n, p, limit)
    return n, head & 0x0F, p


# What of FileMetaData the screen reads, as pyarrow's thrift reader reads it: field id ->
# (wire type, what a struct's fields are) or, for a list, (LIST, (element's wire type, its
# spec, or a function reading the elements as they come), the most elements it may hold (None:
# as many as its bytes), what they are). A list field's elements are read as its declared type
# whatever the list's own header says (thrift's generated readers ignore it); a field of
# another wire type than declared is skipped, as thrift skips it. `fields` keys a spec as
# read_struct looks it up.


def fields(spec: dict[int, tuple]) -> dict[int, tuple]:
    """A spec {field id: (wire type, …)} keyed by id and wire type together, as read_struct
    looks a field up: one lookup finds a field and checks its type (no boolean fields)."""
    return {fid << 4 | want[0]: want for fid, want in spec.items()}


_KV: dict = {}   # (struct read but not kept: key-value pairs, logical types, …)
_STATISTICS = fields({1: (BINARY, None), 2: (BINARY, None), 5: (BINARY, None),
                      6: (BINARY, None)})
# (a level histogram holds a count per level: at most the schema's depth and one)
_HISTOGRAM = (LIST, (I64, None), MAX_SCHEMA_DEPTH + 2, "counts in a level histogram")
_SIZE_STATISTICS = fields({1: (I64, None), 2: _HISTOGRAM, 3: _HISTOGRAM})
_COLUMN_META = fields({1: (I32, None),
                       3: (LIST, (BINARY, None), MAX_SCHEMA_DEPTH + 1, "names in a column's path"),
                       4: (I32, None), 12: (STRUCT, _STATISTICS),
                       16: (STRUCT, _SIZE_STATISTICS), 17: (STRUCT, _KV)})
_COLUMN_CHUNK = fields({3: (STRUCT, _COLUMN_META), 8: (STRUCT, _KV), 9: (BINARY, None)})
_ROW_GROUP = {1: (LIST, (STRUCT, _COLUMN_CHUNK), None, "column chunks"), 3: (I64, None)}
_SCHEMA_ELEMENT = fields({1: (I32, None), 2: (I32, None), 3: (I32, None), 4: (BINARY, None),
                          5: (I32, None), 6: (I32, None), 10: (STRUCT, _KV)})
_SCHEMA = (LIST, (STRUCT, _SCHEMA_ELEMENT), MAX_COLUMNS, "schema elements")
_FILE_META = {2: _SCHEMA, 3: (I64, None), 4: (LIST, (STRUCT, fields(_ROW_GROUP)), None,
                                                 "row groups"),
              8: (STRUCT, _KV), 9: (BINARY, None)}


def read_struct(b: bytes, p: int, spec: dict, depth: int, limit: int,
                out: dict | None = None) -> tuple[dict, int]:
    """({field id: value} of the fields of `spec` (keyed by `fields`) at b[p], added to `out`,
    the position after).
    Numbers, booleans and bytes are read inline, a one-byte number without a call: this runs
    for every field of every column chunk and every page header (monitor/pages.py)."""
    if depth > MAX_DEPTH:
        raise BadThrift("a thrift value nests too deep")
    if out is None:
        out = {}
    last = 0
    while True:
        head = b[p]
        p += 1
        kind = head & 0x0F
        if kind == STOP:
            return out, p
        delta = head >> 4
        if delta:
            last += delta
        else:
            last, p = zigzag(b, p)
        # (a field of another wire type than declared is not found: thrift skips it)
        want = spec.get(last << 4 | kind)
        if I16 <= kind <= I64:   # (I16, I32, I64)
            x = b[p]
            p += 1
            if x >= 0x80:   # (offsets and sizes: a few bytes, read here without a call)
                x &= 0x7F
                shift = 7
                while True:
                    y = b[p]
                    p += 1
                    x |= (y & 0x7F) << shift
                    if y < 0x80:
                        break
                    shift += 7
                    if shift > 63:
                        raise BadThrift("a thrift number of more than 64 bits")
            if want is not None:
                out[last] = (x >> 1) ^ -(x & 1)
        elif kind == BINARY:
            n = b[p]
            if n < 0x80:
                p += 1
            else:
                n, p = varint(b, p)
            end = p + n
            if end > len(b):
                if end > limit:
                    raise BadThrift("a thrift value runs past the bytes it belongs to")
                raise Short
            if want is not None:
                out[last] = b[p:end]
            p = end
        elif kind == STRUCT:
            if want is None:
                p = _skip_struct(b, p, depth + 1, limit)
            else:
                # a struct sent twice is read into the same one (thrift's generated readers
                # set the fields each copy holds, keeping the others): the copies merge
                # (an id is read as one wire type: what it holds is such a struct's dict)
                out[last], p = read_struct(b, p, want[1], depth + 1, limit, out.get(last))
        elif kind == TRUE or kind == FALSE:
            pass
        elif kind == LIST and want is not None:
            out[last], p = _list(b, p, want, depth + 1, limit, out)
        else:
            p = skip(b, p, kind, depth + 1, limit)


def _skip_struct(b: bytes, p: int, depth: int, limit: int) -> int:
    """The position after the struct at b[p], none of it kept (_struct's loop, less its
    bookkeeping: encoding stats, logical types and key-value pairs are skipped this way)."""
    if depth > MAX_DEPTH:
        raise BadThrift("a thrift value nests too deep")
    while True:
        head = b[p]
        p += 1
        kind = head & 0x0F
        if kind == STOP:
            return p
        if not head >> 4:
            p = varint(b, p)[1]
        if I16 <= kind <= I64:
            while b[p] >= 0x80:
                p += 1
            p += 1
        elif kind == TRUE or kind == FALSE:
            pass
        elif kind == BINARY:   # (statistics' values: a short length, read without a call)
            n = b[p]
            if n < 0x80:
                p += 1
            else:
                n, p = varint(b, p)
            p += n
            if p > len(b):
                if p > limit:
                    raise BadThrift("a thrift value runs past the bytes it belongs to")
                raise Short
        elif kind == STRUCT:
            p = _skip_struct(b, p, depth + 1, limit)
        else:
            p = skip(b, p, kind, depth + 1, limit)


def _list(b: bytes, p: int, field: tuple, depth: int, limit: int,
          out: dict) -> tuple[object, int]:
    """The elements of the list at b[p], read as its `field` (LIST, element, most, what)
    declares them; refused before they are read when there are more than `most`. A function
    as the element reads them as they come: `element(b, p, n, depth, limit, out)` (`out`: the
    struct read so far) -> (what to keep, the position after)."""
    n, _, p = _list_head(b, p, limit)
    _, element, most, what = field
    if most is not None and n > most:
        raise BadFooter(f"{n} {what}; expected at most {most}")
    if callable(element):
        return element(b, p, n, depth, limit, out)
    kind, sub = element
    items: list = []
    if kind == STRUCT:
        for _ in range(n):
            item, p = read_struct(b, p, sub, depth, limit)
            items.append(item)
    elif kind == BINARY:
        for _ in range(n):
            size, p = varint(b, p)
            end = _past(b, p, size, limit)
            items.append(b[p:end])
            p = end
    else:   # (integers: the only other elements read)
        for _ in range(n):
            x, p = zigzag(b, p)
            items.append(x)
    return items, p


# a thrift struct as read: {field id: its value (an int, bytes, a list, a nested Struct)}
Struct = dict[int, Any]


def parse_footer(footer: bytes, spec: dict = _FILE_META) -> Struct:
    """The fields of `spec` (FileMetaData's the screen checks) read from a footer's bytes, all
    of them kept (BadThrift when they are not thrift): check_footer keeps no row group."""
    try:
        return read_struct(footer, 0, fields(spec), 0, len(footer))[0]
    except (IndexError, Short):
        raise BadFooter("its thrift runs past the footer's end") from None


def _leaves(schema: list[dict]) -> list[tuple[list[bytes], dict, int, int]]:
    """(path, element, max definition level, max repetition level) of each leaf of a schema,
    as pyarrow unflattens it (schema.cc Unflatten, SchemaDescriptor::BuildTree)."""
    if not schema:
        raise BadFooter("an empty schema (no root)")
    if schema[0].get(5, 0) <= 0:
        if len(schema) == 1:
            return []
        raise BadFooter("a schema whose root has no children")
    out: list = []
    pos = 1
    # (children left, path, definition level, repetition level) of each open group
    stack = [[schema[0][5], [], 0, 0]]
    while stack:
        top = stack[-1]
        if top[0] <= 0:
            stack.pop()
            continue
        top[0] -= 1
        if pos == len(schema):
            raise BadFooter("a schema with fewer elements than its groups declare")
        element = schema[pos]
        pos += 1
        repetition = element.get(3)
        d, r = top[2] + (repetition in (1, 2)), top[3] + (repetition == 2)
        path = top[1] + [element.get(4, b"")]
        children = element.get(5, 0)
        if children == 0 and 1 in element:
            out.append((path, element, d, r))
            continue
        if len(stack) >= MAX_SCHEMA_DEPTH:
            raise BadFooter(f"a schema nested more than {MAX_SCHEMA_DEPTH} deep")
        stack.append([children, path, d, r])
    return out


def _name(path: list[bytes]) -> str:
    return ".".join(p.decode("utf-8", "replace") for p in path)[:80]


def check_footer(footer: bytes, max_columns: int = MAX_COLUMNS,
                 max_row_groups: int | None = None, max_rows: int | None = None) -> None:
    """BadFooter naming the column and what is wrong unless pyarrow can be given `footer` (a
    Parquet file's FileMetaData bytes) to walk (see the module's docstring), or when it
    declares more than its caller takes: schema elements past `max_columns`, row groups past
    `max_row_groups`, rows (the file's, or its row groups' together) past `max_rows`."""
    screen = _Screen(max_columns, max_row_groups, max_rows)
    meta = parse_footer(footer, screen.file_meta)
    if 8 in meta or 9 in meta:
        raise BadFooter("an encrypted footer; expected a plain Parquet file")
    if 4 in meta and meta.get(2) is not screen.schema:
        # (the row groups were checked against the schema before it)
        raise BadFooter("a schema after the row groups; expected the schema first, as "
                        "Parquet writers write it")
    if 4 not in meta:
        _leaves(meta.get(2, []))
    _count_rows(meta.get(3, 0), max_rows, "the file")
    if 3 in meta and meta[3] != screen.rows:
        # (pyarrow reports the file's count and walks its row groups: a file of rows and no
        # row group had its readers look up statistics that were not there)
        raise BadFooter(f"the file declares {meta[3]} rows; its row groups hold {screen.rows}")


def _count_rows(rows: int, most: int | None, what: str) -> None:
    if most is not None and rows > most:
        raise BadFooter(f"{what} declares {rows} rows; expected at most {most}")


class _Screen:
    """check_footer's reading of one footer: its schema's leaves once read, each row group's
    column chunks checked against them as they are read, none kept."""

    def __init__(self, max_columns: int, max_row_groups: int | None, max_rows: int | None):
        self.max_rows = max_rows
        self.schema: list | None = None
        self.leaves: list = []
        self.group = 0    # the row group read now (its number)
        self.rows = 0     # rows of the row groups read so far (of the last list of them)
        self.row_group = fields({**_ROW_GROUP, 1: (LIST, self._chunks, None, "column chunks")})
        self.file_meta = {**_FILE_META,
                          2: (LIST, _SCHEMA[1], max_columns, _SCHEMA[3]),
                          4: (LIST, self._row_groups, max_row_groups, "row groups")}

    def _row_groups(self, b: bytes, p: int, n: int, depth: int, limit: int,
                    out: dict) -> tuple[int, int]:
        """Reads and checks FileMetaData's list of `n` row groups at b[p]."""
        schema = out.get(2)
        if schema is None:
            raise BadFooter("row groups before the schema; expected the schema first, as "
                            "Parquet writers write it")
        if schema is not self.schema:
            self.schema, self.leaves = schema, _leaves(schema)
        self.rows = 0   # (a list sent again replaces the one before)
        for _ in range(n):
            group, p = read_struct(b, p, self.row_group, depth, limit)
            if 1 not in group and self.leaves:
                raise BadFooter(f"row group {self.group} has 0 column chunks; the schema has "
                                f"{len(self.leaves)} columns")
            self.rows += group.get(3, 0)   # (its num_rows)
            _count_rows(self.rows, self.max_rows, f"row groups 0..{self.group}")
            self.group += 1
        return n, p

    def _chunks(self, b: bytes, p: int, n: int, depth: int, limit: int,
                out: dict) -> tuple[int, int]:
        """Reads and checks a row group's list of `n` column chunks at b[p], one per leaf."""
        if n != len(self.leaves):
            raise BadFooter(f"row group {self.group} has {n} column chunks; the schema has "
                            f"{len(self.leaves)} columns")
        for leaf in self.leaves:
            chunk, p = read_struct(b, p, _COLUMN_CHUNK, depth, limit)
            _check_chunk(chunk, leaf)
        return n, p


def _check_chunk(chunk: dict, leaf: tuple) -> None:
    path, element, max_def, max_rep = leaf
    name = _name(path)
    if 8 in chunk or 9 in chunk:
        raise BadFooter(f"column {name}: encrypted column metadata; expected a plain file")
    meta = chunk.get(3)
    if meta is None:
        raise BadFooter(f"column {name}: a column chunk without its metadata")
    physical = element[1]
    if not 0 <= physical < len(_TYPE_NAMES):
        raise BadFooter(f"column {name}: physical type {physical}; expected one of Parquet's")
    kind = meta.get(1)
    if kind != physical:
        raise BadFooter(f"column {name}: its column chunk is of type {kind}; the schema says "
                        f"{_TYPE_NAMES[physical]}")
    if meta.get(3) != path:
        raise BadFooter(f"column {name}: its column chunk names another column")
    codec = meta.get(4)
    if codec is not None and not 0 <= codec <= _LAST_CODEC:
        # (pyarrow 26 throws on reading a codec it does not know: `.compression`)
        raise BadFooter(f"column {name}: compression codec {codec}; expected one of "
                        f"Parquet's (0..{_LAST_CODEC})")
    if 17 in meta:
        raise BadFooter(f"column {name}: geospatial statistics; expected none")
    stats = meta.get(12)
    if stats is not None:
        width: int | None = _WIDTH.get(physical)
        if physical == _FLBA:
            width = element.get(2, 0)
            if width <= 0:
                raise BadFooter(f"column {name}: fixed-length values of {width} bytes")
        if width is not None:
            for value in stats.values():
                if len(value) != width:
                    raise BadFooter(f"column {name}: a statistic of {len(value)} bytes; "
                                    f"{_TYPE_NAMES[physical]} takes {width}")
        if physical in (_BOOLEAN, _FLOAT, _DOUBLE) and (6 in element or 10 in element):
            # (pyarrow has no unsigned comparison of these: an annotation that makes their
            # order unsigned throws once the statistics are made)
            raise BadFooter(f"column {name}: a {_TYPE_NAMES[physical]} column with a logical "
                            "type; expected a plain one")
    sizes = meta.get(16)
    if sizes is not None:
        for field, level, what in ((2, max_rep, "repetition"), (3, max_def, "definition")):
            histogram = sizes.get(field, [])
            if histogram and len(histogram) != level + 1:
                raise BadFooter(f"column {name}: a {what} level histogram of "
                                f"{len(histogram)} counts; expected {level + 1}")
        if 1 in sizes and physical != _BYTE_ARRAY:
            raise BadFooter(f"column {name}: unencoded byte-array sizes in a "
                            f"{_TYPE_NAMES[physical]} column")


def footer_of(data: bytes) -> bytes:
    """The footer's bytes of a whole Parquet file in memory (BadFooter when it has none)."""
    if len(data) < 12 or data[-4:] != b"PAR1":
        raise BadFooter("no Parquet footer (the file does not end in PAR1)")
    n = int.from_bytes(data[-8:-4], "little")
    if n > len(data) - 12:
        raise BadFooter(f"a footer of {n} bytes in a file of {len(data)}")
    return bytes(data[len(data) - 8 - n:len(data) - 8])


def as_file(footer: bytes) -> bytes:
    """A Parquet file holding only `footer`: pyarrow reads its metadata from these bytes, the
    ones screened, whatever the file on disk holds by then."""
    return b"PAR1" + footer + len(footer).to_bytes(4, "little") + b"PAR1"


def checked_metadata(footer: bytes):
    """pyarrow's FileMetaData of `footer` once check_footer passes it (BadFooter otherwise)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    check_footer(footer)
    return pq.read_metadata(pa.BufferReader(as_file(footer)))


def read_checked_metadata(path, max_bytes: int = 64 << 20):
    """checked_metadata of a Parquet file on disk, its footer read once (BadFooter, OSError)."""
    # opened without blocking, and read only when regular: a FIFO named like a rank file hung
    # the analysis for good
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BadFooter("not a regular file")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as f:
        f.seek(0, 2)
        size = f.tell()
        if size < 12:
            raise BadFooter(f"{size} bytes: too short for Parquet")
        f.seek(size - 8)
        tail = f.read(8)
        if tail[4:] != b"PAR1":
            raise BadFooter("no Parquet footer (the file does not end in PAR1)")
        n = int.from_bytes(tail[:4], "little")
        if n > size - 12 or n > max_bytes:
            raise BadFooter(f"a footer of {n} bytes in a file of {size}")
        f.seek(size - 8 - n)
        footer = f.read(n)
    return checked_metadata(footer)

