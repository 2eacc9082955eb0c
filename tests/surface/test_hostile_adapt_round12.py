"""Red team round twelve (issue 34): the shard service's new code of session 49 (reads and
shuffles taken in turns by caller, the index pace waited before a big lease's commit, fence
floors with a folded-names filter, schema 7), against other callers' load and damaged rows.

Each test is one defect, marked xfail(strict=True) until its fix lands (then the mark goes): a
pass before the fix fails the suite. Real servers on loopback (the shard service on a thread of
this process, as tests/adapt's hostile tests start it), real SQLite. Orders are observed on the
service's own queues with its threads held by events, never timed.
"""

from __future__ import annotations

import sqlite3
import sys
import threading

import httpx
import pytest

from conftest import REPO, eventually

sys.path.insert(0, str(REPO / "tests" / "adapt"))
from adapt_jobs import held_reader, snapshot_head, with_errors  # noqa: E402

OWNER = "owner-round12-token-0123456789"
STRANGER = "stranger-round12-token-0123456789"


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


def _until(check, what: str) -> None:
    eventually(check, timeout=30, interval=0.005, what=what)   # (a bound against a hang)


def test_made_up_tokens_do_not_each_get_a_turn_on_the_reader_thread(tmp_path):
    """The reader thread takes reads in turns by caller so that a job's first lease (its data
    set's limits, read there) waits for at most one read of each other caller. But the caller
    is the bearer token's digest as sent, checked against nothing: status and snapshot GETs need
    no token, so one client sending each GET with a new made-up token is a new caller each time.
    Reader held; four status GETs of one client, each with a made-up token, queue as four keys;
    job V's first lease queues fifth, behind all four (with its snapshot GETs of distinct big
    data sets, each build ~1 s at 655,360 rows, V's lease waits for all of them). Made-up
    tokens must share one turn (their client's), as they share its anonymous pace."""
    from stragglers.adapt.service import token_digest

    with held_reader(tmp_path, OWNER) as h:
        for i in range(4):
            made_up = f"made-up-round12-{i:02d}-0123456789abcdef"
            h.start(f"g{i}", lambda t=made_up: h.anyone.get("/datasets/v/status",
                                                             headers=_bearer(t)))
            _until(lambda i=i: h.reader._queued == i + 2, f"GET {i} never queued")
        h.start("lease", lambda: h.v.post("/datasets/v/lease",
                                          json={"worker": "w", "fence": h.fence}))
        _until(lambda: token_digest(OWNER) in h.reader._turns._waiting, "V's read never queued")
        order = list(h.reader._turns._waiting)
        ahead = order.index(token_digest(OWNER))
        assert h.release() is True
        assert {n: r.status_code for n, r in h.out.items()} == {
            "g0": 200, "g1": 200, "g2": 200, "g3": 200, "lease": 200}
        assert ahead <= 1, (f"job V's read queued behind {ahead} waiting keys' reads (and the "
                            f"one on the thread), all one client's GETs with made-up tokens")


def test_one_clients_queued_reads_do_not_refuse_a_jobs_first_lease(tmp_path):
    """The reader thread's queue is bounded in all (max_queued_reads, 64 by default; 8 here),
    not per caller: taking turns orders the queue, but one anonymous client's status GETs (50 a
    second pass the read pacer) fill it while a read runs (a snapshot build of 655,360 rows:
    ~1 s), and job V's first lease of its data set — whose limits are read on that thread —
    is 503 Busy "8 reads are queued" though V has no read queued at all. One caller's reads
    must be bounded by a share of the queue (refused past it), never another caller's."""
    from stragglers.adapt.service import ServiceConfig

    with held_reader(tmp_path, OWNER, ServiceConfig(max_queued_reads=8)) as h:
        for i in range(7):   # (the held read: a long read on the thread)
            h.start(f"g{i}", lambda: h.anyone.get("/datasets/v/status"))
            _until(lambda i=i: h.reader._queued == i + 2, f"GET {i} never queued")
        lease = h.v.post("/datasets/v/lease", json={"worker": "w", "fence": h.fence})
        assert h.release() is True
        assert lease.status_code == 200, (f"job V's first lease {lease.status_code}: "
                                          f"{lease.text[:160]}")


def test_a_lost_store_floor_does_not_give_a_folded_name_its_old_fences(tmp_path):
    """max_kept_floors=0: data set d's floor (its worker w's fences went to 3) is folded into
    the store floor '*' at d's delete, and d into the folded names' filter (fence_folds). The
    '*' row then lost (a row gone from the file, as a damaged one) while the filter says d was
    folded: d created again, its worker w joins at fence 1 — a fence its deleted incarnation's
    w held (1..3), so a stuck holder of the old d is current again. The same '*' damaged to
    'x' is refused (503 Quarantined, nothing created): a missing store floor is read as 0
    ("nothing folded") though the filter proves names were. Expected: above 3, or refused."""
    from stragglers.adapt.service import EmbeddedServer, ServiceConfig

    db = tmp_path / "s.db"
    config = ServiceConfig(max_kept_floors=0)
    server = EmbeddedServer(db, durable=False, config=config).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=_bearer(OWNER)) as c:
            r = c.post("/datasets", json={"name": "d", "num_samples": 64, "shard_size": 8})
            assert r.status_code == 200, r.text
            fences = [c.post("/datasets/d/join", json={"worker": "w"}).json()["fence"]
                      for _ in range(3)]
            assert fences == [1, 2, 3]
            assert c.delete("/datasets/d").status_code == 200
    finally:
        server.stop()
    with sqlite3.connect(db) as conn:
        assert conn.execute("SELECT * FROM fence_floors").fetchall() == [("*", 3)]
        assert conn.execute("SELECT COUNT(*) FROM fence_folds").fetchone()[0] == 1
        conn.execute("DELETE FROM fence_floors WHERE dataset='*'")
    server = EmbeddedServer(db, durable=False, config=config).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=_bearer(OWNER)) as c:
            r = c.post("/datasets", json={"name": "d", "num_samples": 64, "shard_size": 8})
            if r.status_code == 200:
                joined = c.post("/datasets/d/join", json={"worker": "w"})
                assert joined.status_code != 200 or joined.json()["fence"] > 3, (
                    f"d's new worker w joined at fence {joined.json()['fence']}, one its"
                    f" deleted incarnation held (1..3)")
            else:
                assert r.status_code == 503, r.text
    finally:
        server.stop()


