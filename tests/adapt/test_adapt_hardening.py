"""The shard service under load and abuse (issue 34): real servers on loopback, real SQLite.

Each test pins a mechanism, not a timing: heavy reads and shuffles run off the commit thread
(they are answered while the writer is held), restores are refused before their body is read,
one token cannot take every slot, a replayed request id never leases a new shard, a damaged
stored row quarantines its data set only, and every error is the service's JSON shape.
(Lease latency under these loads, against a quiet run: benchmarks/adapt_dos.py.)
"""

from __future__ import annotations

import hashlib
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.replies import LeaseReply
from stragglers.adapt.service import EmbeddedServer, ServiceConfig

OWNER, STRANGER = "owner-token-0123456789", "stranger-token-0123456789"
SERVICE = "service-token-0123456789"


def bearer(token: str, service: bool = False) -> dict:
    headers = {"Authorization": f"Bearer {token}"}
    if service:
        headers["X-Service-Token"] = SERVICE
    return headers


def error_shape(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error", "kind", "field"}, body
    return body


@pytest.fixture
def server(tmp_path):
    srv = EmbeddedServer(tmp_path / "shards.db").start()
    yield srv
    srv.stop()


def head_only(url: str, path: str, headers: dict, length: int = 60_000_000) -> str:
    """Send a request head announcing `length` body bytes and none of them: the status line."""
    host, port = url.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection((host, int(port)), timeout=60) as k:
        k.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                  f"\r\n{head}Content-Length: {length}\r\n\r\n".encode())
        return k.recv(4096).decode(errors="replace").split("\r\n", 1)[0]


# -- heavy reads off the commit thread ----------------------------------------------------------
@pytest.mark.slow
def test_snapshot_and_status_are_answered_while_the_writer_is_held(server):
    # The writer (the store's lock, the commit thread's transaction) is held by this test: a
    # snapshot or status that ran on the commit thread would wait for it (a 655k-row snapshot
    # asked five times stalled every other job's leases to 2.7 s).
    client = ShardClient(server.url, "d", "w", token=OWNER)
    client.create_dataset(DatasetConfig("d", 1000, 10))
    client.join()
    client.lease()
    store, commit = server.app.state.store, server.app.state.commit
    calls = commit.calls
    with store._lock:
        snap = httpx.get(f"{server.url}/datasets/d/snapshot", timeout=30)
        status = httpx.get(f"{server.url}/datasets/d/status", timeout=30)
        for op in ("status", "snapshot"):   # unknown names too: 404 from the reader
            assert httpx.get(f"{server.url}/datasets/nope/{op}", timeout=30).status_code == 404
    assert snap.status_code == 200 and len(snap.json()["shards"]) == 100
    assert status.status_code == 200 and status.json()["epochs"]["0"]["DOING"] == 1
    assert commit.calls == calls, "a read went through the commit thread"
    assert server.app.state.reader.threads_used and all(
        t.startswith("shard-reads") for t in server.app.state.reader.threads_used)


def test_snapshot_is_answered_while_another_process_holds_the_write_lock(server, tmp_path):
    client = ShardClient(server.url, "d", "w", token=OWNER)
    client.create_dataset(DatasetConfig("d", 100, 10))
    lock = sqlite3.connect(tmp_path / "shards.db", isolation_level=None)
    lock.execute("BEGIN IMMEDIATE")   # WAL: readers go on while a writer holds the file
    try:
        assert httpx.get(f"{server.url}/datasets/d/snapshot", timeout=30).status_code == 200
    finally:
        lock.execute("ROLLBACK")
        lock.close()


def test_a_repeated_snapshot_is_built_once_and_never_stale(server):
    client = ShardClient(server.url, "d", "w", token=OWNER)
    client.create_dataset(DatasetConfig("d", 100, 10))
    client.join()
    lease = client.lease().leases[0]
    reader = server.app.state.reader
    first = [httpx.get(f"{server.url}/datasets/d/snapshot").json() for _ in range(5)]
    assert reader.computed == 1 and all(s == first[0] for s in first)
    client.ack(lease.epoch, lease.shard, 7)   # acknowledged: the next snapshot has it
    row = next(r for r in client.snapshot().shards if r[1] == lease.shard)
    assert row[2:4] == ("DOING", 7) and reader.computed == 2


