"""Parts whose page headers declare more than their footer: refused (422, one line naming the
part and the column) before any page is decoded, over HTTP and in watched runs."""

from __future__ import annotations

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from monitor_jobs import parts_of, slow_job
from stragglers.monitor.parts import read_part_footer, read_upload
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.columns import columns_to_table
from stragglers.trace.runformat import rank_file_name

TOKEN = "pages-test-token-012345"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def zigzag(n: int) -> bytes:
    """A thrift compact i32 (zigzag varint)."""
    v, out = (n << 1) ^ (n >> 63), bytearray()
    while True:
        b, v = v & 0x7F, v >> 7
        out.append(b | 0x80 if v else b)
        if not v:
            return bytes(out)


def read_zigzag(buf: bytes, pos: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return (v >> 1) ^ -(v & 1), pos


def lying_part(compression: str, field: int, value: int, column: str = "step") -> bytes:
    """A good part whose first data page of `column` declares `value` as its uncompressed
    (field 2) or compressed (field 3) size. The file is written with page checksums: the crc
    (field 4, not verified on read) shrinks by what the lie grows, so no offset moves."""
    rank, part, cols = parts_of(slow_job(steps=5), 5)[0]
    buf = pa.BufferOutputStream()
    pq.write_table(columns_to_table(cols), buf, compression=compression,
                   write_page_checksum=True)
    body = buf.getvalue().to_pybytes()
    meta = pq.ParquetFile(pa.BufferReader(body)).metadata
    names = meta.schema.to_arrow_schema().names
    start = pos = meta.row_group(0).column(names.index(column)).data_page_offset
    values, spans = {}, {}
    for fid in (1, 2, 3, 4):   # type, uncompressed, compressed, crc: i32 fields in order
        assert body[pos] == 0x15
        values[fid], end = read_zigzag(body, pos + 1)
        spans[fid], pos = end - pos - 1, end
    values[field] = value
    room = spans[4] + spans[field] - len(zigzag(value))
    assert 1 <= room <= 5
    values[4] = (1 << (7 * (room - 1))) >> 1   # a crc whose varint is `room` bytes
    header = b"".join(b"\x15" + zigzag(values[f]) for f in (1, 2, 3, 4))
    assert len(header) == pos - start
    return body[:start] + header + body[pos:]


@pytest.mark.slow
@pytest.mark.parametrize("compression", ["none", "lz4", "snappy"])
@pytest.mark.parametrize("field,value", [(2, 1 << 30), (3, 1 << 30)])
def test_a_part_whose_page_headers_lie_is_refused_over_http(tmp_path, compression, field,
                                                             value):
    # an uncompressed page declaring 1 GB was decoded and stored; compressed ones got the
    # reader's allocation first and its own words after
    trace = slow_job(steps=5)
    body = lying_part(compression, field, value)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN,
                      config=MonitorConfig(window_steps=5, tick_s=0.05)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            r = c.put("/api/jobs/j/ranks/0/parts/0", content=body, headers=AUTH)
            assert r.status_code == 422, r.text
            error = r.json()["error"]
            assert "\n" not in error and "part j/0/0" in error and "step" in error, error
            assert "page headers" in error and str(value) in error, error
            assert c.get("/api/stats").json()["by_way"] == {}
            assert c.get("/health").status_code == 200
    finally:
        s.stop()


def test_a_watched_part_whose_page_headers_lie_is_refused_from_its_footer(tmp_path):
    path = tmp_path / rank_file_name(0, 0)
    path.write_bytes(lying_part("none", 2, 1 << 30))
    got = read_part_footer(path)
    assert "page headers" in str(got) and got.field == "step", got


def test_good_parts_pass_the_page_check():
    rank, part, cols = parts_of(slow_job(steps=5), 5)[0]
    for compression in ("none", "lz4", "zstd", "snappy"):
        buf = pa.BufferOutputStream()
        pq.write_table(columns_to_table(cols), buf, compression=compression)
        got = read_upload(buf.getvalue().to_pybytes(), "upload", rank, part, None)
        assert got is None or got.records == len(cols["step"]), (compression, got)
