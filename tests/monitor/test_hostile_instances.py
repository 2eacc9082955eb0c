"""Two instances on one PostgreSQL store (issue 34): the empty-job expiry sweep of one and a
part stored by another in the same moment leave no orphan part row and no part acknowledged
for a job that is gone. Interleavings are forced with row locks held by a second connection
(the blocked statement is seen waiting in pg_locks), never with sleeps."""

from __future__ import annotations

import threading

import pytest

from conftest import eventually
from pg_cluster import postgres_cluster, postgres_url  # noqa: F401 - fixtures
from stragglers.monitor.store import open_store

pytestmark = pytest.mark.slow


def waiting_on_a_lock(db) -> bool:
    """Whether another backend waits for a row lock now."""
    return bool(db.execute("SELECT 1 FROM pg_locks WHERE NOT granted").fetchall())


def in_thread(fn):
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except BaseException as exc:   # noqa: BLE001 - handed to the test
            out["error"] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def while_another_holds(url: str, statements: list[str], call, what: str):
    """`call()`'s result, run while another instance's transaction has run `statements` and not
    yet committed: started once they hold their row locks, and let go once `call` is seen
    waiting for them (or is done); (result, the other instance's connection)."""
    import psycopg

    other = psycopg.connect(url, autocommit=True)
    with other.transaction():
        for sql in statements:
            other.execute(sql)
        t, out = in_thread(call)
        watch = psycopg.connect(url, autocommit=True)
        eventually(lambda: waiting_on_a_lock(watch) or not t.is_alive(), what=what)
    t.join(60)
    assert "error" not in out, out
    return out["value"], other


def part_row(job):
    return (job, 0, 0, 10, 0, 4, 100, "http", "digest")


def test_a_part_stored_while_the_sweep_waits_keeps_its_job(postgres_url):
    store = open_store(postgres_url)
    try:
        store.register_job("j", "/data/j", "http", {"name": "j"}, now=0.0)
        # another instance's add_parts: the job's row locked, its part inserted, not committed
        swept, _ = while_another_holds(
            postgres_url,
            ["SELECT part_seq FROM jobs WHERE job = 'j' FOR UPDATE",
             "INSERT INTO parts (job, rank, part, records, first_step, last_step, bytes, way, "
             "ingested_at, digest, seq) VALUES ('j', 0, 0, 10, 0, 4, 100, 'http', 1.0, 'd', 1)"],
            lambda: store.expire_empty_jobs(before=10.0, way="http"),
            "the sweep waiting for the job's row")
        assert swept == [], "the sweep deleted a job whose part was just stored"
        assert store.job("j") is not None
        assert store.parts("j") and len(store.parts("j")) == 1
    finally:
        store.close()


def test_a_part_for_a_job_the_sweep_is_deleting_is_not_stored(postgres_url):
    store = open_store(postgres_url)
    try:
        store.register_job("j", "/data/j", "http", {"name": "j"}, now=0.0)
        # another instance's sweep: the job's row deleted, not committed yet
        stored, other = while_another_holds(
            postgres_url,
            ["DELETE FROM jobs WHERE job = 'j'", "DELETE FROM leases WHERE job = 'j'"],
            lambda: store.add_parts([part_row("j")]),
            "add_parts waiting for the job's row")
        assert stored == [None], "a part of a deleted job was taken as stored"
        orphans = other.execute("SELECT COUNT(*) FROM parts").fetchone()[0]
        assert orphans == 0, "an orphan part row of a deleted job"
    finally:
        store.close()
