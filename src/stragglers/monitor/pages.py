"""A Parquet part's page headers checked against its footer before any page is decoded.

The footer's declared sizes bound what a part takes decoded (parts.check_decode_budget), but the
reader allocates what each page header declares: a page claiming 2 GB uncompressed, or a
dictionary of 2**31 values, is allocated before the bytes behind it are found missing. Each
column chunk's page headers (thrift compact protocol) are read here, without decoding a page,
and must stay within the footer: pages inside the chunk, uncompressed sizes summing to at most
the chunk's declared size, values per page at most the row group's rows, a dictionary of at
most one value per byte.

A header is parsed from one slice of the file (the whole column chunk when the part is in
memory), one index per byte and no call per byte, only its type, sizes and value count kept:
~0.4x the CPU of a reader object called per byte (benchmarks/monitor_footer_check.py). A header
that does not fit its slice of a file is read again from a larger one, up to MAX_HEADER_BYTES.
"""

from __future__ import annotations

# the compact protocol's primitives are the footer screen's (one thrift reader)
from stragglers.trace.parquet_footer import BINARY as _BINARY, FALSE as _FALSE, I16 as _I16, \
    I32 as _I32, I64 as _I64, STOP as _STOP, STRUCT as _STRUCT, TRUE as _TRUE, BadThrift, \
    Short as _Short, skip as _skip, varint as _varint, zigzag as _zigzag

_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = range(4)
# the field of a page header holding each page type's own header (its field 1: num_values)
_SUB_HEADER = {_DATA_PAGE: 5, _DICTIONARY_PAGE: 7, _DATA_PAGE_V2: 8}
MAX_DEPTH = 8
MAX_PAGES = 1 << 20
# a page header larger than this is refused: Arrow's reader gives up on one past 16 MiB too
# (parquet-cpp kDefaultMaxPageHeaderSize), and no slice of the file is read beyond it
MAX_HEADER_BYTES = 16 << 20
_FIRST_SLICE = 512   # bytes read for a header at first (a recorder's are ~20-60 bytes)


class BadPage(BadThrift):
    """A page header that cannot be read, or that declares more than its footer allows."""


def _struct(b: bytes, p: int, depth: int, limit: int) -> tuple[int | None, int]:
    """(its integer field 1 — a page type's num_values — or None, the position after) of the
    struct at b[p]. The common kinds (numbers, booleans, bytes, structs) are read inline, a
    one-byte number without a call: this runs for every field of every page's statistics."""
    first = None
    last = 0
    while True:
        head = b[p]
        p += 1
        kind = head & 0x0F
        if kind == _STOP:
            return first, p
        delta = head >> 4
        if delta:
            last += delta
        else:
            last, p = _zigzag(b, p)
        if kind == _I32 or kind == _I64 or kind == _I16:
            x = b[p]
            if x < 0x80:
                p += 1
            else:
                x, p = _varint(b, p)
            if last == 1:
                first = (x >> 1) ^ -(x & 1)
        elif kind == _TRUE or kind == _FALSE:
            pass
        elif kind == _BINARY:
            n = b[p]
            if n < 0x80:
                p += 1
            else:
                n, p = _varint(b, p)
            p += n
            if p > len(b):
                if p > limit:
                    raise BadPage("a page header runs past its column chunk")
                raise _Short
        elif kind == _STRUCT:
            if depth >= MAX_DEPTH:
                raise BadPage("a page header nests too deep")
            p = _struct(b, p, depth + 1, limit)[1]
        else:   # (a value of another type is skipped, as a thrift reader does)
            p = _skip(b, p, kind, depth, limit)


def _header(b: bytes, p: int, limit: int) -> tuple[int | None, int | None, int | None,
                                                   dict, int]:
    """(type, uncompressed size, compressed size, {sub-header field: its num_values}, the
    position after) of the page header at b[p]; `limit`: where its column chunk ends in b."""
    kind_of_page = uncompressed = compressed = None
    subs: dict[int, int | None] = {}
    last = 0
    while True:
        head = b[p]
        p += 1
        kind = head & 0x0F
        if kind == _STOP:
            return kind_of_page, uncompressed, compressed, subs, p
        delta = head >> 4
        if delta:
            last += delta
        else:
            last, p = _zigzag(b, p)
        if kind == _I32 or kind == _I64 or kind == _I16:
            x = b[p]
            if x < 0x80:
                p += 1
            else:
                x, p = _varint(b, p)
            value = (x >> 1) ^ -(x & 1)
            if last == 1:
                kind_of_page = value
            elif last == 2:
                uncompressed = value
            elif last == 3:
                compressed = value
            elif last == 5 or last == 7 or last == 8:
                subs[last] = None   # an integer where a page type's header belongs
        elif kind == _STRUCT and (last == 5 or last == 7 or last == 8):
            subs[last], p = _struct(b, p, 1, limit)
        else:
            p = _skip(b, p, kind, 0, limit)


