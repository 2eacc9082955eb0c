"""The shard service on a full disk (a file-size limit stands in for it: writes fail the same
way, no privileges needed): refusals in the service's JSON shape, /health answered, nothing
acknowledged lost, and the service starts again on the same file."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import httpx
import pytest

from conftest import fill
from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.service import EmbeddedServer, token_digest

OWNER = "owner-token-0123456789"
SERVE_LIMITED = """
import resource, signal, sys
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])   # taken by sigwait below
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails (EFBIG), no kill
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])   # space returns (sigwait below)
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
from stragglers.adapt.service import EmbeddedServer
s = EmbeddedServer(sys.argv[1]).start()
print(s.port, flush=True)
while signal.sigwait([signal.SIGTERM, signal.SIGUSR1]) == signal.SIGUSR1:
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)
    print("unlimited", flush=True)
"""


def serve_limited(db, limit: int = 2 << 20) -> tuple[subprocess.Popen, str]:
    """A service process on `db` whose files may not grow past `limit` bytes, and its URL."""
    proc = subprocess.Popen([sys.executable, "-c", SERVE_LIMITED, str(db), str(limit)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.strip().isdigit():
        proc.kill()
        raise AssertionError(proc.communicate(timeout=60)[1][-3000:])
    return proc, f"http://127.0.0.1:{int(line)}"


@pytest.mark.slow
def test_a_full_disk_refuses_writes_and_loses_nothing_acknowledged(tmp_path):
    db = tmp_path / "s.db"
    proc, url = serve_limited(db)
    try:
        h = {"Authorization": f"Bearer {OWNER}"}
        with httpx.Client(base_url=url, headers=h, timeout=60) as c:
            assert c.post("/datasets", json={"name": "d0", "num_samples": 1000,
                                             "shard_size": 10}).status_code == 200
            fence = c.post("/datasets/d0/join", json={"worker": "w"}).json()["fence"]
            acked = []
            for _ in range(5):
                lease = c.post("/datasets/d0/lease", json={"worker": "w", "fence": fence})
                x = lease.json()["leases"][0]
                r = c.post("/datasets/d0/ack", json={"worker": "w", "fence": fence, "epoch":
                                                     x["epoch"], "shard": x["shard"],
                                                     "consumed": x["size"]})
                assert r.status_code == 200, r.text
                acked.append(x["shard"])
            created, refused = [], None
            for i in range(1, 400):   # each new data set writes 1,024 shard rows
                r = c.post("/datasets", json={"name": f"d{i}", "num_samples": 1 << 20,
                                              "shard_size": 16})
                if r.status_code != 200:
                    refused = r
                    break
                created.append(f"d{i}")
            assert refused is not None, "the file-size limit was never reached"
            assert refused.status_code == 507, refused.text
            assert set(refused.json()) == {"error", "kind", "field"}
            assert refused.json()["kind"] == "DiskFull"
            assert "Traceback" not in refused.text
            assert c.get("/health").status_code == 200
            r = c.post("/datasets/d0/lease", json={"worker": "w", "fence": fence})
            assert r.status_code in (200, 503, 507), r.text
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=60)
    srv = EmbeddedServer(db).start()
    try:
        status = ShardClient(srv.url, "d0", "w", token=OWNER).status()
        assert status.epochs["0"]["DONE"] == len(acked)
        for name in created:
            assert httpx.get(f"{srv.url}/datasets/{name}/status").status_code == 200
    finally:
        srv.stop()



@pytest.mark.slow
def test_writes_resume_without_a_restart_once_the_wal_is_folded(tmp_path):
    # The WAL reached the file-size limit before SQLite's auto-checkpoint (1,000 pages, 4 MB):
    # once the frames a refused write left were reused, every later write failed until a
    # restart folded it. The service folds and truncates it after a write fails for space.
    db = tmp_path / "s.db"
    proc, url = serve_limited(db)
    try:
        h = {"Authorization": f"Bearer {OWNER}"}
        with httpx.Client(base_url=url, headers=h, timeout=60) as c:
            assert c.post("/datasets", json={"name": "d0", "num_samples": 100_000,
                                             "shard_size": 10}).status_code == 200
            fence = c.post("/datasets/d0/join", json={"worker": "w"}).json()["fence"]
            for i in range(1, 400):   # each writes 1,024 shard rows, until one is refused
                r = c.post("/datasets", json={"name": f"d{i}", "num_samples": 1 << 14,
                                              "shard_size": 16})
                if r.status_code != 200:
                    break
            assert r.status_code == 507, r.text

            def retried(path: str, body: dict) -> httpx.Response:
                r = c.post(path, json=body)   # refused for space, it folds the WAL ...
                if r.status_code == 507:
                    r = c.post(path, json=body)   # ... so the next one fits
                return r

            for k in range(100):   # two transactions each: far more than the refused one left
                lease = retried("/datasets/d0/lease", {"worker": "w", "fence": fence,
                                                       "request_id": f"r{k}"})
                assert lease.status_code == 200, (k, lease.text)
                x = lease.json()["leases"][0]
                r = retried("/datasets/d0/ack", {"worker": "w", "fence": fence, "epoch":
                                                 x["epoch"], "shard": x["shard"],
                                                 "consumed": x["size"]})
                assert r.status_code == 200, (k, r.text)
            assert c.get("/datasets/d0/status").json()["epochs"]["0"]["DONE"] == 100
    finally:
        proc.kill()
        proc.communicate(timeout=60)


@pytest.mark.slow
def test_the_service_starts_again_on_a_full_disk(tmp_path):
    # (fails before: every start wrote the schema version, so a service killed on a full disk
    # could not start again until space was freed: "not a usable SQLite database")
    db = tmp_path / "s.db"
    proc, url = serve_limited(db, 1 << 30)
    try:
        owner = ShardClient(url, "d", "w", token=OWNER)
        owner.create_dataset(DatasetConfig("d", 1000, 10))
        owner.join()
        held = owner.lease().leases[0]
    finally:
        proc.kill()   # (kill -9: its WAL is left as it was)
        proc.communicate(timeout=60)
    # no file may grow: the next write of any kind fails for space
    proc, url = serve_limited(db, max(p.stat().st_size for p in tmp_path.iterdir()))
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            snap = c.get("/datasets/d/snapshot")
            assert snap.status_code == 200
            assert [held.epoch, held.shard, "DOING"] in [r[:3] for r in snap.json()["shards"]]
            r = c.post("/datasets/d/join", json={"worker": "x"},
                       headers={"Authorization": f"Bearer {OWNER}"})
            assert r.status_code == 507 and r.json()["kind"] == "DiskFull", r.text
    finally:
        proc.kill()
        proc.communicate(timeout=60)
    proc, url = serve_limited(db, 1 << 30)   # space again: writes are taken
    try:
        r = httpx.post(f"{url}/datasets/d/join", json={"worker": "x"}, timeout=60,
                       headers={"Authorization": f"Bearer {OWNER}"})
        assert r.status_code == 200, r.text
    finally:
        proc.kill()
        proc.communicate(timeout=60)


@pytest.mark.slow
def test_a_write_refused_for_space_is_507_changes_nothing_and_is_taken_once_space_returns(
        tmp_path):
    # (fails before: SQLite words EFBIG at the file-size limit "disk I/O error", and the service
    # answered 503 EnvironmentFailure, as for a failing disk: a client could not tell a full
    # disk it must free from a fault to retry)
    db = tmp_path / "s.db"
    proc, url = serve_limited(db, 1 << 20)
    try:
        h = {"Authorization": f"Bearer {OWNER}"}
        with httpx.Client(base_url=url, headers=h, timeout=60) as c:
            assert c.post("/datasets", json={"name": "d0", "num_samples": 1000,
                                             "shard_size": 10}).status_code == 200
            fence = c.post("/datasets/d0/join", json={"worker": "w"}).json()["fence"]
            x = c.post("/datasets/d0/lease", json={"worker": "w", "fence": fence}).json()
            x = x["leases"][0]
            assert c.post("/datasets/d0/ack", json={
                "worker": "w", "fence": fence, "epoch": x["epoch"], "shard": x["shard"],
                "consumed": x["size"]}).status_code == 200
            # new data sets (1,024 shard rows each) until the file-size limit is reached and
            # stays so: refused twice in a row (the first refusal folds the WAL, which may
            # make room once)
            refusals, i = [], 0
            while len(refusals) < 2:
                i += 1
                assert i < 400, "the file-size limit was never reached"
                r = c.post("/datasets", json={"name": f"n{i}", "num_samples": 1 << 14,
                                              "shard_size": 16})
                if r.status_code == 200:
                    refusals = []
                    continue
                refusals.append((f"n{i}", r))
            for name, r in refusals:
                assert r.status_code == 507, r.text
                assert r.json()["kind"] == "DiskFull" and set(r.json()) == {
                    "error", "kind", "field"}
                assert "Traceback" not in r.text
                # nothing of it stored
                assert c.get(f"/datasets/{name}/status").status_code == 404
            assert c.get("/health").status_code == 200
            proc.send_signal(signal.SIGUSR1)   # space returns, no restart
            assert proc.stdout.readline().strip() == "unlimited"
            name = refusals[-1][0]
            r = c.post("/datasets", json={"name": name, "num_samples": 1 << 14,
                                          "shard_size": 16})
            assert r.status_code == 200, r.text
            assert c.get(f"/datasets/{name}/status").status_code == 200
            assert c.get("/datasets/d0/status").json()["epochs"]["0"]["DONE"] == 1
    finally:
        proc.kill()
        proc.communicate(timeout=60)


CHECKED = """
import resource, signal, sqlite3, sys
from stragglers.adapt.space import out_of_space
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
db = sys.argv[1]
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 18, resource.RLIM_INFINITY))
c = sqlite3.connect(db, isolation_level=None)
c.execute("PRAGMA journal_mode=WAL")
c.execute("CREATE TABLE t (x BLOB)")
try:
    for _ in range(1000):
        c.execute("INSERT INTO t VALUES (zeroblob(4000))")
