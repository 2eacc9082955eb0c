"""A job's bytes past its last window (max_job_bytes) are read after every stored window: the
read visits the parts of the tail alone, not every part row of a long job (an index on
(job, last_step), in both stores)."""

from __future__ import annotations

import sqlite3

import pytest

from pg_cluster import postgres_cluster, postgres_url  # noqa: F401 - fixtures
from stragglers.monitor.store import PostgresStore, open_store
from stragglers.monitor.store_base import JOB_BYTES_SQL
from stragglers.monitor.store_postgres import to_psycopg

RANKS = 4
PART = "INSERT INTO parts (job, rank, part, records, first_step, last_step, bytes, way, " \
       "ingested_at) VALUES (?, ?, ?, 100, ?, ?, 1000, 'http', 0)"
WINDOW = "INSERT INTO windows (job, idx, first_step, last_step, steps, scores, diagnosis, " \
         "missing_ranks, reason, closed_at, analysed_at, analysis_s) VALUES " \
         "(?, ?, 0, ?, '', '', '', '', '', 0, 0, 0)"


def _long_job(store, windows: int, postgres: bool = False) -> None:
    """Job j: a part per rank per window of 5 steps; every window analysed but the last."""
    parts = [("j", r, w, 5 * w, 5 * w + 4) for w in range(windows) for r in range(RANKS)]

    def fill(db):
        if postgres:
            with db.cursor() as cur:
                cur.executemany(to_psycopg(PART), parts)
                cur.execute(to_psycopg(WINDOW), ("j", windows - 2, 5 * (windows - 1) - 1))
        else:
            db.executemany(PART, parts)
            db.execute(WINDOW, ("j", windows - 2, 5 * (windows - 1) - 1))
    store._write(fill)


def _steps(store, used: list) -> tuple[int, int]:
    """(job_bytes("j"), SQLite virtual-machine steps it took) on this thread's connection
    (taken as the store's reads take it, and given back: `used` gets it)."""
    db = store._reader()
    used.append(db)
    steps = [0]

    def count() -> int:
        steps[0] += 1
        return 0
    db.set_progress_handler(count, 1)
    try:
        got = store.job_bytes("j")
    finally:
        db.set_progress_handler(None, 1)
        store._done(db)   # (taken without it, the store's close left it open: counted in use)
    return got, steps[0]


def test_sqlite_job_bytes_visits_the_tail_not_every_part_row(tmp_path):
    short, long = open_store(str(tmp_path / "short.db")), open_store(str(tmp_path / "long.db"))
    used: list = []
    try:
        _long_job(short, 10)
        _long_job(long, 1000)
        (got_short, steps_short), (got_long, steps_long) = _steps(short, used), \
            _steps(long, used)
    finally:
        short.close()
        long.close()
    for db in used:   # the stores' close closed the connections the test read through
        with pytest.raises(sqlite3.ProgrammingError):
            db.execute("SELECT 1")
    assert got_short == got_long == RANKS * 1000   # the last window's parts alone
    # 100 times the part rows, the same tail: the read's work is the tail's (a b-tree one
    # level deeper at most), where a scan of the job's rows took ~100 times the steps
    assert steps_long < 2 * steps_short, (steps_short, steps_long)


@pytest.mark.slow
def test_postgres_job_bytes_is_served_by_the_tail_index(postgres_url):
    store = PostgresStore(postgres_url)
    try:
        _long_job(store, 1000, postgres=True)
        store._conn().execute("ANALYZE parts")
        assert store.job_bytes("j") == RANKS * 1000
        # (the bound the read passes: the last window's last step)
        plan = "\n".join(r["QUERY PLAN"] for r in store._rows("EXPLAIN " + JOB_BYTES_SQL,
                                                                ("j", 5 * 999 - 1)))
    finally:
        store.close()
    assert "parts_tail" in plan and "last_step >" in plan, plan