def _read_header(buf, pos: int, end: int) -> tuple:
    """_header of the page at buf[pos:] of a file not in memory (part_files.FileBytes), read
    from slices growing until the header fits; never past `end`."""
    size = _FIRST_SLICE
    while True:
        stop = min(end, pos + size)
        b = buf[pos:stop]
        try:
            kind, uncompressed, compressed, subs, length = _header(b, 0, end - pos)
            return kind, uncompressed, compressed, subs, pos + length
        except (IndexError, _Short):
            if stop == end:
                raise BadPage("a page header runs past its column chunk") from None
            if size >= MAX_HEADER_BYTES:
                raise BadPage(f"a page header of more than {MAX_HEADER_BYTES} bytes") from None
            size = min(size * 16, MAX_HEADER_BYTES)


def check_chunk_pages(buf, start: int, end: int, declared_uncompressed: int,
                      rows: int) -> None:
    """BadPage unless the pages of one column chunk `buf[start:end]` (bytes, or a file's
    part_files.FileBytes) stay within what its footer declares."""
    in_memory = isinstance(buf, (bytes, bytearray, memoryview))
    chunk = buf[start:end] if in_memory else b""   # (positions below are in the file)
    pos, count, total = start, 0, 0
    while pos < end:
        count += 1
        if count > MAX_PAGES:
            raise BadPage(f"more than {MAX_PAGES} pages in one column chunk")
        if in_memory:
            try:
                kind, uncompressed, size, subs, after = _header(chunk, pos - start, end - start)
            except IndexError:
                raise BadPage("a page header runs past its column chunk") from None
            after += start
        else:
            kind, uncompressed, size, subs, after = _read_header(buf, pos, end)
        if after - pos > MAX_HEADER_BYTES:
            raise BadPage(f"a page header of more than {MAX_HEADER_BYTES} bytes")
        if size is None or kind is None or uncompressed is None:
            raise BadPage("a page header lacks its type or sizes")
        if size < 0 or uncompressed < 0 or after + size > end:
            raise BadPage(f"a page declares {size} bytes where its column chunk has "
                          f"{end - after}")
        pos = after + size
        total += uncompressed
        if total > declared_uncompressed:
            raise BadPage(f"a page declares {uncompressed} bytes uncompressed; the footer "
                          f"declares {declared_uncompressed} for the whole column chunk")
        values = subs.get(_SUB_HEADER.get(kind, 0)) if subs else None
        if values is None:
            if kind in _SUB_HEADER:
                raise BadPage("a page header lacks its value count")
            continue
        if values < 0:
            raise BadPage(f"a page declares {values} values")
        if kind == _DICTIONARY_PAGE and values > uncompressed:
            raise BadPage(f"a dictionary page declares {values} values in {uncompressed} "
                          "bytes")
        if kind != _DICTIONARY_PAGE and values > rows:
            raise BadPage(f"a page declares {values} values; its row group has {rows} rows")


def check_pages(meta, buf, data_end: int) -> tuple[str, str] | None:
    """(column, problem) of the first column chunk whose pages pass what the footer `meta`
    declares (or that lies outside the file's data, `buf[4:data_end]`), else None."""
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        rows = group.num_rows
        for i in range(group.num_columns):
            col = group.column(i)
            start = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset:
                # (a chunk of no rows has its dictionary page only, and data page offset 0:
                # a zero-row part, as pyarrow writes it, was refused as lying outside the file)
                start = min(start, col.dictionary_page_offset) if start else \
                    col.dictionary_page_offset
            end = start + col.total_compressed_size
            if start < 4 or col.total_compressed_size < 0 or end > data_end:
                return col.path_in_schema, (f"its column chunk declares bytes {start}..{end}; "
                                            f"the file's data ends at {data_end}")
            try:
                check_chunk_pages(buf, start, end, col.total_uncompressed_size, rows)
            except BadThrift as exc:   # (BadPage, or thrift no reader could skip)
                return col.path_in_schema, str(exc)
    return None
