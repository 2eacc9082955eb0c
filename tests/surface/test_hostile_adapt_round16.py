"""Red team round sixteen (issue 34): the shard service against numeric edges in every request
field, look-alike names, restore documents that are valid JSON but inconsistent, replays and
acks across a restore, another data set, epoch or incarnation, and a store locked by another
process at start — real servers on loopback, real SQLite.

Each hostile case must be refused (4xx/503) changing nothing, or answered cleanly; a case that
showed a defect starts as xfail(strict=True) and loses the mark with its fix (none is left:
see /tmp/h/hRa16-findings.md of session 52 for what each probed). Nothing is timed.
"""

from __future__ import annotations

import copy
import json
import sqlite3

import httpx
import pytest

OWNER = "owner-round16-token-0123456789"
H = {"Authorization": f"Bearer {OWNER}"}
JSON = {"content-type": "application/json"}


def _tables(db) -> dict:
    """Every row the service keeps of its data sets: what a refused request leaves as it was."""
    with sqlite3.connect(db) as c:
        return {t: sorted(map(repr, c.execute(f"SELECT * FROM {t}").fetchall()))
                for t in ("datasets", "shards", "workers", "lease_requests", "fence_floors")}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """One service for the refusals: data set d (4 shards, 2 epochs), worker w joined, one
    shard leased (request id r1)."""
    from stragglers.adapt.service import EmbeddedServer, ServiceConfig

    db = tmp_path_factory.mktemp("r16") / "s.db"
    # (no pause before a refusal's answer: hundreds of them here)
    quick = ServiceConfig(refusal_delay_s=0.0, auth_failure_delay_s=0.0)
    server = EmbeddedServer(db, durable=False, config=quick).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=H) as c:
            assert c.post("/datasets", json={"name": "d", "num_samples": 32, "shard_size": 8,
                                             "num_epochs": 2}).status_code == 200
            fence = c.post("/datasets/d/join", json={"worker": "w"}).json()["fence"]
            r = c.post("/datasets/d/lease", json={"worker": "w", "fence": fence,
                                                  "request_id": "r1"})
            assert r.status_code == 200, r.text
            yield server, db, fence, c
    finally:
        server.stop()


EDGES = [0, -1, 1 << 63, (1 << 63) - 1, 1 << 64, 1.0, 1.5, True, False, "1", None, [1], 1e308]
FIELDS = {   # path -> (a valid body, its numeric fields)
    "/datasets/d/lease": ({"worker": "w", "count": 1}, ("fence", "count")),
    "/datasets/d/ack": ({"worker": "w", "epoch": 0, "shard": 0, "consumed": 1},
                        ("fence", "epoch", "shard", "consumed")),
    "/datasets/d/release": ({"worker": "w", "failure": True}, ("fence", "failure")),
    "/datasets": ({"name": "n", "num_samples": 8, "shard_size": 8},
                  ("num_samples", "shard_size", "seed", "num_epochs", "lease_s",
                   "max_retries")),
}


def _valid(path: str, field: str, edge: object) -> bool:
    """Whether `edge` is a value `field` of `path` may take (those are not this test's)."""
    from stragglers.adapt import dataset as ds

    ranges = {"fence": (1, ds.MAX_FENCE), "count": (1, 256), "epoch": (0, ds.MAX_EPOCHS),
              "shard": (0, ds.MAX_SHARDS_PER_EPOCH), "consumed": (0, ds.MAX_SHARD_SIZE),
              "num_samples": (1, ds.MAX_SAMPLES), "shard_size": (1, ds.MAX_SHARD_SIZE),
              "seed": (0, ds.MAX_SEED), "num_epochs": (1, ds.MAX_EPOCHS),
              "lease_s": (ds.MIN_LEASE_S, ds.MAX_LEASE_S), "max_retries": (0, ds.MAX_RETRIES)}
    if field == "failure":
        return type(edge) is bool
    if edge is None:
        # (no end of epochs; a launcher's release)
        return field == "num_epochs" or (field == "fence" and path.endswith("release"))
    number = (int, float) if field == "lease_s" else (int,)
    lo, hi = ranges[field]
    return type(edge) in number and lo <= edge <= hi   # type(): a bool is no integer


FENCE = object()   # (the fence w was handed: its value is known once the service runs)


def _cases(path: str):
    body, fields = FIELDS[path]
    for field in fields:
        for edge in EDGES:
            if not _valid(path, field, edge):
                yield {**body, "fence": FENCE, field: edge} if "fence" in fields else \
                    {**body, field: edge}


