"""A part's Parquet footer is screened with the part's own budgets (its columns, its rows)
before pyarrow parses it: the screen ran with its general bounds only (4,096 schema elements,
rows unbounded), so a footer declaring hundreds of columns, each chunk in every row group, or
more rows than a part may hold, was parsed whole by pyarrow first and refused after. An upload
and a watched file alike are refused from the screen, in the services' JSON error shape."""

from __future__ import annotations

import io

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from monitor_jobs import parts_of, slow_job, start_run
from stragglers.monitor.part_footers import read_part_footer
from stragglers.monitor.part_limits import MAX_PART_ROWS, MAX_SCHEMA_ELEMENTS
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import rank_file_name, write_table

TOKEN = "footer-budgets-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600)


def _job():
    trace = slow_job(steps=10)
    rank, part, cols = parts_of(trace, 5)[0]
    return trace, rank, part, cols


def wide_part(cols: dict, extra: int = 300) -> bytes:
    """A recorder's part with `extra` more columns (each a chunk in the footer)."""
    table = pa.table({**cols, **{f"x{i}": np.zeros(len(cols["step"]), np.int8)
                                 for i in range(extra)}})
    sink = io.BytesIO()
    pq.write_table(table, sink, row_group_size=2)   # (several row groups: chunks × groups)
    return sink.getvalue()


def tall_part(cols: dict, rows: int = MAX_PART_ROWS + 1) -> bytes:
    """A part of `rows` copies of its first row (a few hundred kB of Parquet)."""
    sink = pa.BufferOutputStream()
    write_table({k: np.repeat(v[:1], rows) for k, v in cols.items()}, sink)
    return sink.getvalue().to_pybytes()


def test_an_uploaded_footer_past_the_parts_budgets_is_refused_before_pyarrow_parses_it(
        tmp_path):
    trace, rank, part, cols = _job()
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            for body, says in ((wide_part(cols), f"schema elements; expected at most "
                                f"{MAX_SCHEMA_ELEMENTS}"),
                               (tall_part(cols), f"declares {MAX_PART_ROWS + 1} rows; "
                                f"expected at most {MAX_PART_ROWS}")):
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{part}", content=body,
                          headers=AUTH)
                assert r.status_code == 422, r.text
                error = r.json()["error"]
                assert says in error and "nothing of the part was read" in error, error
        assert not list((tmp_path / "mon.db.uploads" / "j").glob("rank-*"))   # none stored
    finally:
        s.stop()


def test_a_watched_footer_past_the_parts_budgets_is_refused_from_the_screen(tmp_path):
    trace, rank, part, cols = _job()
    run = tmp_path / "run"
    start_run(run, trace)
    path = run / rank_file_name(rank, part)
    path.write_bytes(wide_part(cols))
    got = read_part_footer(path, str(run))
    assert "schema elements; expected at most" in str(got) and \
        "nothing of the part was read" in str(got), got
