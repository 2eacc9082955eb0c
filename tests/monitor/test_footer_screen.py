"""A part whose Parquet footer disagrees with itself (a column chunk's type that is not its
schema leaf's, a level histogram of the wrong length, a statistic of the wrong width) is refused
before pyarrow walks its footer: that walk throws through a frame that may not throw and aborts
the whole process (SIGABRT), which no Python handler catches. Each route that reads a part is
run in a child process, so a check that aborts fails its test instead of ending pytest."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REPO, eventually, listening_url, up
from monitor_jobs import parts_of, slow_job, start_run, write_parts
from stragglers.monitor import pages
from stragglers.trace.parquet_footer import BadFooter, BadThrift, check_footer, footer_of, skip
from stragglers.trace.runformat import table_bytes

TOKEN = "footer-screen-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def a_part(rank: int = 1, part: int = 0) -> tuple[object, bytes]:
    trace = slow_job(steps=10, slow=(0, 1, 3.0))
    cols = next(c for r, p, c in parts_of(trace, 5) if (r, p) == (rank, part))
    return trace, table_bytes(cols)


def _footer_start(body: bytes) -> int:
    return len(body) - 8 - int.from_bytes(body[-8:-4], "little")


def chunk_type_changed(body: bytes, column: str = "dp_rank", to: int = 0) -> bytes:
    """`column`'s ColumnMetaData type (the first field of the struct a ColumnChunk's field 3
    opens, `\\x1c\\x15`) set to `to` (0: BOOLEAN), in place."""
    name = column.encode()
    path = body.index(b"\x19\x18" + bytes([len(name)]) + name, _footer_start(body))
    at = body.rindex(b"\x1c\x15", _footer_start(body), path) + 2
    return body[:at] + bytes([to * 2]) + body[at + 1:]


def made_required(body: bytes, column: str = "gmc") -> bytes:
    """`column`'s schema element turned from OPTIONAL to REQUIRED: its chunk's definition
    level histogram (two counts) no longer fits its one level."""
    name = column.encode()
    at = body.index(b"%\x02\x18" + bytes([len(name)]) + name, _footer_start(body))
    return body[:at + 1] + b"\x00" + body[at + 2:]


def statistic_shortened(body: bytes, column: str = "stage") -> bytes:
    """`column`'s (INT32) chunk statistics' max_value cut to 3 bytes (well-formed thrift, the
    footer's length kept true): pyarrow cannot decode an INT32 from it."""
    name = column.encode()
    start = _footer_start(body)
    path = body.index(b"\x19\x18" + bytes([len(name)]) + name, start)
    at = body.index(b"\x28\x04", path)   # Statistics field 5 (max_value, binary), 4 bytes
    out = body[:at + 1] + b"\x03" + body[at + 2:at + 5] + body[at + 6:-8]
    return out + (len(out) - start).to_bytes(4, "little") + b"PAR1"


CORRUPT = {"chunk-type": chunk_type_changed, "level-histogram": made_required,
           "statistic-width": statistic_shortened}

# every route a part takes in the monitor, each printing one line (the InputError's text)
ROUTES = r"""
import sys
from pathlib import Path
from stragglers.monitor.part_footers import check_uploads, read_part_footer
from stragglers.monitor.part_rows import read_part_files, read_uploads
body = Path(sys.argv[1]).read_bytes()
part = Path(sys.argv[2])
part.write_bytes(body)
for name, got in (("upload", check_uploads([(body, "up", 1, 0, part)])[0]),
                  ("uploads-whole", read_uploads([(body, "up", 1, 0)])[0]),
                  ("watched", read_part_footer(part)),
                  ("window", read_part_files([part])[0])):
    print(name, type(got).__name__, str(got).replace("\n", " "), flush=True)
"""


def in_child(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("corrupt", list(CORRUPT))
def test_every_route_refuses_a_part_whose_footer_disagrees_with_itself(tmp_path, corrupt):
    _, good = a_part()
    bad = CORRUPT[corrupt](good)
    sample = tmp_path / "bad.parquet"
    sample.write_bytes(bad)
    got = in_child(ROUTES, str(sample), str(tmp_path / "rank-00001.part-000000.parquet"))
    assert got.returncode == 0, f"the process died (rc {got.returncode}): {got.stderr[-600:]}"
    lines = got.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["upload", "uploads-whole", "watched",
                                                   "window"]
    for line in lines:
        assert line.split()[1] == "InputError" and "footer: column " in line, line


def test_the_screen_names_the_column_and_what_it_expected():
    _, good = a_part()
    check_footer(footer_of(good))   # the part as written passes
    with pytest.raises(BadFooter, match=r"column dp_rank: .* type 0; the schema says INT32"):
        check_footer(footer_of(chunk_type_changed(good)))
    with pytest.raises(BadFooter, match=r"column gmc: a definition level histogram of 2 counts; "
                       r"expected 1"):
        check_footer(footer_of(made_required(good)))
    with pytest.raises(BadFooter, match=r"column stage: a statistic of 3 bytes; INT32 takes 4"):
        check_footer(footer_of(statistic_shortened(good)))


def _written(table: pa.Table, **options) -> bytes:
    sink = io.BytesIO()
    pq.write_table(table, sink, **options)
    return sink.getvalue()


@pytest.mark.slow
def test_footers_pyarrow_writes_pass_the_screen():
    """No false refusal: what pyarrow writes, in every layout a writer may choose."""
    _, good = a_part()
    table = pq.read_table(io.BytesIO(good))
    many = pa.table({"i8": pa.array([1, -2, None], pa.int8()), "u32": pa.array([1, 2, 3],
                     pa.uint32()), "f": pa.array([1.5, None, 2.0], pa.float32()),
                     "b": [True, False, None], "s": ["a", None, "c"],
                     "fixed": pa.array([b"ab", b"cd", b"ef"], pa.binary(2)),
                     "nested": [[1, 2], None, [3]], "ts": pa.array([1, 2, 3],
                                                                    pa.timestamp("us"))})
    for t in (table, many):
        for options in ({}, {"write_statistics": False}, {"data_page_version": "2.0"},
                        {"compression": "none", "row_group_size": 1},
                        {"write_page_index": True}, {"use_dictionary": False},
                        {"store_decimal_as_integer": True}):
            body = _written(t, **options)
            check_footer(footer_of(body))
            assert pq.read_table(io.BytesIO(body)).num_rows == t.num_rows


def test_a_map_of_booleans_is_skipped_a_byte_an_entry():
    # a map of 2**63-1 (bool, bool) entries in 3 bytes: refused by its count, never looped over
    endless = b"\xff" * 8 + b"\x7f" + b"\x11" + b"\x00"
    with pytest.raises(BadThrift, match="container"):
        skip(endless, 0, 11, 0, len(endless))
    # two entries of booleans: two bytes each
    assert skip(b"\x02\x11\x01\x02\x01\x01", 0, 11, 0, 6) == 6


@pytest.mark.slow
def test_a_page_header_holding_an_endless_map_is_refused(tmp_path):
    """In a child process: before the fix its parse looped 2**63 times (a liveness bound, not a
    timing verdict: the check takes milliseconds)."""
    _, good = a_part()
    meta = pq.ParquetFile(io.BytesIO(good)).metadata
    group = meta.row_group(0)
    chunk = next(group.column(j) for j in range(group.num_columns)
                 if group.column(j).path_in_schema == "seq_id")
    at = good.index(b"\x1c\x18\x04", chunk.data_page_offset) + 1   # statistics' min/max
    endless = b"\x1b" + b"\xff" * 8 + b"\x7f" + b"\x11" + b"\x00"
    bad = good[:at] + endless + good[at + len(endless):]
    sample = tmp_path / "bad.parquet"
    sample.write_bytes(bad)
    got = in_child(ROUTES, str(sample), str(tmp_path / "rank-00001.part-000000.parquet"))
    assert got.returncode == 0, got.stderr[-600:]
    assert all(" InputError " in line and "seq_id" in line for line in got.stdout.splitlines())
    assert pages.check_pages(meta, bad, _footer_start(bad) - 8) is not None


# --- the service: real `stragglers monitor serve` processes on loopback ----------------------

def _serve(tmp: Path, *args: str) -> tuple[subprocess.Popen, str]:
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    cfg = tmp / "monitor.yaml"
    cfg.write_text("settings: {window_steps: 5, stall_after_s: 600, tick_s: 0.05}\n")
    log = tmp / f"stderr.{time.monotonic_ns()}.log"
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                             str(tmp / "mon.db"), "--port", "0", "--config", str(cfg),
                             "--token-file", str(token), *args], cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=log.open("wb"))
    url = listening_url(proc)
    proc.args = log
    return proc, url


