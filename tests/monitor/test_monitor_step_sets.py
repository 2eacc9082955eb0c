"""Two parts of a rank conflict only when they share a step: one part with a wild gap inside
(steps 0..3 and 29, within the step-gap bound) once made the rank's parts of steps 4..28
"overlap" its range, all refused, and the rank named missing in every window between."""

from __future__ import annotations

import sqlite3

import httpx
import numpy as np
import pytest

from conftest import eventually
from monitor_jobs import get, slow_job
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.service import Monitor, PartIn
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import open_store
from stragglers.monitor.store_sqlite import SCHEMA
from stragglers.trace.runformat import rank_file_name, table_bytes, write_rank

from pg_cluster import postgres_cluster, postgres_url  # noqa: F401 - fixtures

TOKEN = "step-sets-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, change_detector=False)
WILD = [0, 1, 2, 3, 29]   # rank 0's part 0: a gap inside it, its range 0..29


def rows_of(trace, rank: int, steps) -> dict:
    o = trace.ops
    sel = (o["rank"] == rank) & np.isin(o["step"], list(steps))
    return {k: v[sel] for k, v in o.items()}


def job_parts(trace) -> list[tuple[int, int, dict]]:
    """(rank, part, rows): rank 0's wild part 0 then its parts of steps 4..28; the other
    ranks' parts of five steps each."""
    out = [(0, 0, rows_of(trace, 0, WILD))]
    out += [(0, 1 + i, rows_of(trace, 0, range(lo, lo + 5)))
            for i, lo in enumerate(range(4, 29, 5))]
    for rank in sorted({int(r) for r in np.unique(trace.ops["rank"])} - {0}):
        out += [(rank, i, rows_of(trace, rank, range(lo, lo + 5)))
                for i, lo in enumerate(range(0, 30, 5))]
    return out


def check_windows(c: httpx.Client) -> None:
    """Every window of job j's steps 0..29 analysed with every rank (waited for)."""
    job = eventually(lambda: len(get(c, "/api/jobs/j")["windows"]) >= 5
                     and get(c, "/api/jobs/j"), what="5 windows")
    windows = [get(c, f"/api/jobs/j/windows/{w['idx']}") for w in
               sorted(job["windows"], key=lambda w: w["first_step"])[:5]]
    assert [w["first_step"] for w in windows] == [0, 5, 10, 15, 20], windows
    assert all(w["missing_ranks"] == [] for w in windows), [w["missing_ranks"] for w in windows]
    assert all(w["error"] is None for w in windows), [w["error"] for w in windows]


@pytest.mark.slow
def test_uploads_after_a_part_with_a_wild_gap_are_stored_and_analysed(tmp_path):
    trace = slow_job(steps=30, slow=(0, 1, 3.0))
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            url = "/api/jobs/j/ranks/{}/parts/{}"
            for rank, part, cols in job_parts(trace):
                r = c.put(url.format(rank, part), content=table_bytes(cols), headers=AUTH)
                assert r.status_code == 200, (rank, part, r.text)
            # a part that does share a step (29) is still refused, with nothing stored
            r = c.put(url.format(0, 9), content=table_bytes(rows_of(trace, 0, [27, 28, 29])),
                      headers=AUTH)
            assert r.status_code == 409 and "in its part" in r.json()["error"], r.text
            assert not s.monitor.store.has_part("j", 0, 9)
            check_windows(c)
    finally:
        s.stop()


@pytest.fixture
def monitor(tmp_path):
    store = open_store(str(tmp_path / "mon.db"))
    mon = Monitor(store, CFG, data_dir=tmp_path / "up")
    mon.leases.beat()
    yield mon
    mon.stop()
    store.close()