def test_queued_reads_are_bounded(tmp_path):
    srv = EmbeddedServer(tmp_path / "s.db", config=ServiceConfig(max_queued_reads=1)).start()
    try:
        client = ShardClient(srv.url, "d", "w", token=OWNER)
        client.create_dataset(DatasetConfig("d", 100, 10))
        release = threading.Event()
        reader = srv.app.state.reader
        blocker = reader.submit(lambda conn: release.wait(60))
        with ThreadPoolExecutor(1) as pool:
            try:
                # (round 13: a caller with none queued gets a place past the bound; its next
                # read, past its share, is refused)
                first = pool.submit(httpx.get, f"{srv.url}/datasets/d/status", timeout=60)
                deadline = time.monotonic() + 60
                while reader._queued < 2 and not first.done():
                    assert time.monotonic() < deadline, "the first status GET never queued"
                    time.sleep(0.005)
                resp = httpx.get(f"{srv.url}/datasets/d/status", timeout=30)
                assert resp.status_code == 503 and error_shape(resp)["kind"] == "Busy"
            finally:
                release.set()
                blocker.result(timeout=60)
            assert first.result(60).status_code == 200
        assert httpx.get(f"{srv.url}/datasets/d/status").status_code == 200
    finally:
        srv.stop()


def test_a_big_shuffle_runs_off_the_commit_thread_and_other_jobs_lease_meanwhile(server, monkeypatch):
    # A shuffle of 2**21 samples (over BIG_SHUFFLE) runs on a shuffle thread; the commit
    # thread goes on leasing other data sets' shards meanwhile. The shuffle is held at its
    # start until the small job's lease is answered, so the verdict does not depend on how
    # long a shuffle takes on a loaded machine (2**26 samples outran a 120 s bound at load 30).
    from stragglers.adapt import permutations as permutations_module
    n = 1 << 21
    started, release = threading.Event(), threading.Event()
    real = permutations_module.epoch_permutation

    def held(num_samples, seed, epoch):
        if num_samples == n:
            started.set()
            assert release.wait(120), "the test never let the shuffle go"
        return real(num_samples, seed, epoch)

    monkeypatch.setattr(permutations_module, "epoch_permutation", held)
    big = ShardClient(server.url, "big", "w", token=OWNER, timeout_s=120)
    big.create_dataset(DatasetConfig("big", n, 1024))
    big.join()
    small = ShardClient(server.url, "small", "w", token=STRANGER)
    small.create_dataset(DatasetConfig("small", 100, 10))
    small.join()
    small.lease()   # its own shuffle done
    perms = server.app.state.store.permutations
    result: list[LeaseReply] = []
    worker = threading.Thread(target=lambda: result.append(big.lease()))
    worker.start()
    try:
        assert started.wait(60), "the big shuffle never started"
        got = small.lease()
        assert got.status == "ok" and (n, 0, 0) in perms._running, \
            "the small job's lease waited for the big shuffle"
    finally:
        release.set()
    worker.join(timeout=120)
    assert len(result[0].leases[0].indices) == 1024
    assert perms.threads and all(t.startswith("shard-shuffles") for t in perms.threads)


# -- restores: ownership before the body, bounded ---------------------------------------------
@pytest.mark.slow
def test_a_restore_is_refused_before_its_body_is_read(tmp_path):
    srv = EmbeddedServer(tmp_path / "s.db", service_token=SERVICE).start()
    try:
        owner = ShardClient(srv.url, "d", "w", token=OWNER, service_token=SERVICE)
        owner.create_dataset(DatasetConfig("d", 100, 10))
        # a stranger's token on an existing data set: 403 from the head alone (the 60 MB
        # body is never sent; it used to be read and parsed, +1.15 GB, before the check)
        assert head_only(srv.url, "/datasets/d/restore", bearer(STRANGER)).startswith(
            "HTTP/1.1 403")
        # creating by restore without the service token: 403, body unread
        assert head_only(srv.url, "/datasets/new/restore", bearer(OWNER)).startswith(
            "HTTP/1.1 403")
        # the owner past max_restore_bytes: 413 from the declared length
        assert head_only(srv.url, "/datasets/d/restore", bearer(OWNER),
                         length=(1 << 26) + 1).startswith("HTTP/1.1 413")
        assert httpx.get(f"{srv.url}/health").status_code == 200
        assert owner.restore(owner.snapshot()).restored == 10
    finally:
        srv.stop()


