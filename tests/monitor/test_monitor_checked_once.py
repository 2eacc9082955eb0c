"""Each check of a part runs once (issues 32/33): the analysis process does not check again
the footer and page headers of bytes the ingest checked, a file changed since is checked
again, uploads of one batch have their rows checked together, and a part that lies is still
refused before any page is decoded."""

from __future__ import annotations

import os
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from monitor_jobs import parts_of, slow_job
from stragglers.errors import InputError
from stragglers.monitor import pages, part_limits
from stragglers.monitor.part_files import FileBytes
from stragglers.monitor.parts import PartFile, check_uploads, read_part_files, \
    read_part_footer, read_window_rows
from stragglers.monitor.readahead import ReadAhead
from stragglers.trace.columns import columns_to_table
from stragglers.trace.runformat import rank_file_name, write_rank
from test_monitor_pages import lying_part


@pytest.fixture
def page_checks(monkeypatch):
    """The parts whose page headers are checked, counted."""
    calls: list[int] = []
    real = part_limits.check_pages

    def counted(meta, data, data_end):
        calls.append(len(data))
        return real(meta, data, data_end)

    monkeypatch.setattr(part_limits, "check_pages", counted)
    return calls


@pytest.fixture
def no_decode(monkeypatch):
    """Decoding a Parquet file fails the test (a part that lies must be refused before)."""
    def refuse(*args, **kwargs):
        raise AssertionError("a page was decoded")

    monkeypatch.setattr(pq.ParquetFile, "read", refuse)


def _good(tmp_path, rank=0):
    trace = slow_job(steps=10)
    _, part, cols = [p for p in parts_of(trace, 5) if p[0] == rank][0]
    return write_rank(tmp_path, rank, cols, part=part), cols


def test_a_watched_part_checked_at_ingest_is_not_checked_again_when_read(tmp_path,
                                                                        page_checks):
    path, cols = _good(tmp_path)
    file = read_part_footer(path)
    assert isinstance(file, PartFile) and file.digest and len(page_checks) == 1
    steps = sorted(set(cols["step"].tolist()))
    chunks, refused = read_window_rows([file], steps)
    assert refused == [] and len(chunks[0]["step"]) == len(cols["step"])
    ahead = ReadAhead(threads=1)
    ahead.add([file])
    got = ahead.take([file], steps[-1])[str(path)]
    assert got.records == len(cols["step"])
    assert len(page_checks) == 1   # the ingest's check only: none by the window, none ahead


def test_a_part_without_the_digest_of_its_check_is_checked_when_read(tmp_path, page_checks):
    path, _ = _good(tmp_path)
    got = read_part_files([path])[0]
    assert got.records and len(page_checks) == 1


def test_a_part_rewritten_in_place_after_its_check_is_checked_again(tmp_path, page_checks,
                                                                   no_decode):
    # same inode, same size, same mtime: a key of (inode, size, mtime) would take it as
    # checked; its bytes give another digest, so its page headers are read again and refused
    body = lying_part("none", 2, 1 << 30)
    good = pq.ParquetFile(pa.BufferReader(body))
    rank, part, cols = parts_of(slow_job(steps=5), 5)[0]
    buf = pa.BufferOutputStream()
    pq.write_table(columns_to_table(cols), buf, compression="none", write_page_checksum=True)
    clean = buf.getvalue().to_pybytes()
    assert len(clean) == len(body) and good.metadata.num_rows == len(cols["step"])
    path = tmp_path / rank_file_name(rank, part)
    path.write_bytes(clean)
    file = read_part_footer(path)
    assert isinstance(file, PartFile) and file.digest
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.write(body)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == \
        (before.st_ino, before.st_size, before.st_mtime_ns)
    chunks, refused = read_window_rows([file], [0, 1, 2, 3, 4])
    assert chunks == [] and len(refused) == 1, refused
    assert "page headers" in refused[0][1] and str(1 << 30) in refused[0][1], refused
    assert len(page_checks) == 2


def test_a_watched_part_that_lies_is_refused_before_any_page_is_decoded(tmp_path, no_decode):
    path = tmp_path / rank_file_name(0, 0)
    path.write_bytes(lying_part("snappy", 3, 1 << 30))
    got = read_part_footer(path)
    assert isinstance(got, InputError) and "page headers" in got.problem, got
    got = read_part_files([path])[0]
    assert isinstance(got, InputError) and "page headers" in got.problem, got