except sqlite3.OperationalError as exc:
    error = exc
print(error.sqlite_errorname, out_of_space(error, db))
resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY,) * 2)   # space again
print(out_of_space(error, db))
"""


def test_an_io_error_counts_as_a_full_disk_only_while_the_space_is_gone(tmp_path):
    # SQLite words EFBIG, EDQUOT and a failing disk alike ("disk I/O error"): the same error is
    # a full disk (507) at the file-size limit, and not (503) once the files may grow again
    out = subprocess.run([sys.executable, "-c", CHECKED, str(tmp_path / "t.db")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["SQLITE_IOERR_WRITE", "True", "False"]



@pytest.mark.slow
def test_status_on_a_full_disk_says_so_once_until_a_write_fits(small_disk, caplog):
    # (fails before: a warning was logged on every status request while the disk was full and
    # a lease expired: a line per read)
    srv = EmbeddedServer(small_disk / "s.db").start()
    said = "without requeueing its expired leases"
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            owner = ShardClient(srv.url, "d", "w", token=OWNER)
            owner.create_dataset(DatasetConfig("d", 1000, 10, lease_s=0.05))
            owner.join()
            for turn in range(2):
                owner.lease()   # held, never acked: it expires
                fill(small_disk)
                time.sleep(0.1)
                for _ in range(4):
                    r = c.get("/datasets/d/status")
                    assert r.status_code == 200, r.text
                assert caplog.text.count(said) == turn + 1, caplog.text[-3000:]
                (small_disk / "filler").unlink()   # space again: the requeue is written
                r = c.get("/datasets/d/status")
                assert r.json()["epochs"]["0"]["DOING"] == 0, r.text
    finally:
        srv.stop()


CUT_SHORT = """
import json, os, sys
from stragglers.adapt.dataset import DatasetConfig, validate_snapshot
from stragglers.adapt.restores import RESTORE_CHUNK, prepare_restore
from stragglers.adapt.shards import ShardStore
store = ShardStore(sys.argv[1])
store.create_dataset(DatasetConfig("big", 3 * RESTORE_CHUNK, 1))
store.create_dataset(DatasetConfig("d", 100, 10), sys.argv[2])
before = store.snapshot("big")
prepared = prepare_restore(validate_snapshot(before))
store.restore_rows(store.restore_begin(prepared), prepared.chunk(0))
print(json.dumps(before), flush=True)
os._exit(0)   # killed half-way through the restore: its WAL left as it was
"""


@pytest.mark.slow
def test_a_restore_cut_short_does_not_stop_a_start_on_a_full_disk_and_its_rows_go_later(
        tmp_path):
    # (fails before: each start marked the rows of a restore cut short as garbage, a write, and
    # a service killed half-way through a restore on a full disk could not start again there:
    # "its disk is full; free space and start again" — the space its own rows hold; and their
    # deletion, refused once, was tried again only after the next restore or start)
    db = tmp_path / "s.db"
    before = json.loads(subprocess.run([sys.executable, "-c", CUT_SHORT, str(db),
                                        token_digest(OWNER)], check=True, text=True,
                                       stdout=subprocess.PIPE).stdout)
    # no file may grow: the next write of any kind fails for space
    proc, url = serve_limited(db, max(p.stat().st_size for p in tmp_path.iterdir()))
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/health").status_code == 200   # (its deleting them refused)
            assert c.get("/datasets/big/snapshot").json() == before
            proc.send_signal(signal.SIGUSR1)   # space again: the cut restore's rows go
            assert proc.stdout.readline().strip() == "unlimited"
            r = c.post("/datasets/d/join", json={"worker": "x"},
                       headers={"Authorization": f"Bearer {OWNER}"})
            assert r.status_code == 200, r.text
            staged = "SELECT count(*) FROM shards WHERE dataset LIKE 'big/%'"
            for _ in range(1200):   # (deleted in paced steps, retried: a state, polled)
                with contextlib.closing(sqlite3.connect(db)) as conn:
                    if conn.execute(staged).fetchone()[0] == 0:
                        break
                time.sleep(0.1)
            with contextlib.closing(sqlite3.connect(db)) as conn:
                assert conn.execute(staged).fetchone()[0] == 0
            assert c.get("/datasets/big/snapshot").json() == before
    finally:
        proc.kill()
        proc.communicate(timeout=60)
