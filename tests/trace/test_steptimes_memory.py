"""Step-time tables are read a row at a time into arrays of numbers: the memory held is a few
times the file's size, not its cells as Python strings (red team round 8 #13)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from stragglers.errors import InputError
from stragglers.trace.steptimes import read_step_times


def _peak(path) -> tuple[object, int]:
    """(the trace, the most bytes Python and numpy held at once while reading it)."""
    tracemalloc.start()
    try:
        trace = read_step_times(path)
        return trace, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("layout", ["wide", "named"])
def test_a_table_is_read_in_a_few_times_its_size(tmp_path, layout):
    """A 4 MB table of 64 workers: wide (one time column per worker) or long with the workers
    named. Before, every cell was held as a str in a list per row (wide: a list per cell too),
    tens of times the file."""
    path = tmp_path / "t.csv"
    steps = 12_000 if layout == "wide" else 1_700
    if layout == "wide":
        text = "step," + ",".join(f"gpu{w}" for w in range(64)) + "\n" + "".join(
            f"{s}," + ",".join("1.5" if w else "3" for w in range(64)) + "\n"
            for s in range(steps))
    else:
        text = "worker,step,step_time\n" + "".join(
            f"node-{w},{s},{3 if w == 0 else 1.5}\n" for s in range(steps) for w in range(64))
    path.write_text(text)
    size = path.stat().st_size
    trace, peak = _peak(path)
    assert len(trace.ops["rank"]) == 2 * 64 * steps and trace.meta.dp_size == 64
    # the trace itself is 11 columns of 2 ops per cell (~106 bytes a cell, held whatever the
    # reader); the bound is on the rest, round 8's 16x the file (before: 116x wide, 31x named)
    held = sum(v.nbytes for v in trace.ops.values())
    assert peak - held < 16 * size, f"{peak / 2**20:.0f} MiB at peak for a {size:,}-byte table"


def test_a_table_of_one_worker_per_step_is_not_squared(tmp_path):
    """8,000 workers each with a time for its own step only (94 KB): read in a few times the
    file, not as an 8,000 x 8,000 matrix of times to find each step's slowest worker (before:
    1,039 MiB at peak)."""
    path = tmp_path / "t.csv"
    path.write_text("worker,step,step_time\n" + "".join(f"{i},{i},1\n" for i in range(8_000)))
    trace, peak = _peak(path)
    assert trace.meta.dp_size == 8_000
    held = sum(v.nbytes for v in trace.ops.values())
    assert peak - held < 16 * path.stat().st_size, f"{peak / 2**20:.0f} MiB at peak"


def test_a_byte_that_is_not_utf8_is_named_by_its_offset_past_a_chunk(tmp_path):
    """The text is decoded a chunk (1 MiB) at a time: the offset named is still the file's
    (after its byte-order mark), with a character split across two chunks before it."""
    head = b"\xef\xbb\xbfworker,step,step_time\n"
    body = b"0,0,1\n" * ((1 << 20) // 6)
    pad = (1 << 20) - len(head) - len(body) - 1   # 'é' straddles the first chunk's end
    data = head + body + b"#" * pad + "é".encode() + b"\n0,1,\xff\n"
    path = tmp_path / "t.csv"
    path.write_bytes(data)
    bad = data.index(b"\xff") - 3
    with pytest.raises(InputError, match=f"byte {bad:,}"):
        read_step_times(path)


def test_repeated_rows_are_read_once_and_a_conflict_named(tmp_path):
    """Exact repeats of (worker, step, time) dropped in one pass; a worker with two times for
    one step named with its times in file order."""
    path = tmp_path / "t.csv"
    path.write_text("worker,step,step_time\n" + "0,0,1\n1,0,2\n" * 500 + "0,1,1\n1,1,2\n")
    trace = read_step_times(path)
    assert len(trace.ops["rank"]) == 8
    assert np.allclose(sorted(set(trace.ops["duration"].tolist())), [0, 1, 2])
    path.write_text("worker,step,step_time\n" + "0,0,1\n1,0,2\n" * 500 + "1,0,2.5\n")
    with pytest.raises(InputError, match=r"worker 1 has 501 rows for step 0 .*\(2, 2, 2, 2\)"):
        read_step_times(path)


def test_text_that_is_not_utf8_is_said_before_a_nul_byte_ahead_of_it(tmp_path):
    """Read a row at a time, the csv reader meets the NUL byte first; the file is still refused
    as not UTF-8, as when it was decoded whole before any row was read."""
    path = tmp_path / "t.csv"
    path.write_bytes(b"worker,step,step_time\n0,0,1\n1,0,2\x00\n1,1,\xff\n")
    with pytest.raises(InputError, match="not UTF-8 text .byte 39."):
        read_step_times(path)