def test_an_upload_that_lies_is_refused_before_any_page_is_decoded(tmp_path, no_decode):
    body = lying_part("lz4", 2, 1 << 30)
    got = check_uploads([(body, "upload j/0/0", 0, 0, tmp_path / "p")])[0]
    assert isinstance(got, InputError) and "page headers" in got.problem, got
    assert got.field == "step" and "nothing of the part was decoded" in got.problem


def test_an_upload_is_checked_once_then_read_by_its_digest(tmp_path, page_checks):
    rank, part, cols = parts_of(slow_job(steps=5), 5)[0]
    buf = pa.BufferOutputStream()
    pq.write_table(columns_to_table(cols), buf)
    body = buf.getvalue().to_pybytes()
    path = tmp_path / rank_file_name(rank, part)
    got = check_uploads([(body, "upload", rank, part, path)])[0]
    assert isinstance(got, PartFile) and len(page_checks) == 1
    path.write_bytes(body)
    rows = read_part_files([path], None, [got.digest])[0]
    assert rows.records == len(cols["step"]) and len(page_checks) == 1


def test_a_bad_upload_in_a_batch_is_refused_alone(tmp_path):
    trace = slow_job(steps=5)
    items = []
    for rank, part, cols in parts_of(trace, 5):
        if rank == 2:
            cols = dict(cols, start_ts=np.where(np.arange(len(cols["step"])) == 3, np.nan,
                                                cols["start_ts"]))
        buf = pa.BufferOutputStream()
        pq.write_table(columns_to_table(cols), buf)
        items.append((buf.getvalue().to_pybytes(), f"upload j/{rank}/{part}", rank, part,
                      tmp_path / rank_file_name(rank, part)))
    got = check_uploads(items)
    assert len(got) == len(items) >= 3
    for (_, source, rank, _, _), g in zip(items, got):
        if rank == 2:
            assert isinstance(g, InputError) and g.field == "start_ts", g
            assert source in str(g), g
        else:
            assert isinstance(g, PartFile) and g.rank == rank and g.digest, g


def test_a_page_header_past_its_bound_is_refused_in_memory_and_from_a_file(tmp_path,
                                                                           monkeypatch):
    path, _ = _good(tmp_path)
    body = path.read_bytes()
    meta = pq.ParquetFile(pa.BufferReader(body)).metadata
    data_end = len(body) - 8 - int.from_bytes(body[-8:-4], "little")
    assert pages.check_pages(meta, body, data_end) is None
    monkeypatch.setattr(pages, "MAX_HEADER_BYTES", 12)
    with open(path, "rb") as f:
        for data in (body, FileBytes(f.fileno(), len(body))):
            got = pages.check_pages(meta, data, data_end)
            assert got is not None and "more than 12 bytes" in got[1], got


def test_page_headers_read_from_memory_and_from_a_file_agree(tmp_path):
    # the same mutated headers, parsed from one slice of bytes and from slices of the file
    path, _ = _good(tmp_path)
    body = path.read_bytes()
    meta = pq.ParquetFile(pa.BufferReader(body)).metadata
    data_end = len(body) - 8 - int.from_bytes(body[-8:-4], "little")
    rng = random.Random(0)
    refused = 0
    with open(tmp_path / "mutated", "w+b") as f:
        for _ in range(300):
            b = bytearray(body)
            for _ in range(rng.randint(1, 3)):
                b[rng.randrange(4, data_end)] = rng.randrange(256)
            f.seek(0)
            f.write(b)
            f.flush()
            in_memory = pages.check_pages(meta, bytes(b), data_end)
            assert in_memory == pages.check_pages(meta, FileBytes(f.fileno(), len(b)), data_end)
            refused += in_memory is not None
    assert refused > 20   # (mutations that pass are in values, not headers)


def test_a_header_nested_too_deep_is_refused():
    # a page header (type 0, sizes 4) whose data page header nests structs 12 deep
    header = b"\x15\x00\x15\x08\x15\x08" + b"\x2c" + b"\x1c" * 12 + b"\x00" * 14
    chunk = header + b"\x00" * 4
    with pytest.raises(pages.BadPage, match="nests too deep"):
        pages.check_chunk_pages(chunk, 0, len(chunk), 100, 10)