# -- quotas -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_one_token_cannot_take_every_controller_or_data_set_slot(tmp_path):
    config = ServiceConfig(max_jobs_per_token=3, max_datasets_per_token=2)
    srv = EmbeddedServer(tmp_path / "s.db", config=config).start()   # no service token
    cfg = {"policy": "nd", "world_size": 2, "global_batch": 64}
    try:
        for i in range(3):
            r = httpx.post(f"{srv.url}/jobs/j{i}/control/config", json=cfg,
                           headers=bearer(OWNER))
            assert r.status_code == 200, r.text
        r = httpx.post(f"{srv.url}/jobs/j3/control/config", json=cfg, headers=bearer(OWNER))
        assert r.status_code == 429 and error_shape(r)["kind"] == "QuotaExceeded"
        assert "max_jobs_per_token" in r.json()["error"]
        assert httpx.post(f"{srv.url}/jobs/j3/control/config", json=cfg,
                          headers=bearer(STRANGER)).status_code == 200
        # a job's own later incarnation is no new slot
        assert httpx.post(f"{srv.url}/jobs/j0/control/config", json={**cfg, "incarnation": 1},
                          headers=bearer(OWNER)).status_code == 200
        for name in ("a", "b"):
            r = httpx.post(f"{srv.url}/datasets", json={"name": name, "num_samples": 10,
                                                         "shard_size": 1}, headers=bearer(OWNER))
            assert r.status_code == 200, r.text
        r = httpx.post(f"{srv.url}/datasets", json={"name": "c", "num_samples": 10,
                                                     "shard_size": 1}, headers=bearer(OWNER))
        assert r.status_code == 429 and "max_datasets_per_token" in error_shape(r)["error"]
        # the same data set again is no new one
        assert httpx.post(f"{srv.url}/datasets", json={"name": "a", "num_samples": 10,
                                                        "shard_size": 1},
                          headers=bearer(OWNER)).json() == {"created": False}
        with sqlite3.connect(tmp_path / "s.db") as c:
            assert c.execute("SELECT COUNT(*) FROM datasets").fetchone()[0] == 2
    finally:
        srv.stop()


# -- replayed lease requests ----------------------------------------------------------------------
@pytest.mark.slow
def test_replayed_request_ids_never_lease_a_new_shard(server):
    client = ShardClient(server.url, "d", "w", token=OWNER)
    client.create_dataset(DatasetConfig("d", 100, 10, max_retries=0))
    fence = client.join()
    url, headers = f"{server.url}/datasets/d/lease", bearer(OWNER)

    def lease(rid: str) -> dict:
        r = httpx.post(url, json={"worker": "w", "fence": fence, "request_id": rid},
                       headers=headers)
        assert r.status_code == 200, r.text
        return r.json()

    first = [lease(f"req-{i}") for i in range(4)]
    held = [r["leases"][0] for r in first]
    client.ack(0, held[0]["shard"], 10)          # the first one is done
    # replay an older request, the last one, and the acked one, several times each
    for _ in range(3):
        assert lease("req-1") == first[1]
        assert lease("req-3") == first[3]
        done = lease("req-0")["leases"]
        assert done == [{**held[0], "offset": 10, "indices": [], "held": False}]
    status = client.status()
    assert status.epochs["0"]["DOING"] == 3 and status.epochs["0"]["DONE"] == 1
    assert status.epochs["0"]["TODO"] == 6 and status.failed == []
    with sqlite3.connect(server.db) as c:
        assert c.execute("SELECT MAX(retries) FROM shards").fetchone()[0] == 0


