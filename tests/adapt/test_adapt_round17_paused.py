"""Round 17: a restore, or a fence change, while a lease waits for its token's big-shuffle pause
(the ShufflePaused path): the lease commits against the state after it, never the one before,
and never hands out a shard to an incarnation fenced off meanwhile. Real server, real SQLite."""

from __future__ import annotations

import contextlib
import sqlite3
import threading

import httpx
import pytest

from adapt_clock import BIG, held_pauses, two_big_datasets
from conftest import eventually
from stragglers.adapt.service import EmbeddedServer, ServiceConfig

TOKEN = "job-r17-paused-shuffle-token-0123456789"


def _rows(db, name: str) -> list[tuple]:
    """(shard, state, worker, fence, consumed) of data set `name`'s held or started shards."""
    with contextlib.closing(sqlite3.connect(db)) as c:
        key = c.execute("SELECT coalesce(rows_key, name) FROM datasets WHERE name=?",
                        (name,)).fetchone()[0]
        return c.execute("SELECT shard, state, worker, fence, consumed FROM shards WHERE"
                         " dataset=? AND (state='DOING' OR consumed>0) ORDER BY shard",
                         (key,)).fetchall()


@contextlib.contextmanager
def _paused_lease(tmp_path):
    """A server whose token's next big shuffle (data set b's, its permutation dropped) waits in
    a pause the test holds: yields (server, client, fences, lease), `lease()` starting b's
    lease by w on a thread and returning (thread, out) once it waits in that pause."""
    db = tmp_path / "s.db"
    server = EmbeddedServer(db, durable=False, config=ServiceConfig(
        shuffle_share=0.01, refusal_delay_s=0.0, auth_failure_delay_s=0.0)).start()
    computing, store = server.app.state.shuffling, server.app.state.store
    store.permutations.max_bytes = 1   # (keeps the last one only: a's shuffle drops b's)
    clock, pausing, go = held_pauses(computing)   # (a pause passes only when told)
    threads = []
    try:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            fences = two_big_datasets(c)
            for name in ("b", "a"):   # (b's shuffle, then a's past b's pause: b's dropped)
                clock.now += 1e6
                r = c.post(f"/datasets/{name}/lease", json={"worker": "w",
                                                            "fence": fences[name]})
                assert r.status_code == 200 and r.json()["leases"], r.text
                eventually(lambda: not computing._held, timeout=60, interval=0.005,
                           what=f"{name}'s shuffle never ended")
            assert store.permutations.cached((BIG, 2, 0)) is None

            def lease(fence: int) -> tuple[threading.Thread, dict]:
                out: dict = {}
                t = threading.Thread(target=lambda: out.setdefault("r", c.post(
                    "/datasets/b/lease", json={"worker": "w", "fence": fence,
                                               "request_id": "r1"})))
                t.start()
                threads.append(t)
                eventually(lambda: pausing.is_set() or not t.is_alive(), timeout=60,
                           interval=0.005, what="b's lease neither paused nor answered")
                assert pausing.is_set(), out["r"].text
                return t, out
            yield server, db, c, fences, lease, go
    finally:
        go.set()
        for t in threads:
            t.join(60)
        server.stop()


def test_a_restore_while_a_lease_waits_its_shuffle_pause_is_what_the_lease_commits_on(tmp_path):
    with _paused_lease(tmp_path) as (server, db, c, fences, lease, go):
        # b: w holds its first shard, 10 samples acked: the snapshot
        (first,) = _rows(db, "b")
        assert c.post("/datasets/b/ack", json={"worker": "w", "fence": fences["b"], "epoch": 0,
                                               "shard": first[0], "consumed": 10}
                      ).status_code == 200
        snap = c.get("/datasets/b/snapshot").content
        # then w acks it to 30: the state the restore replaces
        assert c.post("/datasets/b/ack", json={"worker": "w", "fence": fences["b"], "epoch": 0,
                                               "shard": first[0], "consumed": 30}
                      ).status_code == 200
        t, out = lease(fences["b"])
        assert [r[1:] for r in _rows(db, "b")] == [("DOING", "w", fences["b"], 30)]
        r = c.post("/datasets/b/restore", content=snap,
                   headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        go.set()
        t.join(60)
        r = out["r"]
        assert r.status_code == 200, r.text
        (got,) = r.json()["leases"]
        # the snapshot's shard goes first, from its offset there (10): leased after the
        # restore, not the next shard of the state before it (held at 30)
        assert (got["shard"], got["offset"]) == (first[0], 10), got
        assert [x[:2] + x[4:] for x in _rows(db, "b")] == [(first[0], "DOING", 10)]
        assert c.get("/health").status_code == 200


@pytest.mark.parametrize("change", ["join", "launcher_release"])
def test_a_fence_change_while_a_lease_waits_its_shuffle_pause_refuses_the_lease(tmp_path,
                                                                                 change):
    with _paused_lease(tmp_path) as (server, db, c, fences, lease, go):
        assert [r[1:3] for r in _rows(db, "b")] == [("DOING", "w")]
        t, out = lease(fences["b"])
        if change == "join":   # a new incarnation of w
            r = c.post("/datasets/b/join", json={"worker": "w"})
        else:                  # its launcher saw it die: every incarnation fenced off
            r = c.post("/datasets/b/release", json={"worker": "w", "failure": True})
        assert r.status_code == 200, r.text
        go.set()
        t.join(60)
        r = out["r"]
        assert r.status_code == 409 and r.json()["kind"] == "Fenced", r.text
        # nothing held by the old incarnation: its shard went back, no new one leased
        assert all(row[1] != "DOING" for row in _rows(db, "b")), _rows(db, "b")
        assert c.get("/health").status_code == 200