def test_watched_parts_after_a_part_with_a_wild_gap_are_stored(monitor, tmp_path):
    trace = slow_job(steps=30, slow=None)
    run = tmp_path / "runs" / "j"
    monitor.register_job("j", run, "files", trace.meta.to_dict())
    parts = job_parts(trace)
    for rank, part, cols in parts:
        write_rank(run, rank, cols, part=part)
    ins = [PartIn("j", rank, part, "files", path=run / rank_file_name(rank, part))
           for rank, part, _ in parts]
    monitor._ingest_batch(ins[:1])   # the wild part alone: the others meet it in the store
    monitor._ingest_batch(ins[1:])
    assert all(monitor.store.has_part("j", rank, part) for rank, part, _ in parts), \
        monitor.recent_rejects
    assert not [r for r in monitor.recent_rejects if r["reason"] == "bad_part"]
    # one that shares step 2 with the wild part is refused, naming it
    write_rank(run, 0, rows_of(trace, 0, [2]), part=9)
    monitor._ingest_batch([PartIn("j", 0, 9, "files", path=run / rank_file_name(0, 9))])
    assert not monitor.store.has_part("j", 0, 9)
    assert "in its part 0" in monitor.recent_rejects[0]["problem"]


def test_a_store_written_before_step_sets_is_read_and_judged_by_its_files(tmp_path):
    """Parts stored without a step set (the previous schema) are judged by their files' steps;
    the store gains the column and reads its rows back as before."""
    trace = slow_job(steps=30, slow=None)
    db = tmp_path / "old.db"
    with sqlite3.connect(db) as old:   # the schema before step sets
        old.executescript(SCHEMA.replace(" step_set TEXT,", ""))
    store = open_store(str(db))
    try:
        mon = Monitor(store, CFG, data_dir=tmp_path / "up")
        mon.leases.beat()
        run = tmp_path / "runs" / "j"
        mon.register_job("j", run, "files", trace.meta.to_dict())
        write_rank(run, 0, rows_of(trace, 0, WILD), part=0)
        mon._ingest_batch([PartIn("j", 0, 0, "files", path=run / rank_file_name(0, 0))])
        # its row as the previous version wrote it: no step set
        store._write(lambda d: store._exec(d, "UPDATE parts SET step_set = NULL"))
        assert store.overlapping_parts("j", 0, 1, 4, 8) == [(0, 0, 29, None)]
        write_rank(run, 0, rows_of(trace, 0, range(4, 9)), part=1)
        mon._ingest_batch([PartIn("j", 0, 1, "files", path=run / rank_file_name(0, 1))])
        assert store.has_part("j", 0, 1), mon.recent_rejects
        # the steps read from its file are noted in its row: read once
        assert store.overlapping_parts("j", 0, 2, 0, 29)[0] == (0, 0, 29, "0-3,29")
        mon.stop()
    finally:
        store.close()


def test_a_window_waits_for_the_steps_a_wild_part_skipped():
    """Rank 0's wild part (0..3 and 29) moves its frontier to 29, but its step 4 comes in its
    next part: the window of steps 0..4 waits for it (gap_wait_s) instead of being cut with
    rank 0's rows of 0..3 alone and its step 4 dropped as late."""
    from stragglers.monitor.windows import JobTracker

    trace = slow_job(steps=30, slow=None)
    tr = JobTracker("j", trace.meta, 5, gap_wait_s=10.0)
    parts = job_parts(trace)
    for rank, part, cols in parts:
        if part == 0:   # rank 0's wild part, the other ranks' steps 0..4
            tr.add_part(rank, part, int(cols["step"].max()), cols, 100.0)
    assert tr.close_ready(101.0) == []
    rank0 = {part: cols for rank, part, cols in parts if rank == 0}
    tr.add_part(0, 1, 8, rank0[1], 102.0)
    (w,) = tr.close_ready(102.0)
    assert w.steps == [0, 1, 2, 3, 4] and w.missing_ranks == []
    assert 4 in set(w.trace.ops["step"][w.trace.ops["rank"] == 0].tolist())
    assert tr.late_rows == 0