def _stop(proc: subprocess.Popen) -> str:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
    return Path(proc.args).read_text(errors="replace")[-1500:]


@pytest.mark.slow
def test_the_monitor_refuses_such_parts_uploaded_or_watched_and_restarts(tmp_path):
    trace = slow_job(steps=10, slow=(0, 1, 3.0))
    run = tmp_path / "runs" / "run"
    run.mkdir(parents=True)
    start_run(run, trace)
    parts = parts_of(trace, 5)
    write_parts(run, [p for p in parts if (p[0], p[1]) != (1, 1)])
    cols = next(c for r, p, c in parts if (r, p) == (1, 1))
    (run / "rank-00001.part-000001.parquet").write_bytes(made_required(table_bytes(cols)))
    for start in range(2):   # and once more: a restart beside the bad part
        _, good = a_part(1, start)
        proc, url = _serve(tmp_path, "--watch", str(tmp_path / "runs"))
        try:
            assert up(proc, url), "the monitor did not start"
            with httpx.Client(base_url=url, timeout=60) as c:
                eventually(lambda: c.get("/api/jobs/run").json().get("windows_total", 0) >= 1,
                           timeout=120, what="a window of the watched run")
                assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                             headers=AUTH).status_code == 200
                for corrupt in CORRUPT.values():
                    r = c.put(f"/api/jobs/j/ranks/1/parts/{start}", content=corrupt(good),
                              headers=AUTH)
                    assert r.status_code == 422, r.text
                    assert "footer: column" in json.dumps(r.json()), r.text
                assert c.put(f"/api/jobs/j/ranks/1/parts/{start}", content=good,
                             headers=AUTH).status_code in (200, 201)
            assert up(proc, url)
        finally:
            err = _stop(proc)
        assert "terminate called" not in err, err


@pytest.mark.slow
def test_a_part_too_large_to_read_whole_is_screened_from_the_file(tmp_path):
    """Parts past WHOLE_READ_BYTES are read from the open file: their footer is screened from
    its bytes there, and pyarrow walks the footer screened (set low here: every part so)."""
    _, good = a_part()
    sample = tmp_path / "bad.parquet"
    sample.write_bytes(made_required(good))
    patch = ("import stragglers.monitor.part_files as a, stragglers.monitor.part_footers as b, "
             "stragglers.monitor.part_rows as c\n"
             "a.WHOLE_READ_BYTES = b.WHOLE_READ_BYTES = c.WHOLE_READ_BYTES = 64\n")
    got = in_child(patch + ROUTES, str(sample), str(tmp_path / "rank-00001.part-000000.parquet"))
    assert got.returncode == 0, f"the process died (rc {got.returncode}): {got.stderr[-600:]}"
    watched = [line for line in got.stdout.splitlines() if line.split()[0] in ("watched",
                                                                               "window")]
    assert len(watched) == 2 and all("footer: column gmc" in line for line in watched), \
        got.stdout
