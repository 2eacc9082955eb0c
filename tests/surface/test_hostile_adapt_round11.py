"""Red team round eleven (issue 34): the shard service's new code of session 48 (fence floors
kept past a delete and the store floor '*', EXPIRED places, the per-token index pace, restores
keeping request ids, schema 6), its shuffle threads, write refusals and the job token file,
against damaged rows, kill -9 and other tokens' load.

Each test is one defect, marked xfail(strict=True) until its fix lands (then the mark goes): a
pass before the fix fails the suite. Real servers on loopback (the shard service on a thread of
this process, as tests/adapt's hostile tests start it), real SQLite, real processes killed.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time

import httpx
import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "tests" / "adapt"))
from adapt_jobs import two_workers  # noqa: E402

OWNER = {"Authorization": "Bearer owner-round11-token-0123456789"}


def _served(db):
    from stragglers.adapt.service import EmbeddedServer

    return EmbeddedServer(db).start()


def _client(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60, headers=OWNER)


def test_a_damaged_store_fence_floor_quarantines_no_data_set_it_does_not_belong_to(tmp_path):
    """The store floor (fence_floors row '*', the folded floors of the oldest deleted names)
    belongs to no data set, yet every data set's new worker name reads it: damaged (a text
    value, as another process or a disk error leaves it), a new name's join to data set b —
    whose own rows are sound — is 503 `Quarantined` ("data set 'b' is quarantined ... other
    data sets are not affected"), and so is every new name of every data set, a data set
    created afterwards included. The DELETE the message prescribes does not help: c deleted
    and created again, its first join is 503 again. One row stops every new worker of the
    service; a damaged row must quarantine one data set (or be repaired), not the service."""
    db = tmp_path / "s.db"
    server = _served(db)
    try:
        with _client(server) as c:
            for name in ("a", "b"):
                r = c.post("/datasets", json={"name": name, "num_samples": 8, "shard_size": 2})
                assert r.status_code == 200, r.text
                assert c.post(f"/datasets/{name}/join", json={"worker": "w"}).status_code == 200
    finally:
        server.stop()
    with sqlite3.connect(db) as conn:
        conn.execute("INSERT INTO fence_floors VALUES ('*', 'x')")
    server = _served(db)
    try:
        with _client(server) as c:
            r = c.post("/datasets", json={"name": "c", "num_samples": 8, "shard_size": 2})
            assert r.status_code == 200, r.text
            c.delete("/datasets/c")   # (the repair the error prescribes)
            r = c.post("/datasets", json={"name": "c", "num_samples": 8, "shard_size": 2})
            assert r.status_code == 200, r.text
            joins = {n: c.post(f"/datasets/{n}/join", json={"worker": "v"}) for n in "bc"}
            refused = {n: (r.status_code, r.json()["kind"]) for n, r in joins.items()
                       if r.status_code != 200}
            assert not refused, f"new workers of sound data sets refused: {refused}"
    finally:
        server.stop()


_KILLED_MID_UPGRADE = r'''
import os, signal, sqlite3, sys
real = sqlite3.connect
def connect(*args, **kwargs):
    conn = real(*args, **kwargs)
    def trace(sql):   # (the upgrade's columns are added; its next statement is not run)
        if "CREATE TABLE IF NOT EXISTS datasets" in sql:
            os.kill(os.getpid(), signal.SIGKILL)
    conn.set_trace_callback(trace)
    return conn
sqlite3.connect = connect
from stragglers.adapt.shards import ShardStore
ShardStore(sys.argv[1])
'''


def test_a_service_killed_while_upgrading_an_old_file_starts_again_on_it(tmp_path):
    """A schema-3 file (an earlier release's) with an acked lease. The new release opens it and
    is killed -9 (a deploy, the OOM killer) while upgrading it: schema.open_database runs the
    upgrade as separate autocommitted scripts (ALTER TABLE ... ADD COLUMN rows_key, creator),
    then the new tables, and sets user_version last. Killed after the columns were added, the
    file still says version 3, and every later start runs the ALTER again: 'not a usable SQLite
    database (duplicate column name: rows_key)'. The job's acknowledged progress is in the file
    and no version of the service opens it again. An upgrade is one transaction, or each step
    safe to run again."""
    from stragglers.adapt.dataset import DatasetConfig
    from stragglers.adapt.shards import ShardStore
    from stragglers.errors import InputError

    db = tmp_path / "old.db"
    s = ShardStore(db)
    s.create_dataset(DatasetConfig("d", 100, 10))
    f = s.join("d", "w").fence
    held = s.lease("d", "w", f, request_id="r1").leases[0]
    s.ack("d", "w", f, held.epoch, held.shard, 5)
    s.close()
    with sqlite3.connect(db) as conn:   # the schema-3 layout (as test_adapt_shards makes it)
        conn.executescript("DROP TABLE row_sets; DROP TABLE fence_floors;"
                           " DROP INDEX datasets_creator; ALTER TABLE datasets DROP COLUMN"
                           " rows_key; ALTER TABLE datasets DROP COLUMN creator;"
                           " PRAGMA user_version=3;")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO / "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    child = subprocess.run([sys.executable, "-c", _KILLED_MID_UPGRADE, str(db)], env=env,
                           capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr   # (killed mid-upgrade)
    try:
        s = ShardStore(db)
    except InputError as exc:
        raise AssertionError(f"the file no longer opens after the kill: {exc}") from None
    try:
        assert s.status("d").epochs["0"]["DOING"] == 1
    finally:
        s.close()


def _writer_in_batch() -> bool:
    """True while the service's commit thread is inside a batch's transaction (run_batch)."""
    import traceback

    return any(f.name == "run_batch" for frame in sys._current_frames().values()
               for f in traceback.extract_stack(frame))


def test_a_jobs_second_big_lease_is_not_refused_for_indices_the_first_cannot_send(tmp_path):
    """One job (one token), two workers, a data set of 65,536-sample shards. A lease reserves
    `count` x `shard_size` indices of its token's lease_indices_per_token_s (2^21 a second)
    until it is committed — but a reply holds at most MAX_INDICES_PER_REPLY (262,144: four such
    shards), so a lease of count 256 (the protocol's most) reserves 16.7M indices, 8 s of the
    pace, for 1/8 s it can send. While worker a's lease is in flight (its commit waits on the
    file's lock, held here by another process: deterministic), worker b's lease of the same
    job is 429 `RateLimited` at once, before anything is leased: together they can send
    524,288 indices, a quarter of one second's worth. (A herd of the job's workers leasing
    together is refused the same way, 64x sooner than the pace says.) The reservation is at
    most what the reply can send."""
    from stragglers.adapt.service import EmbeddedServer, ServiceConfig

    db = tmp_path / "s.db"
    server = EmbeddedServer(db, config=ServiceConfig(busy_timeout_s=2.5)).start()
    lock = None
    try:
        with _client(server) as c, _client(server) as c2:
            r = c.post("/datasets", json={"name": "d", "num_samples": 1 << 22,
                                          "shard_size": 65_536})
            assert r.status_code == 200, r.text
            fences = {w: c.post("/datasets/d/join", json={"worker": w}).json()["fence"]
                      for w in "ab"}
            # (the epoch shuffled, the shard size known: what a running job has)
            r = c.post("/datasets/d/lease", json={"worker": "b", "fence": fences["b"]})
            assert r.status_code == 200, r.text
            lock = sqlite3.connect(db, isolation_level=None)
            lock.execute("BEGIN IMMEDIATE")
            out: dict = {}
            body = {"count": 256, "request_id": "r"}
            threads = [threading.Thread(target=lambda w=w, cl=cl: out.setdefault(w, cl.post(
                "/datasets/d/lease", json={"worker": w, "fence": fences[w], **body})))
                for w, cl in (("a", c), ("b", c2))]
            threads[0].start()
            deadline = time.monotonic() + 60
            while not _writer_in_batch():   # a's lease admitted and at the commit
                assert time.monotonic() < deadline, "a's lease never reached the commit"
                time.sleep(0.01)
            threads[1].start()
            threads[1].join(60)   # (b refused at once, or waiting on the lock like a)
            lock.execute("ROLLBACK")
            threads[0].join(60)
            b = out["b"]
            assert b.status_code != 429, f"b's lease refused beside a's: {b.text}"
    finally:
        if lock is not None:
            lock.close()
        server.stop()


def test_a_worker_that_replays_its_lease_after_an_expiry_keeps_its_place(tmp_path):
    """max_workers_per_dataset 2: workers a and b. a leases shard 0 (request r1) and its reply
    is lost; its lease expires while its client retries (an outage of the network, a GC
    pause), and b's next lease requeues it, marking a EXPIRED. a's retry of r1 arrives: the
    replay answers shard 0 `held: false` — a is alive and calling. The schema's rule: "a lease
    of it (whatever its answer) ... clears that" mark, and the README: a name gives its place
    only if it "asked for no lease at all" since the expiry. But a replay returns before the
    mark is cleared (shards.lease -> _replay): a new name c joins in a's place (a's row and
    history deleted), and a's next lease is 409 `Fenced` ("has not joined"): a live worker
    killed by another's join. (The store on a clock of its own: expiry is an interleaving.)"""
    from stragglers.adapt.dataset import DatasetConfig
    from stragglers.adapt.errors import Fenced, QuotaExceeded
    from stragglers.adapt.service import token_digest

    owner = token_digest(OWNER["Authorization"].split()[1])
    with two_workers(tmp_path / "s.db", DatasetConfig("d", 16, 4, lease_s=10), owner) as (
            store, now, a, b):
        first = store.lease("d", "a", a, request_id="r1", token_sha256=owner)
        assert [x.shard for x in first.leases] == [0]
        now[0] += 11
        store.lease("d", "b", b, request_id="b1", token_sha256=owner)   # requeues a's lease
        again = store.lease("d", "a", a, request_id="r1", token_sha256=owner)   # a's retry
        assert [(x.shard, x.held) for x in again.leases] == [(0, False)], again
        try:
            store.join("d", "c", owner)
        except QuotaExceeded:
            pass   # (a, which called, keeps its place)
        try:
            store.lease("d", "a", a, request_id="r2", token_sha256=owner)
        except Fenced as exc:
            raise AssertionError(f"a, alive and calling, lost its place to c: {exc}") from None


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="needs root to give the file to another user")
def test_a_job_token_file_owned_by_another_user_is_refused(tmp_path):
    """The embedded service's job token (launch.read_or_create_token: workdir/job.token, made
    0600 when missing) is read by the service token file's rules: a regular file, its first
    line, no group or other permission bits. Its owner is not checked: a file planted by
    another local user where the job's workdir will be (a shared scratch directory, a
    world-writable parent), mode 0600, owned by that user, is read by a job running as root
    and its token used — the planter, who knows it, may then lease, ack, restore and DELETE
    the job's data sets. A token file must be owned by the user reading it (as OpenSSH
    requires of its keys), else refused naming the file and its owner."""
    from stragglers.adapt.launch import read_or_create_token
    from stragglers.errors import InputError

    planted = tmp_path / "job.token"
    planted.write_text("planted-by-another-user-0123456789\n")
    planted.chmod(0o600)
    os.chown(planted, 65534, 65534)   # (nobody: another user than the one reading it)
    try:
        token = read_or_create_token(planted)
    except InputError:
        return
    raise AssertionError(f"a token file of uid 65534 read by uid 0: {token!r} used")