# -- damaged stored rows ------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("damage", [
    "UPDATE datasets SET num_samples='many' WHERE name='bad'",
    "UPDATE datasets SET lease_s=-1 WHERE name='bad'",
    "UPDATE datasets SET token_sha256=42 WHERE name='bad'",
    "UPDATE shards SET start='x' WHERE dataset='bad'",
    "UPDATE shards SET consumed=999 WHERE dataset='bad'",
    "UPDATE shards SET state='BOGUS' WHERE dataset='bad'",
    "UPDATE shards SET retries='r' WHERE dataset='bad'",
    "DELETE FROM shards WHERE dataset='bad' AND shard=3",
    "UPDATE workers SET fence='f' WHERE dataset='bad'",
])
def test_a_damaged_row_quarantines_its_data_set_not_the_service(tmp_path, damage):
    db = tmp_path / "s.db"
    srv = EmbeddedServer(db).start()
    try:
        clients = {}
        for name in ("bad", "good"):
            c = clients[name] = ShardClient(srv.url, name, "w", token=OWNER, retry_s=5)
            # the good data set's lease outlives the checks below (a 50 ms one could expire
            # between its lease and the status call on a loaded machine)
            c.create_dataset(DatasetConfig(name, 100, 10, lease_s=0.05 if name == "bad" else 60))
            c.join()
        with sqlite3.connect(db) as c:
            c.execute(damage)
        before = dump(db)
        calls = [("POST", "lease", {"worker": "w", "fence": 1}),
                 ("POST", "ack", {"worker": "w", "fence": 1, "epoch": 0, "shard": 0,
                                  "consumed": 1}),
                 ("POST", "release", {"worker": "w", "fence": 1}),
                 ("POST", "join", {"worker": "w2"}),
                 ("POST", "retry-failed", {}),
                 ("GET", "status", None), ("GET", "snapshot", None)]
        statuses = []
        for method, op, body in calls:
            r = httpx.request(method, f"{srv.url}/datasets/bad/{op}", json=body,
                              headers=bearer(OWNER), timeout=30)
            statuses.append(r.status_code)
            if r.status_code >= 400:
                error_shape(r)
        assert 503 in statuses and 500 not in statuses, statuses
        quarantined = httpx.get(f"{srv.url}/datasets/bad/snapshot")
        assert quarantined.status_code == 503
        assert error_shape(quarantined)["kind"] == "Quarantined"
        assert "'bad'" in quarantined.json()["error"]
        assert dump(db)["bad"] == before["bad"], "a quarantined data set was changed"
        good = clients["good"]
        assert good.lease().status == "ok" and good.status().epochs["0"]["DOING"] == 1
        assert httpx.get(f"{srv.url}/health").status_code == 200
    finally:
        srv.stop()
    again = EmbeddedServer(db).start()   # restartable with the damaged row in the file
    try:
        assert httpx.get(f"{again.url}/datasets/good/status").status_code == 200
        assert httpx.get(f"{again.url}/datasets/bad/status").status_code == 503
    finally:
        again.stop()


def dump(db) -> dict:
    with sqlite3.connect(db) as c:
        return {name: [c.execute(f"SELECT * FROM {t} WHERE {k}=? ORDER BY 1, 2, 3",
                                 (name,)).fetchall()
                       for t, k in (("datasets", "name"), ("shards", "dataset"),
                                    ("workers", "dataset"))]
                for name in ("bad", "good")}


# -- error bodies -------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("method,path,status", [
    ("GET", "/nope", 404), ("GET", "/datasets/d/status/", 404), ("POST", "/health", 405),
    ("GET", "/datasets/d/lease", 405), ("DELETE", "/datasets/d", 401),
    ("PUT", "/datasets/d/restore", 405), ("GET", "/datasets/zz/snapshot", 404),
    ("GET", "/jobs/zz/control/state", 404),
])
def test_every_error_is_the_services_json_shape(server, method, path, status):
    resp = httpx.request(method, server.url + path, timeout=30)
    assert resp.status_code == status, resp.text
    error_shape(resp)


