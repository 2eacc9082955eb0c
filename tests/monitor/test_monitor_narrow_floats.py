"""Columns stored in a number type too narrow for their values (round 10, finding 4): float32
start times (128 s apart at epoch seconds) and float32 ids (whole only up to 2^24) are refused
from the footer, naming the column and the type expected; float32 durations are kept."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from monitor_jobs import parts_of, slow_job, start_run, write_parts
from stragglers.monitor.part_rows import read_part_file
from stragglers.monitor.parts import read_part_footer, read_upload
from stragglers.trace.runformat import rank_file_name, table_bytes


def _part(tmp_path, extra=None, **types) -> tuple[int, int, bytes, object]:
    """A healthy part at epoch times (with `extra` columns) with `types` (column → Arrow
    type) cast, as bytes and the path it is written to."""
    rank, part, cols = parts_of(slow_job(steps=5), 5)[0]
    cols = {**cols, "start_ts": cols["start_ts"] + 1.7e9, **(extra or {})}
    t = pq.read_table(io.BytesIO(table_bytes(cols)))
    for name, to in types.items():
        t = t.set_column(t.schema.get_field_index(name), name, t[name].cast(to))
    buf = io.BytesIO()
    pq.write_table(t, buf)
    path = tmp_path / rank_file_name(rank, part)
    path.write_bytes(buf.getvalue())
    return rank, part, buf.getvalue(), path


def _both(tmp_path, extra=None, **types) -> list:
    """What an upload and a watched file of that part are checked to."""
    rank, part, body, path = _part(tmp_path, extra, **types)
    return [read_upload(body, "upload", rank, part, path), read_part_footer(path)]


@pytest.mark.parametrize("types", [
    {"start_ts": pa.float32()},
    # a float id once answered "read the rows" before start_ts's type was looked at, and the
    # rows' check widened the float32 times without a word
    {"start_ts": pa.float32(), "step": pa.float64()},
], ids=["alone", "with-float-ids"])
def test_float32_start_times_are_refused_naming_the_column(tmp_path, types):
    for got in _both(tmp_path, **types):
        assert isinstance(got, Exception) and got.field == "start_ts", got
        assert "expected float64 seconds, got float" in str(got), got
        assert "128 s apart" in str(got), got
        assert "\n" not in str(got)


@pytest.mark.parametrize("name", ["step", "rank", "tokens"])
def test_float32_ids_are_refused_naming_the_column(tmp_path, name):
    extra = {"tokens": np.arange(110)} if name == "tokens" else {}   # (an optional column)
    for got in _both(tmp_path, extra, **{name: pa.float32()}):
        assert isinstance(got, Exception) and got.field == name, got
        assert "expected integers (or float64 whole numbers), got float" in str(got), got
        assert "2^24" in str(got), got


def test_float32_durations_and_float64_ids_are_still_read(tmp_path):
    """A duration needs its relative precision only (~6e-8 in float32); float64 holds whole
    numbers exactly to 2^53: neither is refused."""
    upload, footer = _both(tmp_path, duration=pa.float32())
    assert not isinstance(upload, Exception) and upload.records > 0, upload
    assert not isinstance(footer, Exception) and footer.records > 0, footer
    assert _both(tmp_path, step=pa.float64()) == [None, None]   # (whole? the rows tell)
    rows = read_part_file(_part(tmp_path, step=pa.float64())[3])
    assert rows.records > 0 and rows.columns["step"].dtype == np.int64


def test_a_watched_part_with_float32_start_times_is_refused_by_name(tmp_path):
    """The watcher names the file and the type expected among the monitor's refusals (and
    the log)."""
    from stragglers.monitor.ingest_files import DirectoryWatcher
    from stragglers.monitor.service import Monitor
    from stragglers.monitor.settings import MonitorConfig
    from stragglers.monitor.store import open_store

    run = tmp_path / "job-f32"
    trace = slow_job(steps=5)
    start_run(run, trace)
    (rank, part, cols), *rest = parts_of(trace, 5)
    write_parts(run, rest)
    _, _, body, _ = _part(tmp_path, start_ts=pa.float32())
    bad = run / rank_file_name(rank, part)
    bad.write_bytes(body)
    store = open_store(tmp_path / "mon.db", durable=False)
    monitor = Monitor(store, MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05,
                                           rescan_s=3600)).start()
    try:
        DirectoryWatcher(monitor, [run]).scan()
        assert monitor.wait_idle(120)
        refused = [r for r in monitor.recent_rejects if r["source"].endswith(bad.name)]
        assert len(refused) == 1, monitor.recent_rejects
        assert "expected float64 seconds, got float" in refused[0]["problem"], refused
        assert store.totals()["by_way"]["files"].parts == len(rest)
    finally:
        monitor.stop()
        store.close()