def test_a_delete_with_a_query_string_is_refused_and_deletes_nothing(tmp_path):
    """The README: "a write with a query string is 400 `query`, nothing done: its fields are
    the body's" (`?fence=99` beside a body was ignored and the write done). The check is made
    for POST only (service.handler): `DELETE /datasets/d?dry_run=1` — a client asking for a
    dry run, or a query meant for another route — is 200 `{"deleted": "d"}`, its rows gone,
    and `DELETE /jobs/j/control?dry_run=1` drops the job's controller. The most destructive
    writes are the ones not judged by the rule."""
    server = _served(tmp_path / "s.db")
    try:
        with _client(server) as c:
            r = c.post("/datasets", json={"name": "d", "num_samples": 8, "shard_size": 2})
            assert r.status_code == 200, r.text
            r = c.post("/jobs/j/control/config", json={"policy": "bsp", "world_size": 2,
                                                        "global_batch": 8})
            assert r.status_code == 200, r.text
            done = {p: c.delete(p).status_code for p in ("/datasets/d?dry_run=1",
                                                         "/jobs/j/control?dry_run=1")}
            left = {"/datasets/d/status": c.get("/datasets/d/status").status_code,
                    "/jobs/j/control/state": c.get("/jobs/j/control/state").status_code}
            assert left == {"/datasets/d/status": 200, "/jobs/j/control/state": 200}, \
                f"DELETEs with a query string answered {done}; afterwards {left}"
            assert set(done.values()) == {400}, done
    finally:
        server.stop()