# -- the command line -----------------------------------------------------------------------------
@pytest.mark.slow
def test_a_missing_token_file_says_how_to_create_it(tmp_path):
    token = tmp_path / "token"
    run = subprocess.run([sys.executable, "-m", "stragglers.cli", "adapt", "serve", "--db",
                          str(tmp_path / "shards.db"), "--token-file", str(token)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "no such file" in run.stderr and "16-512" in run.stderr
    recipe = run.stderr.split("with: ", 1)[1].strip()
    subprocess.run(["bash", "-c", recipe], check=True, timeout=60)   # the advice works
    assert token.stat().st_mode & 0o077 == 0
    from stragglers.serving import read_token_file
    assert len(read_token_file(token)) >= 16
    helptext = subprocess.run([sys.executable, "-m", "stragglers.cli", "adapt", "serve",
                               "--help"], capture_output=True, text=True, timeout=120,
                              env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}).stdout
    assert "16-512" in helptext and "umask 077" in helptext


# -- reads paced, refusals slow and final --------------------------------------------------------
@pytest.mark.slow
def test_reads_past_their_rate_wait_their_turn_then_get_503(tmp_path):
    # Clients polling status/snapshot in a tight loop sleep instead of spinning the CPUs that
    # other jobs' leases need; past max_read_wait_s the answer is 503 Busy, not a longer queue.
    config = ServiceConfig(reads_per_s=1.0, max_read_wait_s=0.5)
    srv = EmbeddedServer(tmp_path / "s.db", config=config).start()
    try:
        ShardClient(srv.url, "d", "w", token=OWNER).create_dataset(DatasetConfig("d", 100, 10))
        # at once, not one after the other: on a loaded machine each call alone can take the
        # pacer's second, and then none of them would have to wait
        def at_once(what: str) -> list[httpx.Response]:
            with ThreadPoolExecutor(4) as pool:
                return list(pool.map(lambda _: httpx.get(f"{srv.url}/datasets/d/{what}",
                                                         timeout=30), range(4)))

        codes = sorted(r.status_code for r in at_once("status"))
        assert codes[0] == 200 and codes[-1] == 503, codes
        busy = [r for r in at_once("snapshot") if r.status_code != 200]
        assert busy and all(r.status_code == 503 and error_shape(r)["kind"] == "Busy"
                            for r in busy)
        # a job's own leases are not paced
        client = ShardClient(srv.url, "d", "w", token=OWNER)
        client.join()
        assert all(client.lease().status == "ok" for _ in range(5))
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_refused_token_is_answered_after_a_pause_and_the_connection_closed(server):
    ShardClient(server.url, "d", "w", token=OWNER).create_dataset(DatasetConfig("d", 100, 10))
    start = time.monotonic()
    resp = httpx.post(f"{server.url}/datasets/d/join", json={"worker": "x"},
                      headers=bearer(STRANGER))
    assert resp.status_code == 403 and time.monotonic() - start >= 0.25
    assert resp.headers["connection"] == "close" and error_shape(resp)["kind"] == "Forbidden"


@pytest.mark.slow
def test_a_stranger_polling_a_big_snapshot_in_training_does_not_make_it_rebuild(tmp_path):
    # 131,072 shard rows (4 MB of JSON): a caller without the owner's token may get the
    # snapshot up to stranger_snapshot_stale_s old; the owner (its checkpoints) always gets
    # the current one.
    from stragglers.adapt.shards import ShardStore

    db = tmp_path / "s.db"
    store = ShardStore(db)
    cfg = DatasetConfig("big", 65_536, 1, num_epochs=2)
    store.create_dataset(cfg, hashlib.sha256(OWNER.encode()).hexdigest())
    with store._tx() as c:
        store._write_rows(c, cfg, 0, 1024, 65_536)
        store._create_epoch(c, cfg, 1, full=True)
    store.close()
    srv = EmbeddedServer(db, config=ServiceConfig(stranger_snapshot_stale_s=600)).start()
    try:
        owner = ShardClient(srv.url, "big", "w", token=OWNER)
        owner.join()
        held = owner.lease().leases[0]
        reader = srv.app.state.reader
        first = httpx.get(f"{srv.url}/datasets/big/snapshot", timeout=120)
        assert first.status_code == 200 and len(first.content) >= 2 << 20
        owner.ack(held.epoch, held.shard, 1)   # DONE: the data set changed
        again = httpx.get(f"{srv.url}/datasets/big/snapshot", timeout=120)
        assert again.content == first.content and reader.computed == 1
        fresh = owner.snapshot().shards
        assert fresh[held.shard][2] == "DONE" and reader.computed == 2
    finally:
        srv.stop()


def test_every_write_route_refuses_a_query_string_and_does_nothing(tmp_path):
    """Every route of a method other than GET (POST and DELETE now; any later one too), sent
    with a query string by the owner, is 400 naming `query`, nothing done (only POST was
    checked: `DELETE /datasets/d?dry_run=1` deleted d)."""
    server = EmbeddedServer(tmp_path / "shards.db",
                            config=ServiceConfig(refusal_delay_s=0.0)).start()
    try:
        _no_write_takes_a_query(server)
    finally:
        server.stop()


def _no_write_takes_a_query(server: EmbeddedServer) -> None:
    owner = ShardClient(server.url, "d", "w", token=OWNER)
    owner.create_dataset(DatasetConfig("d", 40, 10))
    owner.join()
    before = sqlite3.connect(server.db).execute("SELECT COUNT(*) FROM datasets").fetchone()
    writes = [(method, route.path) for route in server.app.app.routes
              for method in sorted(route.methods or ()) if method not in ("GET", "HEAD")]
    assert ("DELETE", "/datasets/{name}") in writes and len(writes) >= 10
    with httpx.Client(base_url=server.url, headers=bearer(OWNER), timeout=60) as c:
        for method, path in writes:
            target = path.replace("{name}", "d").replace("{job}", "d") + "?dry_run=1"
            r = c.request(method, target, json={})
            assert r.status_code == 400 and error_shape(r)["field"] == "query", (method, path,
                                                                               r.text)
        assert c.get("/datasets/d/status").status_code == 200
    after = sqlite3.connect(server.db).execute("SELECT COUNT(*) FROM datasets").fetchone()
    assert after == before
