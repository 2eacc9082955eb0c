"""A free lease row whose epoch is not a whole number (damaged: 1.5, text) is taken like any
other: its RETURNING raised out of the heartbeat, which takes and renews every lease of the
instance in one transaction, so no job of the store was analysed (every heartbeat failed)."""

from __future__ import annotations

import sqlite3

import pytest

from stragglers.monitor.store import open_store


@pytest.mark.parametrize("epoch", ["1.5", "'x'", "X'00ff'"])
def test_a_damaged_free_epoch_does_not_fail_the_heartbeat(tmp_path, epoch):
    path = tmp_path / "mon.db"
    store = open_store(str(path))
    try:
        for job in ("a", "b"):
            store.register_job(job, f"/runs/{job}", "http", None)
        with sqlite3.connect(path) as db:
            db.execute(f"UPDATE leases SET epoch = {epoch} WHERE job = 'a'")
        db.close()
        held = store.heartbeat("i", "http://i", 30.0, {}, alone=True)
        assert sorted(held) == ["a", "b"] and all(isinstance(e, int) for e in held.values())
        assert store.take_lease("j", "a", 30.0) is None   # held by i now, its epoch whole
        assert {r.job: r.owner for r in store.leases()} == {"a": "i", "b": "i"}
    finally:
        store.close()


def test_a_damaged_epoch_of_a_new_jobs_lease_is_taken(tmp_path):
    path = tmp_path / "mon.db"
    store = open_store(str(path))
    try:
        store.register_job("a", "/runs/a", "http", None)
        with sqlite3.connect(path) as db:
            db.execute("UPDATE leases SET epoch = 2.5 WHERE job = 'a'")
        db.close()
        assert store.take_lease("i", "a", 30.0) == 3
    finally:
        store.close()