def test_another_tokens_shuffles_do_not_queue_a_jobs_lease_behind_them(tmp_path):
    """Token H owns three data sets of 2^23 samples (seeds 1-3, 128-sample shards) and leases
    one shard of each at once: 128 indices a lease, all its index pace charges, but each
    needs its epoch's shuffle (0.6-2 s of CPU) on the service's one `shard-shuffles-big`
    thread, a FIFO. Job V's first lease of its data set (2^20 + 1 samples: a big one, its
    shuffle ~40 ms) is queued behind all three: answered in 2.7 s (its next lease 3 ms), and
    the service has computed all four shuffles when it answers. H can keep the thread busy
    for good (64 data sets of 2^26 samples, 5 s a shuffle, round-robin past the 512 MiB LRU:
    every lease a miss), and every other job's big lease (a new epoch; a data set over 2^20
    samples; a reply over 65,536 indices) waits for the whole queue. A lease's wait on the
    shuffle thread is at most one shuffle of another token (fair turns, or a token's shuffles
    paced). Counted, not timed: the shuffles done when V is answered."""
    hostile = {"Authorization": "Bearer hostile-round11-token-0123456789"}
    server = _served(tmp_path / "s.db")
    store = server.app.state.store
    try:
        with _client(server) as v, httpx.Client(base_url=server.url, timeout=120,
                                                headers=hostile) as h:
            fences = {}
            for i in range(3):
                r = h.post("/datasets", json={"name": f"h{i}", "num_samples": 1 << 23,
                                              "shard_size": 128, "seed": i + 1})
                assert r.status_code == 200, r.text
                fences[f"h{i}"] = h.post(f"/datasets/h{i}/join",
                                         json={"worker": "w"}).json()["fence"]
            r = v.post("/datasets", json={"name": "v", "num_samples": (1 << 20) + 1,
                                          "shard_size": 4096})
            assert r.status_code == 200, r.text
            fv = v.post("/datasets/v/join", json={"worker": "w"}).json()["fence"]
            calls = h.get("/health").json()["commit_calls"]
            threads = [threading.Thread(target=lambda n=n: httpx.post(
                f"{server.url}/datasets/{n}/lease", headers=hostile, timeout=120,
                json={"worker": "w", "fence": fences[n]})) for n in fences]
            for t in threads:
                t.start()
            deadline = time.monotonic() + 60
            # (H's three leases committed, their shuffles queued, the first one running)
            while not (h.get("/health").json()["commit_calls"] >= calls + 3
                       and store.permutations._running):
                assert time.monotonic() < deadline, "H's leases never reached their shuffles"
                time.sleep(0.01)
            r = v.post("/datasets/v/lease", json={"worker": "w", "fence": fv})
            done = store.permutations.computed
            for t in threads:
                t.join(120)
            assert r.status_code == 200, r.text
            assert done <= 2, (f"V's lease answered after {done} shuffles (H's {done - 1}"
                               " of 3 first)")
    finally:
        server.stop()


