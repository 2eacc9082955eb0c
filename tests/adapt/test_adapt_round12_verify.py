"""Red team round 12, finding 4: the full check of a data set's rows at its first call since the
file was opened runs off the commit thread for a read (an anonymous status GET of a 655,360-row
data set held another job's lease 0.78 s), its result recorded by the writer: a sound data set
is not checked there again, a damaged one is quarantined before any write uses it."""

from __future__ import annotations

import sqlite3
import threading

import httpx

from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.service import EmbeddedServer
from stragglers.adapt.shards import ShardStore

OWNER = "owner-round12-verify-token-0123456789"
SCAN = "FROM shards WHERE dataset='big' AND NOT COALESCE"


def _made(db, damage: bool) -> None:
    """Data set 'big' with a leased shard (its rows written), then stopped; `damage`: a
    shard row made invalid in the file."""
    server = EmbeddedServer(db, durable=False).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {OWNER}"}) as c:
            r = c.post("/datasets", json={"name": "big", "num_samples": 4096, "shard_size": 64})
            assert r.status_code == 200, r.text
            fence = c.post("/datasets/big/join", json={"worker": "w"}).json()["fence"]
            assert c.post("/datasets/big/lease", json={"worker": "w", "fence": fence}
                          ).status_code == 200
    finally:
        server.stop()
    if damage:
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE shards SET consumed=-5 WHERE dataset='big' AND shard=("
                         "SELECT MAX(shard) FROM shards WHERE dataset='big')")


def _traced(server, then):
    """An anonymous status GET of 'big', then then(owner, out): the SQL the commit connection
    ran meanwhile, (thread, statement), and the answers (out; the GET's as out['status'])."""
    seen: list[tuple[str, str]] = []
    out: dict = {}
    conn = server.app.state.store._conn
    conn.set_trace_callback(lambda sql: seen.append((threading.current_thread().name, sql)))
    try:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {OWNER}"}) as owner, \
                httpx.Client(base_url=server.url, timeout=60) as anyone:
            out["status"] = anyone.get("/datasets/big/status")
            then(owner, out)
    finally:
        conn.set_trace_callback(None)
    return seen, out


def test_a_sound_data_set_checked_by_a_read_is_not_scanned_by_the_writer(tmp_path):
    """After a restart an anonymous status GET checks 'big' on the reader; the writer records
    it: neither that GET nor the owner's next lease scans its rows on the commit connection."""
    db = tmp_path / "s.db"
    _made(db, damage=False)
    server = EmbeddedServer(db, durable=False).start()
    try:
        def then(owner, out):
            out["verified"] = "big" in server.app.state.store._verified
            fence = owner.post("/datasets/big/join", json={"worker": "v"}).json()["fence"]
            out["lease"] = owner.post("/datasets/big/lease", json={"worker": "v", "fence": fence})
        seen, out = _traced(server, then)
        assert out["status"].status_code == 200, out["status"].text
        assert out["verified"] is True
        assert out["lease"].status_code == 200, out["lease"].text
        assert not [s for _, s in seen if SCAN in s], "the writer scanned 'big'"
        assert "shard-reads" in " ".join(server.app.state.reader.threads_used)
    finally:
        server.stop()


def test_a_damaged_data_set_found_by_a_read_is_quarantined_for_writes(tmp_path):
    """A damaged shard row found by an anonymous status GET's check (503 Quarantined naming
    it) quarantines 'big' on the writer: the owner's lease is refused without a scan there, and
    nothing is written (the leased shard count stays as it was)."""
    db = tmp_path / "s.db"
    _made(db, damage=True)
    server = EmbeddedServer(db, durable=False).start()
    try:
        seen, out = _traced(server, lambda owner, out: out.setdefault("lease", owner.post(
            "/datasets/big/lease", json={"worker": "w", "fence": 1})))
        for r in (out["status"], out["lease"]):
            assert r.status_code == 503 and r.json()["kind"] == "Quarantined", r.text
        assert "shard" in out["status"].json()["error"]
        assert not [s for _, s in seen if SCAN in s], "the writer scanned 'big'"
    finally:
        server.stop()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT COUNT(*) FROM shards WHERE dataset='big' AND"
                            " state='DOING'").fetchone() == (1,)


def test_a_check_made_before_a_commit_touched_the_data_set_is_not_recorded(tmp_path):
    """store.checked at a generation older than the data set's (a commit touched it since):
    nothing recorded, its next writer call checks it (as after another process's write)."""
    store = ShardStore(tmp_path / "s.db", durable=False)
    try:
        store.create_dataset(DatasetConfig("d", 64, 8), None)
        seen = store.generation("d")
        store._verified.discard("d")
        store.join("d", "w", None)   # (checks d itself, touches it)
        store._verified.discard("d")
        store.checked("d", seen, None)
        assert "d" not in store._verified
        store.checked("d", store.generation("d"), None)
        assert "d" in store._verified
    finally:
        store.close()
