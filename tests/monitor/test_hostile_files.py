"""Watched files that change under the monitor's hands (issue 34): a part file shrunk by its
writer while its page headers are read, parts that are not what their name says."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np

from monitor_jobs import parts_of, slow_job
from stragglers.trace.runformat import write_rank



def test_a_part_file_shrunk_while_read_is_refused_not_the_end_of_the_process(tmp_path):
    # the writer truncates the file after the monitor opened it: its page headers were read
    # from an mmap, and touching a page past the new end killed the monitor with SIGBUS
    trace = slow_job(steps=40)
    rank, part, cols = parts_of(trace, 40)[0]
    cols = {k: np.tile(v, 50) for k, v in cols.items()}
    rng = np.random.default_rng(0)   # times that do not compress: a file of many memory pages
    cols["start_ts"] = cols["start_ts"] + rng.random(len(cols["start_ts"]))
    cols["duration"] = cols["duration"] + rng.random(len(cols["duration"]))
    path = write_rank(tmp_path, rank, cols, part=part)
    assert path.stat().st_size > 64 << 10
    script = textwrap.dedent(f"""
        import os, pyarrow.parquet as pq
        from stragglers.monitor.part_files import file_bytes, open_part_file
        from stragglers.monitor.part_limits import check_page_headers
        f, size = open_part_file({str(path)!r})
        meta = pq.read_metadata(f)
        with f, file_bytes(f, size) as data:
            os.truncate({str(path)!r}, 16)
            try:
                check_page_headers(meta, data, "part")
            except OSError as exc:
                print("refused:", exc)
        """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "refused: the file shrank while read" in done.stdout, done.stdout