def test_the_delete_that_repairs_a_damaged_fence_leaves_no_500_behind(tmp_path):
    """Data set d's workers row is damaged to fence 2^63 - 1 (a bit flip, an edit): d's calls
    are 503 `Quarantined` (right), and the message prescribes "DELETE it with its owner's
    token". The DELETE keeps the name's fence floor (schema 6: "raised to every fence its
    workers held", schema.keep_fence_floor: any integer >= 1, no upper bound) at 2^63 - 1; d
    created again, its first new worker's join computes fence 2^63, which SQLite cannot store:
    500 `InternalError` (an OverflowError), on every join of a new name to d for good. (Folded
    into the store floor '*' past max_kept_floors deleted names, the same value would make
    every new name of every data set 500.) A floor is bounded as a fence is (2^62), a damaged
    one never kept."""
    db = tmp_path / "s.db"
    server = _served(db)
    try:
        with _client(server) as c:
            r = c.post("/datasets", json={"name": "d", "num_samples": 8, "shard_size": 2})
            assert r.status_code == 200, r.text
            assert c.post("/datasets/d/join", json={"worker": "w"}).status_code == 200
    finally:
        server.stop()
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE workers SET fence=? WHERE dataset='d'", ((1 << 63) - 1,))
    server = _served(db)
    try:
        with _client(server) as c:
            r = c.post("/datasets/d/join", json={"worker": "w"})
            assert (r.status_code, r.json()["kind"]) == (503, "Quarantined"), r.text
            r = c.delete("/datasets/d")   # (the repair the error prescribes)
            assert r.status_code == 200, r.text
            r = c.post("/datasets", json={"name": "d", "num_samples": 8, "shard_size": 2})
            assert r.status_code == 200, r.text
            r = c.post("/datasets/d/join", json={"worker": "v"})
            assert r.status_code == 200, f"{r.status_code} {r.text}"
    finally:
        server.stop()