@pytest.mark.parametrize("path", list(FIELDS))
def test_a_numeric_edge_in_any_field_is_refused_and_changes_nothing(served, path):
    """0, negatives, 2^63, 2^64, floats, bools as integers, strings, null, lists, 1e308 in
    every number of lease, ack, release and create: 400 naming the field, nothing stored."""
    server, db, fence, c = served
    before = _tables(db)
    for body in _cases(path):
        body = {k: fence if v is FENCE else v for k, v in body.items()}
        r = c.post(path, json=body)
        assert r.status_code == 400, (body, r.status_code, r.text[:200])
        assert r.json()["kind"] == "InputError" and r.json()["field"], r.text
    assert _tables(db) == before
    assert c.get("/health").status_code == 200


NAMES = ["é", "e\u0301", "\uff44", "d\u200b", "\u0130", "d\n", "d\r", "d ", "\u212a", "ß",
         "d\x00", ".", ".."]


def test_a_look_alike_name_is_refused_and_stores_nothing(served):
    """Unicode look-alikes and normalisation forms of names (composed and decomposed é, a
    full-width d, a zero-width space, a Turkish dotted İ, the Kelvin sign K, a trailing newline,
    NUL): 400 for a data set or worker name, nothing stored — no two spellings of one name."""
    server, db, fence, c = served
    before = _tables(db)
    for name, (path, body) in ((name, call) for name in NAMES for call in (
            ("/datasets", {"name": name, "num_samples": 8, "shard_size": 8}),
            ("/datasets/d/join", {"worker": name}),
            ("/datasets/d/lease", {"worker": name, "fence": fence}))):
        r = c.post(path, json=body)
        # a lease by '.' or '..' was 409 "has not joined" (the dots rule was the join's only)
        assert r.status_code == 400 and r.json()["field"], (path, name, r.text[:200])
    assert _tables(db) == before


def _restore_cases():
    def dup(s):
        s["shards"].append(s["shards"][0])

    def missing(s):
        s["shards"].pop()

    def done_partial(s):
        s["shards"][1][2:4] = ["DONE", 3]

    def todo_complete(s):
        s["shards"][1][2:4] = ["TODO", 8]

    def epoch_beyond(s):
        s["shards"][0][0] = 1

    def created_ahead(s):
        s["epochs_created"] = 2

    def created_past_the_end(s):
        s["epochs_created"] = 3

    def folded_past_created(s):
        s["folded_epochs"] = 2

    def retries_past(s):
        s["shards"][1][4] = 4

    def shard_beyond(s):
        s["shards"][0][1] = 4

    def bool_epoch(s):
        s["shards"][0][0] = False

    def float_consumed(s):
        s["shards"][0][3] = 0.0

    def other_name(s):
        s["dataset"]["name"] = "x"

    def other_config(s):
        s["dataset"]["shard_size"] = 4

    def state_lowercase(s):
        s["shards"][0][2] = "done"

    def extra_key(s):
        s["workers"] = []

    return [dup, missing, done_partial, todo_complete, epoch_beyond, created_ahead,
            created_past_the_end, folded_past_created, retries_past, shard_beyond, bool_epoch,
            float_consumed, other_name, other_config, state_lowercase, extra_key]


def test_an_inconsistent_restore_document_is_refused_and_changes_nothing(served):
    """Snapshots that are valid JSON but not a state the service can be in: a shard listed
    twice or not at all, a DONE shard partly consumed, a TODO one complete, rows of an epoch
    not created, epochs past the end, retries past the limit, bools and floats as integers,
    another data set's name or config, unknown keys: 4xx, the data set as it was."""
    server, db, fence, c = served
    snap = c.get("/datasets/d/snapshot").json()
    before = _tables(db)
    for spoil in _restore_cases():
        spoilt = copy.deepcopy(snap)
        spoil(spoilt)
        r = c.post("/datasets/d/restore", content=json.dumps(spoilt), headers=JSON)
        assert r.status_code in (400, 409), (spoil.__name__, r.text[:200])
    assert _tables(db) == before
    assert c.get("/datasets/d/snapshot").json() == snap


