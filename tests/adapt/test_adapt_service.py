"""The shard service over real HTTP with real processes: kill -9 of workers and of the service.

Guarantee under test (README, "Delivery guarantee"): no sample of an epoch is lost; a worker
failure replays at most the samples it had taken but not acknowledged (one batch here, as the
stand-in acks every batch); without a worker failure (service crash, long outage, stalls,
client timeouts) nothing is delivered twice.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import eventually, free_port
from stragglers.adapt.client import ServiceUnavailable, ShardBatchSampler, ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.service import EmbeddedServer, ServiceConfig

WORKER = Path(__file__).parent / "workers" / "shard_worker.py"
TOKEN = "job-token-0123456789abcdef"
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "SHARD_TOKEN": TOKEN, "OMP_NUM_THREADS": "1"}
BATCH = 10


def start_worker(url, worker, log, delay=0.05, timeout_s=10.0):
    return subprocess.Popen([sys.executable, str(WORKER), url, "d", worker, str(log), str(BATCH),
                             str(delay)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**ENV, "SHARD_TIMEOUT_S": str(timeout_s)})


def wait_lines(path, n, timeout=120):
    eventually(lambda: path.exists() and len(path.read_text().splitlines()) >= n, timeout,
               interval=0.02, what=f"{n} lines in {path}")


def consumed(*logs):
    counter = collections.Counter()
    for log in logs:
        if log.exists():
            for line in log.read_text().splitlines():
                entry = json.loads(line)
                counter.update(zip(entry["epochs"], entry["ids"]))
    return counter


def finish(proc, timeout=180):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def retries(db):
    with sqlite3.connect(db) as c:
        return c.execute("SELECT SUM(retries), COUNT(*) FROM shards WHERE state != 'DONE'").fetchone()


@pytest.fixture
def server(tmp_path):
    srv = EmbeddedServer(tmp_path / "shards.db").start()
    yield srv
    srv.stop()


def admin(url, **kw):
    return ShardClient(url, "d", "launcher", token=TOKEN, **kw)


@pytest.mark.slow
def test_killed_worker_mid_shard_loses_nothing(server, tmp_path):
    admin(server.url).create_dataset(DatasetConfig("d", 400, 40, lease_s=60))
    log_a, log_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = start_worker(server.url, "A", log_a)
    wait_lines(log_a, 3)  # 30 of the first 40-sample shard taken: A is mid-shard
    a.send_signal(signal.SIGKILL)
    a.wait()
    # The launcher sees A die and fences it off; its shard goes back (a lease expiry would do
    # the same, later).
    released = ShardClient(server.url, "d", "A", token=TOKEN).release(
        error="worker A killed", all_incarnations=True).released
    assert len(released) == 1
    rc, out, err = finish(start_worker(server.url, "B", log_b, delay=0.0))
    assert rc == 0, err
    counts = consumed(log_a, log_b)
    assert {i for _, i in counts} == set(range(400)), "a sample was lost"
    assert sum(counts.values()) - 400 <= BATCH, "replay beyond the stated bound (one batch)"
    assert admin(server.url).status().epochs["0"] == {"TODO": 0, "DOING": 0, "DONE": 10,
                                                         "FAILED": 0}


@pytest.mark.slow
def test_expired_lease_of_a_hung_worker_is_reassigned(server, tmp_path):
    # lease_s well above any stall of the live worker B on a loaded machine: only A's expires.
    admin(server.url).create_dataset(DatasetConfig("d", 300, 30, lease_s=5.0))
    log_a, log_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a = start_worker(server.url, "A", log_a)
    wait_lines(log_a, 2)
    a.send_signal(signal.SIGSTOP)  # hung: holds its lease, acks nothing
    try:
        rc_b, _, err_b = finish(start_worker(server.url, "B", log_b, delay=0.0))
        assert rc_b == 0, err_b
    finally:
        a.send_signal(signal.SIGCONT)
    rc_a, out_a, err_a = finish(a)
    assert rc_a == 0, err_a
    counts = consumed(log_a, log_b)
    assert {i for _, i in counts} == set(range(300))
    assert sum(counts.values()) - 300 <= BATCH
    assert json.loads(out_a.splitlines()[-1])["lost_samples"] <= BATCH
    assert admin(server.url).status().epochs["0"]["DONE"] == 10


@pytest.mark.slow
def test_hung_predecessor_with_the_same_name_is_fenced_off(server, tmp_path):
    """A restarted worker and its hung predecessor share the name "A": only the new one acks."""
    admin(server.url).create_dataset(DatasetConfig("d", 400, 40, lease_s=600))
    log_old, log_new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    old = start_worker(server.url, "A", log_old)
    wait_lines(log_old, 2)
    old.send_signal(signal.SIGSTOP)
    try:
        rc, _, err = finish(start_worker(server.url, "A", log_new, delay=0.0))
        assert rc == 0, err
    finally:
        old.send_signal(signal.SIGCONT)
    rc_old, out_old, err_old = finish(old)
    assert rc_old == 3 and "fenced" in out_old, (out_old, err_old)
    counts = consumed(log_old, log_new)
    assert {i for _, i in counts} == set(range(400))
    assert sum(counts.values()) - 400 <= BATCH, "the fenced predecessor trained past one batch"
    assert admin(server.url).status().epochs["0"]["DONE"] == 10


class Service:
    """`stragglers adapt serve` in a subprocess, restartable on the same port and file."""

    def __init__(self, tmp_path, *extra):
        self.db, self.port = tmp_path / "shards.db", free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.extra = extra
        self.procs = []

    def start(self):
        proc = subprocess.Popen([sys.executable, "-m", "stragglers.cli", "adapt", "serve", "--db",
                                 str(self.db), "--port", str(self.port), *self.extra],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        self.procs.append(proc)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                httpx.get(f"{self.url}/health", timeout=2)
                return proc
            except httpx.TransportError:
                if proc.poll() is not None:
                    raise AssertionError(proc.stderr.read())
                time.sleep(0.05)
        raise AssertionError("the service did not start")

    def kill(self):
        self.procs[-1].send_signal(signal.SIGKILL)
        self.procs[-1].wait()

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.wait()


@pytest.fixture
def service(tmp_path):
    token_file = tmp_path / "service.token"
    token_file.write_text("service-token-abcdef0123456789\n")
    token_file.chmod(0o600)   # a token file others can read is refused
    svc = Service(tmp_path, "--token-file", str(token_file))
    svc.service_token = "service-token-abcdef0123456789"
    yield svc
    svc.close()


@pytest.mark.slow
def test_service_killed_three_times_resumes_exactly_once(service, tmp_path):
    service.start()
    client = ShardClient(service.url, "d", "W", token=TOKEN, retry_s=120,
                         service_token=service.service_token)
    client.create_dataset(DatasetConfig("d", 300, 20, num_epochs=2))
    sampler = ShardBatchSampler(client, 7)
    seen = collections.Counter()
    kills = 0
    for n, ids in enumerate(sampler):
        seen.update(zip(sampler.last_batch_epochs, ids))
        if n in (12, 40, 41):
            service.kill()  # the next lease/ack meets a dead service, then a new one
            kills += 1
            time.sleep(0.3)
            service.start()
    assert kills == 3
    assert set(seen.values()) == {1}, "duplicate delivery without a worker failure"
    assert {i for e, i in seen if e == 0} == set(range(300))
    assert {i for e, i in seen if e == 1} == set(range(300))
    status = client.status()
    assert all(v["DONE"] == 15 for v in status.epochs.values())
    assert retries(service.db) == (None, 0)
    with sqlite3.connect(service.db) as c:
        assert c.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    cli = subprocess.run([sys.executable, "-m", "stragglers.cli", "adapt", "status", "d", "--url",
                          service.url], capture_output=True, text=True, env=ENV, timeout=120)
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["epochs"] == status.epochs
    old = subprocess.run([sys.executable, "-m", "stragglers.cli", "shard-status", "d", "--url",
                          service.url], capture_output=True, text=True, env=ENV, timeout=120)
    assert old.returncode == 0 and json.loads(old.stdout)["epochs"] == status.epochs


@pytest.mark.slow
def test_an_outage_longer_than_the_lease_expires_no_lease(tmp_path):
    """kill -9 of the service for 2.5x lease_s while a worker is mid-shard: nothing expires."""
    service = Service(tmp_path)
    try:
        service.start()
        admin(service.url).create_dataset(DatasetConfig("d", 200, 20, lease_s=8.0))
        log = tmp_path / "w.jsonl"
        w = start_worker(service.url, "W", log, delay=0.05)
        wait_lines(log, 5)
        service.kill()
        time.sleep(20.0)  # the worker's client keeps retrying its ack meanwhile
        service.start()
        rc, out, err = finish(w)
        assert rc == 0, err
        counts = consumed(log)
        assert {i for _, i in counts} == set(range(200)) and set(counts.values()) == {1}
        assert json.loads(out.splitlines()[-1])["lost_samples"] == 0
        with sqlite3.connect(service.db) as c:
            assert c.execute("SELECT SUM(retries) FROM shards").fetchone() == (0,)
    finally:
        service.close()


@pytest.mark.slow
def test_a_stalled_service_and_client_timeouts_orphan_no_shard(tmp_path):
    """SIGSTOP the service for longer than the lease and than the client's timeout, twice.

    Retried leases reuse their request id (no orphaned shard); the pause is noticed and the
    held leases get a grace period, as after a restart (no lease expires)."""
    service = Service(tmp_path)
    try:
        service.start()
        admin(service.url).create_dataset(DatasetConfig("d", 600, 10, lease_s=8.0))
        log = tmp_path / "w.jsonl"
        w = start_worker(service.url, "W", log, delay=0.0, timeout_s=0.5)
        for lines in (5, 35):
            wait_lines(log, lines)
            service.procs[-1].send_signal(signal.SIGSTOP)
            time.sleep(12.0)  # 1.5x the lease, 24x the client timeout: requests are retried
            service.procs[-1].send_signal(signal.SIGCONT)
        rc, out, err = finish(w)
        assert rc == 0, err
        counts = consumed(log)
        assert {i for _, i in counts} == set(range(600)) and set(counts.values()) == {1}
        with sqlite3.connect(service.db) as c:
            assert c.execute("SELECT SUM(retries), COUNT(*) FROM shards WHERE state='DONE'"
                             ).fetchone() == (0, 60)
        assert httpx.get(f"{service.url}/health").json()["stalls"] >= 2
    finally:
        service.close()


@pytest.mark.slow
def test_a_locked_database_answers_every_call_then_recovers(tmp_path):
    """Another process holds the write lock: calls fail with 503 (never hang), then succeed."""
    srv = EmbeddedServer(tmp_path / "shards.db", config=ServiceConfig(busy_timeout_s=0.2)).start()
    try:
        client = admin(srv.url, retry_s=0.0)
        client.create_dataset(DatasetConfig("d", 100, 10))
        client.join()
        lock = sqlite3.connect(tmp_path / "shards.db", isolation_level=None)
        lock.execute("BEGIN IMMEDIATE")  # e.g. an old rank 0 that lingers
        try:
            for _ in range(3):
                with pytest.raises(ServiceUnavailable, match="transaction failed"):
                    client.lease()
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        assert client.lease().status == "ok"
        assert httpx.get(f"{srv.url}/health").json()["failed_batches"] >= 3
    finally:
        srv.stop()


@pytest.mark.slow
def test_cli_reports_bad_arguments_in_one_line(tmp_path):
    for args, needle in [(["--db", str(tmp_path / "no" / "such" / "x.db")], "does not exist"),
                         (["--db", str(tmp_path / "x.db"), "--host", "0.0.0.0"], "token"),
                         (["--db", str(tmp_path / "x.db"), "--token-file", str(tmp_path / "nope")],
                          "token"),
                         (["--db", str(tmp_path / "x.db"), "--set", "max_batch=0"], "max_batch"),
                         (["--db", str(tmp_path / "x.db"), "--set", "max_kept_floors=-1"],
                          "max_kept_floors")]:
        bad = subprocess.run([sys.executable, "-m", "stragglers.cli", "adapt", "serve", *args],
                             capture_output=True, text=True, env=ENV, timeout=120)
        assert bad.returncode == 2 and needle in bad.stderr, (args, bad.stderr)
        assert "Traceback" not in bad.stderr


@pytest.mark.slow
def test_sigterm_stops_the_service_cleanly(service):
    # SIGTERM: the service finishes its requests, closes the store (SQLite folds the
    # write-ahead log back into the file) and exits 143 — uvicorn re-raising the signal after
    # its graceful shutdown no longer kills the process before that cleanup.
    proc = service.start()
    client = ShardClient(service.url, "d", "w", token=TOKEN,
                         service_token=service.service_token)
    client.create_dataset(DatasetConfig("d", 40, 10))
    assert client.join() == 1
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert "Traceback" not in err, err
    assert not Path(f"{service.db}-wal").exists()
    with sqlite3.connect(service.db) as c:
        assert c.execute("SELECT count(*) FROM datasets").fetchone() == (1,)
