"""A Parquet part's page headers checked against its footer before any page is decoded.

The footer's declared sizes bound what a part takes decoded (parts.check_decode_budget), but the
reader allocates what each page header declares: a page claiming 2 GB uncompressed, or a
dictionary of 2**31 values, is allocated before the bytes behind it are found missing. Each
column chunk's page headers (thrift compact protocol) are read here, without decoding a page,
and must stay within the footer: pages inside the chunk, uncompressed sizes summing to at most
the chunk's declared size, values per page at most the row group's rows, a dictionary of at
most one value per byte.
"""

from __future__ import annotations

from typing import Any

_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, \
    _STRUCT = range(13)
_DATA_PAGE, _INDEX_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2 = range(4)
MAX_DEPTH = 8
MAX_PAGES = 1 << 20


class BadPage(ValueError):
    """A page header that cannot be read, or that declares more than its footer allows."""


class _Reader:
    """Thrift compact protocol values read from `buf[pos:end]`, never past `end`."""

    def __init__(self, buf, pos: int, end: int):
        self.buf, self.pos, self.end = buf, pos, end

    def byte(self) -> int:
        if self.pos >= self.end:
            raise BadPage("a page header runs past its column chunk")
        b = self.buf[self.pos]
        self.pos += 1
        return b

    def varint(self) -> int:
        shift = value = 0
        while True:
            b = self.byte()
            value |= (b & 0x7F) << shift
            if b < 0x80:
                return value
            shift += 7
            if shift > 63:
                raise BadPage("a page header holds a malformed number")

    def zigzag(self) -> int:
        v = self.varint()
        return (v >> 1) ^ -(v & 1)

    def skip(self, kind: int, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise BadPage("a page header nests too deep")
        if kind in (_TRUE, _FALSE):
            return
        if kind == _BYTE:
            self.byte()
        elif kind in (_I16, _I32, _I64):
            self.varint()
        elif kind == _DOUBLE:
            self.advance(8)
        elif kind == _BINARY:
            self.advance(self.varint())
        elif kind in (_LIST, _SET):
            head = self.byte()
            n = head >> 4 if head >> 4 != 15 else self.varint()
            for _ in range(n):
                self.skip(head & 0x0F if head & 0x0F not in (_TRUE, _FALSE) else _BYTE,
                          depth + 1)
        elif kind == _MAP:
            n = self.varint()
            kinds = self.byte() if n else 0
            for _ in range(n):
                self.skip(kinds >> 4, depth + 1)
                self.skip(kinds & 0x0F, depth + 1)
        elif kind == _STRUCT:
            self.struct(depth + 1)
        else:
            raise BadPage(f"a page header holds an unknown thrift type {kind}")

    def advance(self, n: int) -> None:
        if n < 0 or self.pos + n > self.end:
            raise BadPage("a page header runs past its column chunk")
        self.pos += n

    def struct(self, depth: int = 0, wanted: dict[int, bool] | None = None) -> dict[int, Any]:
        """The integer fields of a struct (and of nested structs named in `wanted`, by id)."""
        fields: dict[int, Any] = {}
        last = 0
        while True:
            head = self.byte()
            kind = head & 0x0F
            if kind == _STOP:
                return fields
            delta = head >> 4
            last = last + delta if delta else self.zigzag()
            if kind in (_I16, _I32, _I64):
                fields[last] = self.zigzag()
            elif kind == _STRUCT and wanted and last in wanted:
                fields[last] = self.struct(depth + 1)
            else:
                self.skip(kind, depth)


def page_headers(buf, start: int, end: int):
    """(header, page start, page end) of each page of the column chunk `buf[start:end]`."""
    pos, count = start, 0
    while pos < end:
        count += 1
        if count > MAX_PAGES:
            raise BadPage(f"more than {MAX_PAGES} pages in one column chunk")
        r = _Reader(buf, pos, end)
        header = r.struct(wanted={5: True, 7: True, 8: True})
        size = header.get(3)
        if size is None or header.get(1) is None or header.get(2) is None:
            raise BadPage("a page header lacks its type or sizes")
        if size < 0 or header[2] < 0 or r.pos + size > end:
            raise BadPage(f"a page declares {size} bytes where its column chunk has "
                          f"{end - r.pos}")
        yield header, r.pos, r.pos + size
        pos = r.pos + size


def check_chunk_pages(buf, start: int, end: int, declared_uncompressed: int,
                      rows: int) -> None:
    """BadPage unless the pages of one column chunk stay within what its footer declares."""
    total = 0
    for header, page_start, page_end in page_headers(buf, start, end):
        total += header[2]
        if total > declared_uncompressed:
            raise BadPage(f"a page declares {header[2]} bytes uncompressed; the footer "
                          f"declares {declared_uncompressed} for the whole column chunk")
        kind = header[1]
        sub = header.get({_DATA_PAGE: 5, _DICTIONARY_PAGE: 7, _DATA_PAGE_V2: 8}.get(kind, 0))
        values = sub.get(1) if isinstance(sub, dict) else None
        if values is None and kind in (_DATA_PAGE, _DICTIONARY_PAGE, _DATA_PAGE_V2):
            raise BadPage("a page header lacks its value count")
        if values is not None and values < 0:
            raise BadPage(f"a page declares {values} values")
        if kind == _DICTIONARY_PAGE and values is not None and values > max(header[2], 0):
            raise BadPage(f"a dictionary page declares {values} values in {header[2]} bytes")
        if kind in (_DATA_PAGE, _DATA_PAGE_V2) and values is not None and values > rows:
            raise BadPage(f"a page declares {values} values; its row group has {rows} rows")


def check_pages(meta, buf, data_end: int) -> tuple[str, str] | None:
    """(column, problem) of the first column chunk whose pages pass what the footer `meta`
    declares (or that lies outside the file's data, `buf[4:data_end]`), else None."""
    for g in range(meta.num_row_groups):
        group = meta.row_group(g)
        for i in range(group.num_columns):
            col = group.column(i)
            start = col.data_page_offset
            if col.has_dictionary_page and col.dictionary_page_offset:
                start = min(start, col.dictionary_page_offset)
            end = start + col.total_compressed_size
            name = col.path_in_schema
            if start < 4 or col.total_compressed_size < 0 or end > data_end:
                return name, (f"its column chunk declares bytes {start}..{end}; the file's "
                              f"data ends at {data_end}")
            try:
                check_chunk_pages(buf, start, end, col.total_uncompressed_size, group.num_rows)
            except BadPage as exc:
                return name, str(exc)
    return None
