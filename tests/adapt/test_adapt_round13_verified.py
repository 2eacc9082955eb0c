"""A data set created or restored by the service has its rows checked already: its owner's first
write waits for no read of the reader thread (round 13, with the first write's check moved onto
the reader: it queued there behind other callers' reads)."""

from __future__ import annotations

import threading

import httpx

from adapt_jobs import held_reader
from conftest import eventually
from stragglers.adapt.service import EmbeddedServer

OWNER = "owner-verified-round13-0123456789"


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def test_a_created_data_sets_first_write_reads_nothing_on_the_reader(tmp_path):
    # (fails before: the join queued its data set's full check behind the held read)
    with held_reader(tmp_path, OWNER) as h:
        r = h.v.post("/datasets", json={"name": "n", "num_samples": 64, "shard_size": 8})
        assert r.status_code == 200, r.text
        queued = h.reader._queued
        h.start("join", lambda: h.v.post("/datasets/n/join", json={"worker": "w"}))
        eventually(lambda: "join" in h.out or h.reader._queued > queued, timeout=30,
                   interval=0.005, what="the join answered or queued")
        assert "join" in h.out and h.out["join"].status_code == 200, h.reader._queued
        assert h.release() is True


def test_a_data_set_restored_as_new_has_its_rows_checked_by_its_restore(tmp_path):
    # (fails before: restore_finish never marked it: its next write checked all its rows, on
    # the commit thread, or, with that check on the reader, behind the held read)
    server = EmbeddedServer(tmp_path / "s.db", durable=False).start()
    held = threading.Event()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=_bearer(OWNER)) as c:
            assert c.post("/datasets", json={"name": "x", "num_samples": 64,
                                             "shard_size": 8}).status_code == 200
            snapshot = c.get("/datasets/x/snapshot").content
            assert c.delete("/datasets/x").status_code == 200
            r = c.post("/datasets/x/restore", content=snapshot,
                       headers={"Content-Type": "application/json"})
            assert r.status_code == 200, r.text
            reader = server.app.state.reader
            blocker = reader.submit(lambda conn: held.wait(60))
            queued = reader._queued
            out: dict = {}
            t = threading.Thread(target=lambda: out.setdefault("join", c.post(
                "/datasets/x/join", json={"worker": "w"})))
            t.start()
            eventually(lambda: "join" in out or reader._queued > queued, timeout=30,
                       interval=0.005, what="the join answered or queued")
            assert "join" in out and out["join"].status_code == 200, reader._queued
            held.set()
            t.join(60)
            assert blocker.result(60) is True
    finally:
        held.set()
        server.stop()