def test_a_rank_that_keeps_sending_without_a_windows_steps_holds_it_gap_wait_s_at_most():
    """The wait for a rank's rows of a window is bounded from when the window was ready: a
    rank that keeps sending parts (here without rows) never lets its latest part grow old."""
    from stragglers.monitor.windows import JobTracker

    trace = slow_job(steps=30, slow=None)
    tr = JobTracker("j", trace.meta, 5, gap_wait_s=10.0)
    for rank, part, cols in job_parts(trace):
        if part == 0:
            tr.add_part(rank, part, int(cols["step"].max()), cols, 100.0)
    assert tr.close_ready(101.0) == []
    for part, t in [(1, 105.0), (2, 109.0), (3, 110.5)]:   # parts with no rows, one each few s
        tr.add_part(0, part, 29, None, t)
        assert tr.close_ready(t) == []
    (w,) = tr.close_ready(111.0)   # 10 s after the window was first ready
    assert w.steps == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("kind", ["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def test_a_store_of_the_previous_schema_gains_step_sets_and_keeps_its_rows(kind, tmp_path,
                                                                           request):
    """A store written before step sets (SQLite or PostgreSQL) opens with the column added;
    its rows read back with no step set, new rows keep theirs."""
    if kind == "sqlite":
        target = str(tmp_path / "old.db")
        with sqlite3.connect(target) as old:
            old.executescript(SCHEMA.replace(" step_set TEXT,", ""))
            old.execute("INSERT INTO parts (job, rank, part, records, first_step, last_step, "
                        "bytes, way, ingested_at) VALUES ('j', 0, 0, 5, 0, 904, 1, 'http', 1)")
    else:
        import psycopg

        from stragglers.monitor.store_postgres import SCHEMA as PG_SCHEMA
        target = request.getfixturevalue("postgres_url")
        with psycopg.connect(target, autocommit=True) as old:
            for statement in PG_SCHEMA.split(";"):
                if statement.strip() and "step_set" not in statement:
                    old.execute(statement)
            old.execute("INSERT INTO parts (job, rank, part, records, first_step, last_step, "
                        "bytes, way, ingested_at) VALUES ('j', 0, 0, 5, 0, 904, 1, 'http', 1)")
    store = open_store(target)
    try:
        store.register_job("j", "/data/j", "http", {"name": "j"}, now=0.0)
        assert store.overlapping_parts("j", 0, 1, 5, 9) == [(0, 0, 904, None)]
        assert store.add_parts([("j", 0, 1, 5, 5, 9, 1, "http", None, "5-9")]) == [True]
        assert store.overlapping_parts("j", 0, 2, 9, 9) == [(0, 0, 904, None), (1, 5, 9, "5-9")]
        assert [p.part for p in store.parts("j")] == [0, 1]
    finally:
        store.close()


@pytest.mark.slow
def test_an_uploaded_wild_part_moves_no_window_past_the_steps_it_skipped(tmp_path):
    """An upload's rows are decoded when checked: its step set is kept, so the window of
    steps 0..4 waits for rank 0's step 4 (its next part) rather than being cut with the wild
    part's rows of 0..3 (its range 0..29 taken as present) and step 4's rows never read."""
    trace = slow_job(steps=30, slow=None)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN,
                      config=CFG.replace(gap_wait_s=600.0)).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            url = "/api/jobs/j/ranks/{}/parts/{}"
            parts = {(rank, part): cols for rank, part, cols in job_parts(trace)}
            for rank, part in [(0, 0), (1, 0), (2, 0), (3, 0), (1, 1)]:
                # (rank 1's part 1 after the others: its batch follows theirs, whose windows
                # were cut by then)
                r = c.put(url.format(rank, part), content=table_bytes(parts[rank, part]),
                          headers=AUTH)
                assert r.status_code == 200, (rank, part, r.text)
            assert s.monitor.trackers["j"].next_idx == 0, "window 0..4 cut without rank 0's 4"
            for rank, part in [k for k in parts if k not in [(0, 0), (1, 0), (2, 0), (3, 0),
                                                               (1, 1)]]:
                r = c.put(url.format(rank, part), content=table_bytes(parts[rank, part]),
                          headers=AUTH)
                assert r.status_code == 200, (rank, part, r.text)
            check_windows(c)
    finally:
        s.stop()
