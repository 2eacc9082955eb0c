"""Columns stored in a number type too narrow for their values (round 10, finding 4): float32
start times at epoch seconds (128 s apart there) and float32 ids (whole only up to 2^24) are
refused, naming the column and the type expected (ids from the footer, start times from the
rows: float32 clocks that stay near 0, as NDTimeline's real traces write them, are read);
float32 durations are kept."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from monitor_jobs import parts_of, slow_job, start_run, write_parts
from stragglers.errors import InputError
from stragglers.monitor.part_rows import read_part_file, read_uploads
from stragglers.monitor.parts import read_part_footer, read_upload
from stragglers.trace.runformat import rank_file_name, table_bytes


def _part(tmp_path, extra=None, at=1.7e9, **types) -> tuple[int, int, bytes, object]:
    """A healthy part at times from `at` (epoch seconds unless told; with `extra` columns) with
    `types` (column → Arrow type) cast, as bytes and the path it is written to."""
    rank, part, cols = parts_of(slow_job(steps=5), 5)[0]
    cols = {**cols, "start_ts": cols["start_ts"] - cols["start_ts"].min() + at, **(extra or {})}
    t = pq.read_table(io.BytesIO(table_bytes(cols)))
    for name, to in types.items():
        t = t.set_column(t.schema.get_field_index(name), name, t[name].cast(to))
    buf = io.BytesIO()
    pq.write_table(t, buf)
    path = tmp_path / rank_file_name(rank, part)
    path.write_bytes(buf.getvalue())
    return rank, part, buf.getvalue(), path


def _both(tmp_path, extra=None, at=1.7e9, **types) -> list:
    """What an upload and a watched file of that part are checked to (the file: its footer,
    or its rows where the footer cannot tell)."""
    rank, part, body, path = _part(tmp_path, extra, at, **types)
    upload = read_upload(body, "upload", rank, part, path)
    if upload is None:   # (the footer cannot tell: the part is read whole)
        upload = read_uploads([(body, "upload", rank, part)])[0]
    return [upload, _watched(path)]


def _watched(path):
    """A watched part file's verdict: its footer's, else its rows' (InputError or None)."""
    footer = read_part_footer(path)
    if footer is not None:
        return footer
    try:
        read_part_file(path)
    except InputError as e:
        return e
    return None


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
    assert footer is None or footer.records > 0, footer
    upload, watched = _both(tmp_path, step=pa.float64())   # (whole? the rows tell)
    assert not isinstance(upload, Exception) and watched is None, (upload, watched)
    rows = read_part_file(_part(tmp_path, step=pa.float64())[3])
    assert rows.records > 0 and rows.columns["step"].dtype == np.int64


@pytest.mark.parametrize("at", [0.0, 900.0])
def test_float32_start_times_near_zero_are_read(tmp_path, at):
    """Clocks that restart near 0 (NDTimeline's real samples: each sampled step timed from its
    own start, start_ts float32 up to 47 s) are exact to 6.1e-5 s or better below 1,024 s."""
    upload, watched = _both(tmp_path, at=at, start_ts=pa.float32())
    assert not isinstance(upload, Exception) and len(upload.columns["step"]) > 0, upload
    assert watched is None, watched


def test_float32_start_times_past_the_reach_name_their_spacing(tmp_path):
    for got in _both(tmp_path, at=1100.0, start_ts=pa.float32()):
        assert isinstance(got, Exception) and got.field == "start_ts", got
        assert "0.00012207 s apart" in str(got) and "±1024 s" in str(got), got


def test_the_offline_reader_refuses_float32_epoch_start_times(tmp_path):
    """`stragglers analyze` reads the same rule (trace/columns.py): it once widened float32
    times without a word, and an NDTimeline file of them still reads."""
    from stragglers.trace.columns import table_to_columns

    *_, path = _part(tmp_path, start_ts=pa.float32())
    with pytest.raises(InputError, match="start_ts.*128 s apart"):
        table_to_columns(pq.read_table(path), path)
    *_, near = _part(tmp_path, at=0.0, start_ts=pa.float32())
    assert table_to_columns(pq.read_table(near), near)["start_ts"].dtype == np.float64


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
        assert "field 'start_ts': expected float64 seconds, got float" in refused[0]["problem"], \
            refused
        assert store.totals()["by_way"]["files"].parts == len(rest)
    finally:
        monitor.stop()
        store.close()