def test_a_replay_after_a_restore_gave_its_shard_to_another_worker_takes_nothing(tmp_path):
    """w leases shard 0 (request r1); a restore of the snapshot puts it back at the front;
    v leases it. w's replay of r1 answers it not held (no indices) and leaves v's lease as
    it was; w's ack of it is 409 and v's ack is 200."""
    from stragglers.adapt.service import EmbeddedServer

    db = tmp_path / "s.db"
    server = EmbeddedServer(db, durable=False).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=H) as c:
            assert c.post("/datasets", json={"name": "d", "num_samples": 32,
                                             "shard_size": 8}).status_code == 200
            fw = c.post("/datasets/d/join", json={"worker": "w"}).json()["fence"]
            fv = c.post("/datasets/d/join", json={"worker": "v"}).json()["fence"]
            first = c.post("/datasets/d/lease", json={"worker": "w", "fence": fw,
                                                      "request_id": "r1"}).json()
            shard = first["leases"][0]["shard"]
            snap = c.get("/datasets/d/snapshot").content
            r = c.post("/datasets/d/restore", content=snap, headers=JSON)
            assert r.status_code == 200 and r.json()["requeued_first"] == 1, r.text
            taken = c.post("/datasets/d/lease", json={"worker": "v", "fence": fv}).json()
            assert [x["shard"] for x in taken["leases"]] == [shard]
            before = _tables(db)["shards"]
            again = c.post("/datasets/d/lease", json={"worker": "w", "fence": fw,
                                                      "request_id": "r1"})
            assert again.status_code == 200, again.text
            assert [(x["shard"], x["indices"], x.get("held")) for x in again.json()["leases"]
                    ] == [(shard, [], False)]
            assert _tables(db)["shards"] == before
            ack = {"epoch": 0, "shard": shard, "consumed": 8}
            assert c.post("/datasets/d/ack", json={"worker": "w", "fence": fw, **ack}
                          ).status_code == 409
            assert c.post("/datasets/d/ack", json={"worker": "v", "fence": fv, **ack}
                          ).json()["state"] == "DONE"
    finally:
        server.stop()


def test_acks_across_data_sets_epochs_and_incarnations_change_nothing(tmp_path):
    """An ack of d's shard sent to data set e (w never joined e), of an epoch not created,
    with the fence of w's earlier incarnation after it joined again, and by a fenced-off name
    (a launcher released it): each refused, no row changed; the current incarnation's ack of
    the shard it leased then is 200."""
    from stragglers.adapt.service import EmbeddedServer

    db = tmp_path / "s.db"
    server = EmbeddedServer(db, durable=False).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=H) as c:
            for name in "de":
                assert c.post("/datasets", json={"name": name, "num_samples": 32,
                                                 "shard_size": 8}).status_code == 200
            old = c.post("/datasets/d/join", json={"worker": "w"}).json()["fence"]
            lease = c.post("/datasets/d/lease", json={"worker": "w", "fence": old}
                           ).json()["leases"][0]
            fence = c.post("/datasets/d/join", json={"worker": "w"}).json()["fence"]
            lease = c.post("/datasets/d/lease", json={"worker": "w", "fence": fence}
                           ).json()["leases"][0]
            assert c.post("/datasets/d/join", json={"worker": "x"}).status_code == 200
            assert c.post("/datasets/d/release", json={"worker": "x"}).status_code == 200
            ack = {"epoch": 0, "shard": lease["shard"], "consumed": 8}
            before = _tables(db)
            for path, body, status in (
                    ("/datasets/e/ack", {"worker": "w", "fence": fence, **ack}, 409),
                    ("/datasets/d/ack", {"worker": "w", "fence": fence, **ack, "epoch": 1},
                     400),
                    ("/datasets/d/ack", {"worker": "w", "fence": old, **ack}, 409),
                    ("/datasets/d/ack", {"worker": "x", "fence": 1, **ack}, 409),
                    ("/datasets/d/ack", {"worker": "x", "fence": 2, **ack}, 409)):
                r = c.post(path, json=body)
                assert r.status_code == status, (path, body, r.text[:200])
                assert _tables(db) == before, (path, body)
            r = c.post("/datasets/d/ack", json={"worker": "w", "fence": fence, **ack})
            assert r.json()["state"] == "DONE", r.text
    finally:
        server.stop()


