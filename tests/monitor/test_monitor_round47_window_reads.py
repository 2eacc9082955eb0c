"""A window's part files are read on bounded readers (windows._readers, part_files.FileReaders):
a part whose file hangs once its footer was read (a FUSE file whose server holds every read,
as test_stuck_watched_file's) is given up on after the tracker's read_timeout_s and its window
analysed without that rank; the thread left behind is counted, and at most MAX_STUCK_READS
are. Before, the readers were a ThreadPoolExecutor with no deadline: the window's analysis
(and every later window, and the ingest's step reads on the same pool) waited for good."""

from __future__ import annotations

import os
import threading

import pytest

from monitor_jobs import parts_of, slow_job, write_parts
from stragglers.monitor import windows
from stragglers.monitor.parts import read_part_footer
from stragglers.monitor.windows import JobTracker, analyse_window
from stragglers.trace.runformat import rank_file_name
from test_stuck_watched_file import StuckFile

HANG = 60   # seconds: only a hang waits this long


@pytest.fixture
def stuck_part(tmp_path):
    """A 4-rank job's parts of steps 0..3 (one part per rank), rank 1's file hanging on read;
    yields (trace, [(rank, PartFile)]) with every footer read before the file hung."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse to mount a FUSE file whose reads hang")
    trace = slow_job(steps=4)
    parts = parts_of(trace, steps_per_part=4)
    write_parts(tmp_path, parts)
    files = [(rank, read_part_footer(tmp_path / rank_file_name(rank, part)))
             for rank, part, _ in parts]
    stuck = StuckFile(tmp_path / rank_file_name(1, 0))
    try:
        yield trace, files
    finally:
        stuck.close()


def test_a_window_whose_part_file_hangs_is_analysed_without_it(stuck_part):
    trace, files = stuck_part
    # (the monitor's read_timeout_s: a part file's read given up on after it)
    tracker = JobTracker("j", trace.meta, window_steps=4, gap_wait_s=0.0, read_timeout_s=0.3)
    for rank, f in files:
        assert tracker.add_part(rank, 0, f.last_step, None, 1.0, f)
    [window] = tracker.close_ready(2.0)
    got = []
    t = threading.Thread(target=lambda: got.append(analyse_window(window)), daemon=True)
    t.start()
    t.join(HANG)
    assert got, "the window's analysis waited on the hanging part file"
    row, refused = got[0]
    assert row.missing_ranks == [1], row
    assert [p for p, _ in refused] == [str(files[1][1].path)], refused
    assert "has not returned" in refused[0][1]
    assert windows._readers().stuck, "the stuck read is counted (FileReaders.stuck)"
