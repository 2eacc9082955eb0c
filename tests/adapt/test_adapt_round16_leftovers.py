"""Round 16's leftovers of the shard service: launchers' releases written by older code, and a
big shuffle's pause waited for before its lease's commit."""

from __future__ import annotations

import contextlib
import sqlite3
import threading

import httpx
import pytest

from adapt_clock import BIG, held_pauses, two_big_datasets
from conftest import eventually
from stragglers.adapt.dataset import DatasetConfig, epoch_permutation
from stragglers.adapt.errors import Fenced
from stragglers.adapt.service import EmbeddedServer, ServiceConfig, token_digest
from stragglers.adapt.shards import FENCED_OFF, ShardStore


def test_a_launchers_release_written_by_older_code_is_fenced_off_at_the_upgrade(tmp_path):
    # (fails before: code before FENCED_OFF wrote a launcher's release as LEFT at the next
    # fence, which nobody held, and that file, opened by this code, served a lease at it)
    db = tmp_path / "s.db"
    s = ShardStore(db)
    s.create_dataset(DatasetConfig("d", 100, 10))
    f = s.join("d", "gone").fence
    s.lease("d", "gone", f, request_id="r1")
    s.release("d", "gone")   # its launcher saw it die
    mine = s.join("d", "self").fence
    s.lease("d", "self", mine, request_id="r1")
    s.release("d", "self", mine)   # its own release: its fence stays its own
    s.close()
    with sqlite3.connect(db) as c:   # as the older code wrote it (its version: 7)
        assert c.execute("SELECT fence, reply, seq FROM workers WHERE worker='gone'"
                         ).fetchone() == (f + 1, FENCED_OFF, 0)
        c.executescript("UPDATE workers SET reply='left' WHERE worker='gone';"
                        " PRAGMA user_version=7;")
    s = ShardStore(db)
    try:
        with pytest.raises(Fenced, match="without a fence"):
            s.lease("d", "gone", f + 1, request_id="r2")
        assert s.lease("d", "self", mine, request_id="r2").status == "ok"
        again = s.join("d", "gone").fence
        assert again > f + 1 and s.lease("d", "gone", again).status == "ok"
    finally:
        s.close()


TOKEN = "job-r16-paused-shuffle-token-0123456789"


def _doing(db, name: str) -> int:
    with contextlib.closing(sqlite3.connect(db)) as c:
        key = c.execute("SELECT coalesce(rows_key, name) FROM datasets WHERE name=?",
                        (name,)).fetchone()[0]
        return c.execute("SELECT COUNT(*) FROM shards WHERE dataset=? AND state='DOING'",
                         (key,)).fetchone()[0]


def test_a_big_shuffle_past_its_tokens_share_is_waited_for_before_the_leases_commit(tmp_path):
    """A token's second big shuffle, asked within its pause (shuffle_share of a thread; its
    clock stopped, its sleep held by the test): the lease waits for the pause with nothing
    committed, then is committed and answered with its indices. (Fails before: committed first, then held in
    the pause: a 2**26 one answered up to 50 s after its commit, its 30 s lease expired.)"""
    db = tmp_path / "s.db"
    server = EmbeddedServer(db, durable=False, config=ServiceConfig(shuffle_share=0.01)).start()
    computing = server.app.state.shuffling
    _, pausing, go = held_pauses(computing)   # (the pause held until `go`)
    out: dict = {}
    try:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            fences = two_big_datasets(c)
            r = c.post("/datasets/a/lease", json={"worker": "w", "fence": fences["a"]})
            assert r.status_code == 200 and r.json()["leases"], r.text
            eventually(lambda: not computing._held, timeout=60, interval=0.005,
                       what="a's shuffle never ended")
            due = computing._due[token_digest(TOKEN)]   # (its pause: 99x its CPU time)
            assert due > computing.clock(), due
            t = threading.Thread(target=lambda: out.setdefault("b", c.post(
                "/datasets/b/lease", json={"worker": "w", "fence": fences["b"],
                                           "request_id": "r1"})))
            t.start()
            try:
                # (b's lease in its token's turn of the big-shuffle threads)
                eventually(lambda: computing._held or not t.is_alive(), timeout=60,
                           interval=0.005, what="b's lease neither paused nor answered")
                assert _doing(db, "b") == 0, "b's lease was committed before its pause"
                eventually(pausing.is_set, timeout=60, interval=0.005,
                           what="b's lease never paused")
                assert _doing(db, "b") == 0, "b's lease was committed in its pause"
            finally:
                go.set()
                t.join(60)
        r = out["b"]
        assert r.status_code == 200, r.text
        lease = r.json()["leases"][0]
        start = lease["shard"] * 64 + lease["offset"]
        assert lease["indices"] == epoch_permutation(BIG, 2, 0)[start:start + 64].tolist()
        assert _doing(db, "b") == 1
    finally:
        go.set()
        server.stop()