def test_a_store_locked_by_another_process_at_start_is_served_once_let_go(tmp_path):
    """Another process (a backup, an operator's sqlite3) holds the file's write lock while the
    service starts: it starts, /health answers, a write waits its busy timeout and is 503
    with nothing written; once the lock is let go, the same write is served."""
    from stragglers.adapt.service import EmbeddedServer, ServiceConfig
    from stragglers.adapt.shards import ShardStore

    db = tmp_path / "s.db"
    ShardStore(db).close()
    lock = sqlite3.connect(db, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    server = None
    try:
        server = EmbeddedServer(db, durable=False,
                                config=ServiceConfig(busy_timeout_s=0.05)).start()
        with httpx.Client(base_url=server.url, timeout=60, headers=H) as c:
            assert c.get("/health").status_code == 200
            body = {"name": "d", "num_samples": 32, "shard_size": 8}
            r = c.post("/datasets", json=body)
            assert r.status_code == 503, r.text[:200]
            lock.execute("ROLLBACK")
            assert _tables(db)["datasets"] == []
            r = c.post("/datasets", json=body)
            assert r.status_code == 200, r.text[:200]
    finally:
        if lock.in_transaction:
            lock.execute("ROLLBACK")
        lock.close()
        if server is not None:
            server.stop()


def test_a_damaged_page_of_the_file_is_refused_503_never_a_500(tmp_path):
    """The root page of the shards table overwritten with zeros while no service ran (a torn
    write, a bad disk block): the service starts and answers /health; every call that reads
    the damaged rows — status, snapshot, a lease (its data set's rows checked at its first
    call, on the reader thread) — is a 503 naming the file as damaged, never a 500; the
    service stops and starts again. (Before: 500 InternalError, and the reader's connection
    left inside the failed read's transaction.)"""
    from stragglers.adapt.dataset import DatasetConfig
    from stragglers.adapt.service import EmbeddedServer
    from stragglers.adapt.shards import ShardStore

    db = tmp_path / "s.db"
    s = ShardStore(db)
    s.create_dataset(DatasetConfig("d", 8192, 8))
    fence = s.join("d", "w").fence
    s.close()
    with sqlite3.connect(db) as c:
        page = c.execute("PRAGMA page_size").fetchone()[0]
        root = c.execute("SELECT rootpage FROM sqlite_master WHERE name='shards'").fetchone()[0]
    with open(db, "r+b") as f:
        f.seek((root - 1) * page)
        f.write(bytes(page))
    for _ in range(2):   # (and after a restart)
        server = EmbeddedServer(db, durable=False).start()
        try:
            with httpx.Client(base_url=server.url, timeout=60, headers=H) as c:
                assert c.get("/health").status_code == 200
                for method, path, body in (
                        ("GET", "/datasets/d/status", None), ("GET", "/datasets/d/snapshot", None),
                        ("POST", "/datasets/d/lease", {"worker": "w", "fence": fence}),
                        ("GET", "/datasets/d/status", None)):
                    r = c.request(method, path, json=body)
                    assert r.status_code == 503, (path, r.status_code, r.text[:200])
                    assert "damaged" in r.json()["error"], r.text[:200]
                assert c.get("/health").status_code == 200
        finally:
            server.stop()


def test_a_damaged_page_of_one_data_set_fails_only_its_own_call_in_a_batch(tmp_path):
    """A leaf page holding a row of data set d (found by an error text written into it)
    overwritten with zeros; a group commit of e's lease, d's lease (its row on that page) and
    another worker's lease of e: d's is refused alone (its error, to be answered 503), both
    of e's are committed. (Before: SQLite ended the batch's transaction at d's call, and every
    call batched with it was 503 'transaction failed, nothing of it was committed': a probe
    hammering d beside a job leasing e saw 9 of e's 150 leases and 2 of its acks refused.)"""
    from stragglers.adapt.dataset import DatasetConfig
    from stragglers.adapt.service import GroupCommitter
    from stragglers.adapt.shards import ShardStore

    db = tmp_path / "s.db"
    marker = b"round16-damaged-page-marker"
    s = ShardStore(db)
    s.create_dataset(DatasetConfig("d", 8192, 8))
    s.create_dataset(DatasetConfig("e", 4096, 8))
    fd = s.join("d", "w").fence
    fe, fv = s.join("e", "w").fence, s.join("e", "v").fence
    s.lease("d", "w", fd)
    s.release("d", "w", fd, error=marker.decode())   # (d's shard 0: next to lease, marked)
    s.close()
    data = db.read_bytes()
    assert data.count(marker) == 1
    with sqlite3.connect(db) as c:
        page = c.execute("PRAGMA page_size").fetchone()[0]
    at = data.index(marker) // page * page
    with open(db, "r+b") as f:
        f.seek(at)
        f.write(bytes(page))
    store = ShardStore(db)
    commit = GroupCommitter(store)
    try:
        results = commit._run_batch([lambda: store.lease("e", "w", fe),
                                     lambda: store.lease("d", "w", fd),
                                     lambda: store.lease("e", "v", fv)])
        assert [ok for ok, _ in results] == [True, False, True], results
        assert isinstance(results[1][1], sqlite3.DatabaseError), results[1]
        assert [len(r.leases) for ok, r in results if ok] == [1, 1]
    finally:
        commit.close()
        store.close()
    with sqlite3.connect(db) as c:   # (committed: both of e's leases are held)
        assert c.execute("SELECT worker FROM shards WHERE dataset='e' AND state='DOING'"
                         " ORDER BY worker").fetchall() == [("v",), ("w",)]
