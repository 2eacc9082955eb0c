"""A Parquet part's page headers checked against its footer before any page is decoded.

The footer's declared sizes bound what a part takes decoded (parts.check_decode_budget), but the
reader allocates what each page header declares: a page claiming 2 GB uncompressed, or a
dictionary of 2**31 values, is allocated before the bytes behind it are found missing. Each
column chunk's page headers (thrift compact protocol) are read here, without decoding a page,
and must stay within the footer: pages inside the chunk, uncompressed sizes summing to at most
the chunk's declared size, values per page at most the row group's rows, a dictionary of at
most one value per byte.

A header is parsed from one slice of the file (the whole column chunk when the part is in
memory) by the footer screen's thrift reader (parquet_footer.read_struct: one field loop, a
field of an unexpected wire type skipped as thrift skips it), only its type, sizes and value
counts kept. A header that does not fit its slice of a file is read again from a larger one,
up to MAX_HEADER_BYTES.
"""

from __future__ import annotations

# the footer screen's thrift reader (one field loop for both)
from stragglers.trace.parquet_footer import I32 as _I32, MAX_DEPTH as _THRIFT_DEPTH, \
    STRUCT as _STRUCT, BadThrift, Short as _Short, fields as _fields, \
    read_struct as _read_struct

_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = range(4)
# the field of a page header holding each page type's own header (its field 1: num_values)
_SUB_HEADER = {_DATA_PAGE: 5, _DICTIONARY_PAGE: 7, _DATA_PAGE_V2: 8}
MAX_DEPTH = 8
MAX_PAGES = 1 << 20
# a page header larger than this is refused: Arrow's reader gives up on one past 16 MiB too
# (parquet-cpp kDefaultMaxPageHeaderSize), and no slice of the file is read beyond it
MAX_HEADER_BYTES = 16 << 20
_FIRST_SLICE = 512   # bytes read for a header at first (a recorder's are ~20-60 bytes)

# what of a PageHeader is read (as the footer screen's specs): its type, sizes and each page
# type's header's num_values; the rest (statistics, CRC, ...) is skipped without being kept
_VALUES = _fields({1: (_I32, None)})
_PAGE_HEADER = _fields({1: (_I32, None), 2: (_I32, None), 3: (_I32, None),
                        5: (_STRUCT, _VALUES), 7: (_STRUCT, _VALUES), 8: (_STRUCT, _VALUES)})
# a page header's own depth counted from the reader's limit: nesting past MAX_DEPTH is refused
_START_DEPTH = _THRIFT_DEPTH - MAX_DEPTH


class BadPage(BadThrift):
    """A page header that cannot be read, or that declares more than its footer allows."""


def _read_header(buf, pos: int, end: int) -> tuple[dict, int]:
    """({field: value} of the page header at buf[pos:] as _PAGE_HEADER reads it, the position
    after) of a file not in memory (part_files.FileBytes), read from slices growing until the
    header fits; never past `end`."""
    size = _FIRST_SLICE
    while True:
        stop = min(end, pos + size)
        b = buf[pos:stop]
        try:
            header, length = _read_struct(b, 0, _PAGE_HEADER, _START_DEPTH, end - pos)
            return header, pos + length
        except BadThrift as exc:
            raise BadPage(f"a page header: {exc}") from None
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
                header, after = _read_struct(chunk, pos - start, _PAGE_HEADER, _START_DEPTH,
                                             end - start)
            except BadThrift as exc:
                raise BadPage(f"a page header: {exc}") from None
            except (IndexError, _Short):
                raise BadPage("a page header runs past its column chunk") from None
            after += start
        else:
            header, after = _read_header(buf, pos, end)
        if after - pos > MAX_HEADER_BYTES:
            raise BadPage(f"a page header of more than {MAX_HEADER_BYTES} bytes")
        try:   # (subscripts, not .get: this runs for every page)
            kind, uncompressed, size = header[1], header[2], header[3]
        except KeyError:
            raise BadPage("a page header lacks its type or sizes") from None
        if size < 0 or uncompressed < 0 or after + size > end:
            raise BadPage(f"a page declares {size} bytes where its column chunk has "
                          f"{end - after}")
        pos = after + size
        total += uncompressed
        if total > declared_uncompressed:
            raise BadPage(f"a page declares {uncompressed} bytes uncompressed; the footer "
                          f"declares {declared_uncompressed} for the whole column chunk")
        field = _SUB_HEADER.get(kind)
        if field is None:
            continue   # (an index page, or a type of page no reader decodes: no values)
        try:
            values = header[field][1]
        except KeyError:
            raise BadPage("a page header lacks its value count") from None
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
            col = group.column(i)   # (each of its accessors builds a Python value: read once)
            start = col.data_page_offset
            dictionary = col.dictionary_page_offset if col.has_dictionary_page else None
            if dictionary:
                # (a chunk of no rows has its dictionary page only, and data page offset 0:
                # a zero-row part, as pyarrow writes it, was refused as lying outside the file)
                start = min(start, dictionary) if start else dictionary
            size = col.total_compressed_size
            end = start + size
            if start < 4 or size < 0 or end > data_end:
                return col.path_in_schema, (f"its column chunk declares bytes {start}..{end}; "
                                            f"the file's data ends at {data_end}")
            try:
                check_chunk_pages(buf, start, end, col.total_uncompressed_size, rows)
            except BadThrift as exc:   # (BadPage, or thrift no reader could skip)
                return col.path_in_schema, str(exc)
    return None
