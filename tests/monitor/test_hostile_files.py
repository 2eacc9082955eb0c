"""Watched files that change under the monitor's hands (issue 34): a part file shrunk by its
writer while its page headers are read, parts that are not what their name says."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

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


@pytest.mark.slow
def test_hard_links_in_a_watched_folder_are_refused_and_taken_once_their_other_name_goes(
        tmp_path):
    # a hard link in a watched run to a file elsewhere (another job's part, a private file) is
    # a regular file whose opened path lies in the folder: it was read and stored. Only its
    # link count tells it from a file written there (the recorder writes one name).
    import os

    from stragglers.monitor.ingest_files import DirectoryWatcher
    from stragglers.monitor.service import Monitor
    from stragglers.monitor.settings import MonitorConfig
    from stragglers.monitor.store import open_store
    from monitor_jobs import start_run, write_parts
    root, outside = tmp_path / "runs", tmp_path / "elsewhere"
    run, other = root / "job-h", root / "job-g"
    trace = slow_job(steps=10)
    parts = parts_of(trace, 5)
    start_run(run, trace)
    write_parts(run, [p for p in parts if p[0] != 1])
    ones = [p for p in parts if p[0] == 1]
    write_parts(outside, ones)
    names = [f"rank-00001.part-{part:06d}.parquet" for _, part, _ in ones]
    for name in names:
        os.link(outside / name, run / name)
    start_run(outside / "meta-run", trace)
    other.mkdir()
    os.link(outside / "meta-run" / "meta.json", other / "meta.json")
    store = open_store(tmp_path / "mon.db", durable=False)
    config = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600)
    monitor = Monitor(store, config).start()
    try:
        watcher = DirectoryWatcher(monitor, [root])
        for _ in range(2):
            watcher.scan()
            assert monitor.wait_idle(120)
        linked = sorted((r["reason"], r["source"].rsplit("/", 2)[-2])
                        for r in monitor.recent_rejects if "hard link" in r["problem"])
        assert linked == [("bad_meta", "job-g")] + [("bad_part", "job-h")] * len(names), \
            list(monitor.recent_rejects)
        assert store.totals()["by_way"]["files"].parts == len(parts) - len(ones)
        assert store.job("job-g") is None
        # the other names gone: the files have one name, that of the run, and are taken
        for name in names:
            (outside / name).unlink()
        (outside / "meta-run" / "meta.json").unlink()
        watcher.scan()
        assert monitor.wait_idle(120)
        assert store.totals()["by_way"]["files"].parts == len(parts)
        assert store.job("job-g") is not None
    finally:
        monitor.stop()
        store.close()
