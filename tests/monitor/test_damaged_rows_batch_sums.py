"""A damaged count in a part or drop row (2^63-1: a torn page, a bad restore, another tool)
cannot overflow the store's sums: /api/stats, the job list and a job's bytes still read (an
integer SUM overflowed, SQLite's and PostgreSQL's BIGINT alike, and the read failed for good:
/api/stats answered 503 "cannot reach its storage")."""

from __future__ import annotations

import pytest

from pg_cluster import postgres_cluster, postgres_url  # noqa: F401 - fixtures
from stragglers.monitor.store import open_store

BIG = 2 ** 63 - 1


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])
def store(request, tmp_path):
    target = str(tmp_path / "mon.db") if request.param == "sqlite" else \
        request.getfixturevalue("postgres_url")
    s = open_store(target)
    yield s
    s.close()


def _damage(store, sql: str, args=()) -> None:
    store._write(lambda db: store._exec(db, sql, args))


def test_sums_of_a_damaged_count_still_read(store):
    store.register_job("bad", "/runs/bad", "http", None)
    store.register_job("ok", "/runs/ok", "http", None)
    store.add_parts([("bad", 0, 0, 5, 0, 4, 100, "http"), ("bad", 1, 0, 5, 0, 4, 100, "http"),
                     ("ok", 0, 0, 7, 0, 4, 100, "http")])
    store.set_upload_dropped("bad", 0, 3)
    store.set_upload_dropped("bad", 1, 4)
    _damage(store, "UPDATE parts SET records = ?, bytes = ? WHERE job = 'bad' AND rank = 0",
            (BIG, BIG))
    _damage(store, "UPDATE upload_drops SET dropped = ? WHERE job = 'bad' AND rank = 0", (BIG,))
    totals = store.totals()
    assert totals["by_job"]["ok"].records == 7 and totals["by_job"]["ok"].parts == 1
    assert totals["by_job"]["bad"].parts == 2 and totals["by_job"]["bad"].records >= BIG
    assert totals["by_way"]["http"].parts == 3
    # the damaged job's bytes are past any limit (its parts refused as full): its own matter
    assert store.job_bytes("bad") >= BIG and store.job_bytes("ok") == 100
    listed = {j.job: j for j in store.jobs()}
    assert listed["ok"].upload_dropped == 0 and listed["ok"].state == "running"
    assert listed["bad"].upload_dropped >= BIG and listed["bad"].state == "running"