def test_an_anonymous_status_get_scans_no_data_set_on_the_commit_thread(tmp_path):
    """The first call on a data set since the file was opened checks all its shard rows
    (first_bad_shard: one SQL scan) on the commit thread, and anyone may make that call: a
    status GET (no token) of a data set not yet in store._verified runs store.expire on the
    commit thread. Probe (/tmp/h/hRa2_probe4.py): a stranger's data set of 655,360 shard rows
    (restored), the service restarted, one anonymous status GET of it: another job's lease
    took 0.78 s against 1.3 ms quiet. Every restore of a data set, and any write of another
    process to the file (_sync clears _verified), makes its next GET scan again. Checked here
    by the statements the commit connection runs (its SQLite trace): the scan of data set 'big'
    must not run there for an anonymous read (check the rows on the reader thread, whose
    connection sees the same committed state, and only mark them checked on the writer)."""
    from stragglers.adapt.service import EmbeddedServer

    db = tmp_path / "s.db"
    server = EmbeddedServer(db, durable=False).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=_bearer(STRANGER)) as c:
            r = c.post("/datasets", json={"name": "big", "num_samples": 4096, "shard_size": 64})
            assert r.status_code == 200, r.text
    finally:
        server.stop()
    server = EmbeddedServer(db, durable=False).start()
    seen: list[tuple[str, str]] = []
    try:
        conn = server.app.state.store._conn
        conn.set_trace_callback(lambda sql: seen.append((threading.current_thread().name, sql)))
        with httpx.Client(base_url=server.url, timeout=60) as anyone:
            r = anyone.get("/datasets/big/status")
            assert r.status_code == 200, r.text
        conn.set_trace_callback(None)
        scans = [(t, sql[:60]) for t, sql in seen
                 if "FROM shards WHERE dataset='big' AND NOT COALESCE" in sql]
        assert not scans, f"an anonymous GET scanned 'big' on the commit connection: {scans}"
    finally:
        server.stop()


def test_an_owner_reading_its_snapshot_slowly_does_not_hold_other_owners_snapshots(tmp_path):
    """Snapshot bodies are sent in 256 KiB chunks holding a send slot; owners' sends share
    max_snapshot_sends (1) slots in all, and a slot is lost only by a client that takes no
    chunk for send_timeout_s (10 s). Token S's data set of 8,192 shards with 1,000-character
    errors (an 8 MB snapshot, more than the loopback socket buffers) asked by a client that
    reads nothing after the head: job V's snapshot of its own 8-shard data set waits for the
    slot and is 503 Busy after max_read_wait_s (0.5 s here); a reader taking a chunk every
    9 s holds it for 32 x 9 s = ~5 min (a 26 MB snapshot: ~15 min). Slots must be per token
    (or a send slower than a floor pace lose it; or a body under one chunk sent without one)."""
    import socket

    from stragglers.adapt.service import EmbeddedServer, ServiceConfig

    db = tmp_path / "s.db"
    config = ServiceConfig(max_read_wait_s=0.5)
    shards = 1 << 13
    server = EmbeddedServer(db, durable=False, config=config).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=_bearer(STRANGER)) as c:
            r = c.post("/datasets", json={"name": "s", "num_samples": 2 * shards,
                                          "shard_size": 2})
            assert r.status_code == 200, r.text
        with httpx.Client(base_url=server.url, timeout=60, headers=_bearer(OWNER)) as c:
            r = c.post("/datasets", json={"name": "v", "num_samples": 64, "shard_size": 8})
            assert r.status_code == 200, r.text
    finally:
        server.stop()
    with_errors(db, "s", shards)   # (an 8 MB snapshot, more than the socket buffers hold)
    server = EmbeddedServer(db, durable=False, config=config).start()
    slow = socket.socket()
    try:
        head = snapshot_head(slow, server, "s", STRANGER)   # (it holds a slot; nothing read)
        assert head.startswith(b"HTTP/1.1 200"), head
        with httpx.Client(base_url=server.url, timeout=60, headers=_bearer(OWNER)) as v:
            r = v.get("/datasets/v/snapshot")
        assert r.status_code == 200, f"job V's own snapshot {r.status_code}: {r.text[:160]}"
    finally:
        slow.close()
        server.stop()
