"""Lease latency of a well-behaved job while others abuse the shard service (issue 34).

    .venv/bin/python benchmarks/adapt_dos.py [--leases 300] [--attackers 5]

One service process (`stragglers adapt serve`, durable commits). The measured job leases one
shard and acks it, `--leases` times in a row, on its own small data set; the figure is the
median and 95th percentile of one lease + ack round trip. It runs quiet first, then while
`--attackers` processes each keep doing one of:

* snapshot: anonymous GET of a 655,360-row snapshot (65,536 shards x 10 epochs), in a loop;
* status: anonymous GET of the same data set's status, in a loop;
* shuffle: leases from data sets of 2**26 samples (each new one needs a shuffle of 2**26);
* restore: a stranger's token POSTs a 60 MB restore body onto the job's data set;
* owner_restore: the 655,360-row snapshot restored onto its data set (whose token may), in a
  loop: written on the commit thread in paced 512-row steps (one restore at a time; the other
  attackers are answered 503 Busy);
* big_lease: each attacker owns a data set of 4 shards of 65,536 samples and replays its lease
  of all 4 (one request id: 262,144 indices, 2.2 MB of JSON a reply) in a loop;
* bad_input: each attacker sends, in a loop, bodies the service refuses: 1 MiB of ints in an
  unknown field, 100,000-deep nesting, keys given twice, 1 MiB that is not UTF-8, a form body,
  a stranger's token with a 1 MiB body on the job's data set, and an object of 80,000 unknown
  keys;
* control_reports: each attacker owns a job's controller (2 ranks, a window of one step, any
  change of split an action) and posts reports of 10,000 step records, the ranks taking turns
  being slow, in a loop (work on the control thread, not the event loop);
* slow_bodies: each attacker keeps 48 connections that sent a lease's head announcing 1 MiB
  and then one byte a second (reopened as the service closes them);
* owner_flood: one owner (one token, its own data set) on 256 connections in all (each
  attacker 256 / `--attackers`), each leasing a new shard in a loop: real writes on the commit
  thread, all of one token (the committer takes each token's calls in turns).
* worker_flood: the same, each connection a worker of its own (256 joined): a token with as
  many workers as connections (two requests in progress per joined worker were free of the
  shared pace; now only what acks moving a shard earn).
* worker_names: one token (all attackers share it) creates 12 data sets per attacker (past
  its 64: 429) and, on 32 connections per attacker, joins a new worker name in a loop, each
  leasing once: every name has allowances of its own (work credit, held shards, remembered
  replies, two requests in progress of the token's allowance); past `max_workers_per_token`
  (4,096 names over the token's data sets) the joins are 429 (before: 64 x 1,024 names);
* give_back: each attacker owns a data set of one-sample shards; its worker leases the 1,024
  shards it may hold (4 x 256) and gives them all back, by a release (fenced, no failure) and
  every fourth time by joining again, in a loop: 1,024 shards requeued a call;
* expire: each attacker owns a data set with the shortest lease (0.05 s) and 4 workers that
  lease 256 shards in turn, in a loop: every lease first requeues the expired ones (up to
  1,024 a call);
* retry_failed: each attacker owns a data set without retries; its worker leases 1,024 shards,
  releases them as failures (FAILED) and asks retry-failed, in a loop;
* delete: each attacker restores the 655,360-row snapshot as a data set of its own (one
  restore at a time: the others are answered 503 Busy) and deletes it (DELETE
  /datasets/{name}: its rows are deleted afterwards), in a loop.
* health, not_found, malformed: each attacker keeps 48 connections (240 in all, under the
  256 of one address) each sending, in a loop, an anonymous `GET /health`, a GET of a path no
  route serves (404), or bytes the HTTP parser refuses (400), each on a new connection
  (`Connection: close`: an accept and a close a request, the dearest for the service); all
  wait their address's turn of the anonymous pace (32 a second after 64).

Each case alternates `--blocks` quiet and attacked blocks (the attackers paused between them;
quiet first in even pairs, attacked first in odd ones), and is judged as monitor_dos.py judges
its cases (its `measured` and `verdict`): the median of the attacked blocks over that of the
quiet ones (goal: <= 2x), each pair's own ratio, the same less the run-queue wait of the
measured client's thread and of the service's event loop (what this machine's other load adds),
and the CPU the service used quiet and attacked (cores, /proc) and what it had the disk read and
write (MB/s, /proc/<pid>/io). Attackers run at nice 19
(deployed, they run elsewhere; their own CPU here is not work the service does for them);
`--attacker-nice 0` where a busy machine would leave them no CPU at 19 (then the ratio also
counts their CPU taken from the job's client and the service: pessimistic).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from monitor_dos import Block, Probe, disk_bytes, figures, line, measured, order, timed
from results import Run, write
from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.service import ANONYMOUS_MAX_WAIT_S
from stragglers.adapt.shards import ShardStore

JOB, BIG = "job-token-0123456789abcdef", "big-owner-token-0123456789"
NICE = [19]   # the attackers' niceness (--attacker-nice)
ATTACKERS = [5]   # --attackers (owner_flood shares its 256 connections among them)
SERVICE_SETS: list[str] = []   # --set NAME=VALUE of the service's config (repeatable)
STRANGER = "stranger-token-0123456789ab"


def big_db(db: Path) -> None:
    """A data set of 65,536 shards with 10 epochs created: a 655,360-row snapshot."""
    store = ShardStore(db)
    cfg = DatasetConfig("big", 655_360, 10, num_epochs=10)
    store.create_dataset(cfg)
    with store._tx() as c:
        c.execute("DELETE FROM shards WHERE dataset='big'")   # epoch 0 written whole below
        for epoch in range(10):
            store._create_epoch(c, cfg, epoch, full=True)
    store.close()


def start_service(db: Path) -> tuple[subprocess.Popen, str]:
    sets = [arg for pair in SERVICE_SETS for arg in ("--set", pair)]
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.cli", "adapt", "serve", "--db",
                             str(db), "--port", "0", *sets], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    url = line.split(" on ", 1)[1].split(" ", 1)[0]
    return proc, url


def attack(kind: str, url: str, i: int, stop, go, inflight, done=None) -> None:
    """One attacker process: `kind` in a loop while `go` is set (paused between the measured
    blocks; `inflight` counts its requests under way, so a quiet block starts without any)."""
    os.nice(NICE[0])   # (see the module's docstring)
    http = httpx.Client(base_url=url, timeout=600)
    if kind == "shuffle":
        client = ShardClient(url, f"huge{i}", "w", token=f"{STRANGER}{i}", timeout_s=600)
        client.create_dataset(DatasetConfig(f"huge{i}", 1 << 26, 1024, num_epochs=None,
                                            seed=i))
        client.join()
    if kind in ("big_lease", "bad_input"):
        http.headers["Authorization"] = f"Bearer {STRANGER}{i}"
        r = http.post("/datasets", json={"name": f"own{i}", "num_samples": 1 << 18,
                                         "shard_size": 1 << 16, "lease_s": 3600})
        assert r.status_code == 200, r.text[:200]
        fence = http.post(f"/datasets/own{i}/join", json={"worker": "w"}).json()["fence"]
        http.post(f"/datasets/own{i}/lease", json={"worker": "w", "fence": fence, "count": 4,
                                                  "request_id": "again"})
    if kind == "slow_bodies":
        slow_bodies(url, stop, go, inflight)
        return
    if kind in GIVE_BACK:
        give_back(kind, url, i, stop, go, inflight)
        return
    if kind == "worker_names":
        worker_names(url, i, stop, go, inflight)
        return
    if kind in ("owner_flood", "worker_flood"):
        owner_flood(url, i, stop, go, inflight, max(1, 256 // ATTACKERS[0]),
                    kind == "worker_flood")
        return
    if kind in FLOODS:
        anonymous_flood(kind, url, stop, go, inflight)
        return
    if kind == "control_reports":
        http.headers["Authorization"] = f"Bearer {STRANGER}{i}"
        r = http.post(f"/jobs/ctl{i}/control/config", json={
            "policy": "dd", "world_size": 2, "global_batch": 64, "window": 1,
            "min_change": 0, "incarnation": 1})
        assert r.status_code == 200, r.text[:200]
    body = b'{"dataset":' + b" " * 60_000_000 + b"}"
    if kind == "big_lease":
        body = json.dumps({"worker": "w", "fence": fence, "count": 4,
                           "request_id": "again"}).encode()
    elif kind == "bad_input":
        body = json.dumps({"ds": f"own{i}", "fence": fence}).encode()
    elif kind == "control_reports":
        body = json.dumps({"job": f"ctl{i}"}).encode()
    if kind == "owner_restore":
        # the owner's snapshot (an anonymous read may be answered 503 Busy: not a snapshot)
        while (r := http.get("/datasets/big/snapshot",
                             headers={"Authorization": f"Bearer {BIG}",
                                      "Content-Type": "application/json"})).status_code != 200:
            stop.wait(0.5)
        body = r.content
    def one() -> bool:
        nonlocal client, i
        try:
            return once(kind, http, body)
        except httpx.HTTPError:
            return False   # the service may cut a refused upload short
        finally:
            if kind == "shuffle":
                # a new seed each time: a new data set name means a new shuffle of 2**26
                client.lease()
                i += 1000
                client = ShardClient(url, f"huge{i}", "w", token=f"{STRANGER}{i % 7}",
                                     timeout_s=600)
                try:
                    client.create_dataset(DatasetConfig(f"huge{i}", 1 << 26, 1024, seed=i))
                    client.join()
                except Exception:  # noqa: BLE001 - the quota ends it: keep the load anyway
                    stop.wait(0.5)
    rounds(stop, go, inflight, one, done)


def rounds(stop, go, inflight, one, done=None) -> None:
    """An attacker's loop: `one()` called while `go` is set (paused between the measured
    blocks), each call counted in `inflight` (a quiet block starts with none under way); an
    httpx error ends a call, not the loop; a call's seconds put on `done` when it returns
    True."""
    while not stop.is_set():
        if not go.wait(0.1):
            continue
        with inflight.get_lock():
            inflight.value += 1
        try:
            t0 = time.perf_counter()
            if one() and done is not None:
                done.put(time.perf_counter() - t0)
        except httpx.HTTPError:
            pass
        finally:
            with inflight.get_lock():
                inflight.value -= 1


def once(kind: str, http: httpx.Client, body: bytes) -> bool:
    """One abusive request; True for a restore written whole."""
    if kind == "snapshot":
        http.get("/datasets/big/snapshot")
    elif kind == "status":
        http.get("/datasets/big/status")
    elif kind == "restore":
        http.post("/datasets/job/restore", content=body,
                  headers={"Authorization": f"Bearer {STRANGER}",
                           "Content-Type": "application/json"})
    elif kind == "big_lease":
        http.post(_own(http) + "/lease", content=body,
                  headers={"Content-Type": "application/json"})
    elif kind == "bad_input":
        bad_inputs(http, json.loads(body))
    elif kind == "control_reports":
        control_reports(http, json.loads(body)["job"])
    elif kind == "owner_restore":
        r = http.post("/datasets/big/restore", content=body,
                      headers={"Authorization": f"Bearer {BIG}",
                               "Content-Type": "application/json"})
        # (429: 'big' has no owner's token, so its restores wait loopback's anonymous turns)
        assert r.status_code in (200, 429, 503), r.text[:200]
        if r.status_code == 429:
            time.sleep(min(10.0, float(r.headers.get("retry-after", 1))))
        return r.status_code == 200
    return False


def _own(http: httpx.Client) -> str:
    """The path of the attacker's own data set (named after its token's number)."""
    token = http.headers["Authorization"].removeprefix(f"Bearer {STRANGER}")
    return f"/datasets/own{token}"


def bad_inputs(http: httpx.Client, own: dict) -> None:
    """One round of bodies the service refuses (see the module's docstring)."""
    path, fence = f"/datasets/{own['ds']}/lease", own["fence"]
    js = {"Content-Type": "application/json"}
    ints = json.dumps({"worker": "w", "fence": fence, "pad": list(range(120_000))}).encode()
    for content, headers in ((ints, js), (b"[" * 100_000 + b"]" * 100_000, js),
                             (b'{"worker":"w","fence":%d,"fence":%d}' % (fence, fence), js),
                             (b'{"worker":"\xff' + b"\xfe" * (1 << 20) + b'"}', js),
                             (b"worker=w&fence=1", {"Content-Type": "application/x-www-form-urlencoded"})):
        r = http.post(path, content=content, headers=headers)
        assert 400 <= r.status_code < 500, (r.status_code, r.text[:200])
    r = http.post("/datasets/job/lease", content=ints, headers={
        **js, "Authorization": f"Bearer {STRANGER}"})
    assert r.status_code in (400, 403, 413), r.text[:200]
    keys = json.dumps({"worker": "w", "fence": fence, **{f"k{i}": 0 for i in range(80_000)}})
    r = http.post(path, content=keys.encode(), headers=js)
    assert r.status_code == 400, r.text[:200]


STEP = [2]


def control_reports(http: httpx.Client, job: str) -> None:
    """One report of 10,000 records per rank of the attacker's job (steps go on)."""
    for rank in (0, 1):
        slow = (STEP[0] // 100) % 2 == rank
        # (steps of 1-3 ms: 10,000 of them a report is within what the job could have run
        # since its last one, the service's bound on a step ahead of the job's latest)
        records = [[STEP[0] + k, 0.003 if slow else 0.001, 32] for k in range(10_000)]
        r = http.post(f"/jobs/{job}/control/report", json={"rank": rank, "records": records,
                                                           "incarnation": 1, "since": 0})
        # (503 Busy: past the service's bound on control calls waiting; the loop goes on)
        assert r.status_code in (200, 503), r.text[:200]
    STEP[0] += 10_000


def owner_flood(url: str, i: int, stop, go, inflight, n: int, workers: bool = False) -> None:
    """`n` connections of one owner's token, each leasing a new shard of its data set in a
    loop (a fresh request id each: a write every time); `workers`: each connection a worker
    of its own, joined first."""
    import asyncio

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600,
                                     limits=httpx.Limits(max_connections=n),
                                     headers={"Authorization": f"Bearer {STRANGER}flood"}) as http:
            r = await http.post("/datasets", json={"name": "flood", "num_samples": 1 << 22,
                                                   "shard_size": 64, "num_epochs": None,
                                                   "lease_s": 3600})
            assert r.status_code == 200, r.text[:200]
            names = [f"w{i}-{j}" if workers else f"w{i}" for j in range(n)]
            fences = {}
            for name in dict.fromkeys(names):
                r = await http.post("/datasets/flood/join", json={"worker": name})
                fences[name] = r.json()["fence"]

            async def loop(j: int) -> None:
                worker, k = names[j], [0]

                async def one() -> None:
                    k[0] += 1
                    await http.post("/datasets/flood/lease", json={
                        "worker": worker, "fence": fences[worker],
                        "request_id": f"r{j}-{k[0]}"})
                await async_rounds(stop, go, inflight, one)
            await asyncio.gather(*(loop(j) for j in range(n)))

    asyncio.run(run())


def worker_names(url: str, i: int, stop, go, inflight, n: int = 32) -> None:
    """One attacker of the worker_names case: 12 data sets of the shared token, and `n`
    connections joining a new worker name each round (leasing once with it)."""
    import asyncio

    async def run() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=600,
                                     limits=httpx.Limits(max_connections=n),
                                     headers={"Authorization": f"Bearer {STRANGER}names"}) as http:
            names = []
            for j in range(12):
                r = await http.post("/datasets", json={"name": f"names{i}-{j}",
                                                       "num_samples": 1 << 16, "shard_size": 1,
                                                       "num_epochs": None, "lease_s": 3600})
                if r.status_code == 200:
                    names.append(f"names{i}-{j}")
            count = [0]

            async def one() -> None:
                count[0] += 1
                ds, worker = names[count[0] % len(names)], f"n{i}-{count[0]}"
                r = await http.post(f"/datasets/{ds}/join", json={"worker": worker})
                if r.status_code == 200:
                    await http.post(f"/datasets/{ds}/lease", json={
                        "worker": worker, "fence": r.json()["fence"], "request_id": "r"})
            if names:
                await asyncio.gather(*(async_rounds(stop, go, inflight, one)
                                       for _ in range(n)))

    asyncio.run(run())


async def async_rounds(stop, go, inflight, one) -> None:
    """`rounds` for one of an attacker's coroutines (`one` awaited, `go` polled)."""
    import asyncio

    while not stop.is_set():
        if not go.is_set():
            await asyncio.sleep(0.1)
            continue
        with inflight.get_lock():
            inflight.value += 1
        try:
            await one()
        except (httpx.HTTPError, OSError):
            pass
        finally:
            with inflight.get_lock():
                inflight.value -= 1


FLOODS = {
    "health": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    "not_found": b"GET /no/such/route HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    "malformed": b"GET /he\x01lth HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
}


def anonymous_flood(kind: str, url: str, stop, go, inflight, n: int = 48) -> None:
    """`n` connections at a time, each sending FLOODS[kind] on a new connection and reading
    its answer to the end, in a loop."""
    import asyncio

    host, port = url.removeprefix("http://").rsplit(":", 1)

    async def one() -> None:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(FLOODS[kind])
            while await reader.read(65536):
                pass
        finally:
            writer.close()

    async def run() -> None:
        await asyncio.gather(*(async_rounds(stop, go, inflight, one) for _ in range(n)))

    asyncio.run(run())


GIVE_BACK = ("give_back", "expire", "retry_failed", "delete")


def give_back(kind: str, url: str, i: int, stop, go, inflight) -> None:
    """One attacker of the give-back cases (see the module's docstring), in a loop."""
    http = httpx.Client(base_url=url, timeout=600,
                        headers={"Authorization": f"Bearer {STRANGER}{i}"})
    name = f"{kind}{i}"
    body, workers, fences = b"", [], {}
    if kind == "delete":
        # the owner's snapshot, renamed: a data set of this attacker's own when restored
        while (r := http.get("/datasets/big/snapshot",
                             headers={"Authorization": f"Bearer {BIG}"})).status_code != 200:
            stop.wait(0.5)
        snap = r.json()
        snap["dataset"]["name"] = name
        body = json.dumps(snap).encode()
    else:
        r = http.post("/datasets", json={
            "name": name, "num_samples": 65_536, "shard_size": 1, "num_epochs": None,
            "lease_s": 0.05 if kind == "expire" else 3600,
            "max_retries": 0 if kind == "retry_failed" else 1000})
        assert r.status_code == 200, r.text[:200]
        workers = [f"w{k}" for k in range(4 if kind == "expire" else 1)]
        fences = {w: http.post(f"/datasets/{name}/join", json={"worker": w}).json()["fence"]
                  for w in workers}
    k = [0]

    def one() -> bool:
        try:
            give_back_once(kind, http, name, body, stop, workers, fences, k[0])
        finally:
            k[0] += 1
        return False
    rounds(stop, go, inflight, one)


def give_back_once(kind: str, http: httpx.Client, name: str, body: bytes, stop,
                   workers: list[str], fences: dict, k: int) -> None:
    """The `k`th round of a give-back case's attacker (see the module's docstring)."""
    if kind == "delete":
        r = http.post(f"/datasets/{name}/restore", content=body,
                      headers={"Content-Type": "application/json"})
        if r.status_code == 200:
            r = http.delete(f"/datasets/{name}")
            assert r.status_code == 200, r.text[:200]
        else:   # (503: another attacker's restore is being written)
            assert r.status_code == 503, r.text[:200]
            stop.wait(0.5)
    elif kind == "expire":
        w = workers[k % 4]
        http.post(f"/datasets/{name}/lease",
                  json={"worker": w, "fence": fences[w], "count": 256})
    else:
        w = workers[0]
        for _ in range(4):
            http.post(f"/datasets/{name}/lease",
                      json={"worker": w, "fence": fences[w], "count": 256})
        if kind == "give_back" and k % 4 == 3:
            r = http.post(f"/datasets/{name}/join", json={"worker": w})
            assert r.status_code in (200, 429), r.text[:200]
            fences[w] = r.json().get("fence", fences[w])
        else:
            r = http.post(f"/datasets/{name}/release", json={
                "worker": w, "fence": fences[w], "failure": kind == "retry_failed"})
            assert r.status_code in (200, 429), r.text[:200]
        if kind == "retry_failed":
            r = http.post(f"/datasets/{name}/retry-failed", json={})
            assert r.status_code in (200, 429), r.text[:200]


def slow_bodies(url: str, stop, go, inflight, n: int = 48) -> None:
    """`n` connections that each sent a lease's head announcing 1 MiB, then a byte a second."""
    import socket

    host, port = url.removeprefix("http://").rsplit(":", 1)
    head = (f"POST /datasets/job/lease HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer "
            f"{STRANGER}\r\nContent-Type: application/json\r\nContent-Length: 1048576"
            "\r\n\r\n").encode()
    socks: list = []
    while not stop.is_set():
        if not go.wait(0.1):
            for k in socks:
                k.close()
            socks = []
            continue
        with inflight.get_lock():
            inflight.value += 1
        try:
            alive = []
            for k in socks:
                try:
                    k.send(b" ")
                    alive.append(k)
                except OSError:
                    k.close()
            while len(alive) < n:
                try:
                    k = socket.create_connection((host, int(port)), timeout=5)
                    k.setblocking(False)
                    k.send(head)
                    alive.append(k)
                except OSError:
                    break
            socks = alive
        finally:
            with inflight.get_lock():
                inflight.value -= 1
        stop.wait(1.0)
    for k in socks:
        k.close()


def wait_for(db: Path, query: str, present: bool = True, timeout: float = 600.0) -> None:
    """Until `query` finds a row (or none, `present` False) in the service's database."""
    import sqlite3

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with sqlite3.connect(db, timeout=60) as c:
            if (c.execute(query).fetchone() is not None) == present:
                return
        time.sleep(0.2)
    raise SystemExit(f"{query}: not {'found' if present else 'gone'} within {timeout} s")


def wait_for_staged_rows(db: Path) -> None:
    """Until a restore's rows are being written (its body was sent and parsed first)."""
    wait_for(db, "SELECT 1 FROM row_sets WHERE state='writing' LIMIT 1")


def restore_alone(url: str) -> float:
    """Seconds one restore of the 655,360-row snapshot takes, nothing else running."""
    http = httpx.Client(base_url=url, timeout=600)
    body = http.get("/datasets/big/snapshot", headers={"Authorization": f"Bearer {BIG}"}).content
    while True:
        t0 = time.perf_counter()
        r = http.post("/datasets/big/restore", content=body,
                      headers={"Authorization": f"Bearer {BIG}",
                               "Content-Type": "application/json"})
        if r.status_code == 200:
            return time.perf_counter() - t0
        time.sleep(1.0)   # an attacker's restore still being written


def drain(q) -> list[float]:
    out = []
    while not q.empty():
        out.append(q.get())
    return out


def measure(url: str, leases: int, probe: Probe | None = None,
            block: Block | None = None) -> list[float]:
    """`leases` lease + ack round trips of the measured job; their latencies (s)."""
    client = ShardClient(url, "job", "w", token=JOB)
    out = []

    def one():
        lease = client.lease().lease
        assert lease is not None
        client.ack(lease.epoch, lease.shard, lease.size)

    for _ in range(leases):
        if probe is None:
            t = time.perf_counter()
            one()
            out.append(time.perf_counter() - t)
            continue
        lat, rq = timed(probe, one)
        out.append(lat)
        if block is not None:
            block.lat.append(lat)
            block.rq.append(rq)
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_case(kind: str, url: str, db: Path, pid: int, args) -> dict:
    """Quiet and attacked blocks of `--leases / --blocks` lease + ack round trips, alternated
    (the attackers paused, then let go): this machine's other load drifts by the minute, so a
    quiet run taken once before the attack compared blocks of different minutes."""
    stop, go, done = mp.Event(), mp.Event(), mp.Queue()
    inflight = mp.Value("i", 0)
    procs = [mp.Process(target=attack, args=(kind, url, i, stop, go, inflight, done),
                        daemon=True) for i in range(args.attackers)]
    for p in procs:
        p.start()
    n = max(1, args.leases // args.blocks)
    probe = Probe(pid)
    quiet: list[Block] = []
    attacked: list[Block] = []
    attackers = spent = 0.0
    started = False
    try:
        for b in range(args.blocks):
            for which in order(b):
                block = Block()
                if which == "q":
                    go.clear()
                    deadline = time.monotonic() + 120
                    while inflight.value and time.monotonic() < deadline:
                        time.sleep(0.05)   # the attack's requests under way finish first
                else:
                    go.set()
                    time.sleep(1.0 if started else 3.0)   # the attack under way again
                    if kind == "owner_restore" and not started:
                        wait_for_staged_rows(db)
                    started = True
                pids = [pid] + [p.pid for p in procs]
                before, t0 = [cpu_s(x) for x in pids], time.perf_counter()
                io0 = disk_bytes(pid)
                measure(url, n, probe, block)
                took = time.perf_counter() - t0
                after = [cpu_s(x) for x in pids]
                block.cores = (after[0] - before[0]) / took
                block.disk_mb_s = (disk_bytes(pid) - io0) / took / 1e6
                if which == "a":
                    attackers += sum(after[1:]) - sum(before[1:])
                    spent += took
                    attacked.append(block)
                else:
                    quiet.append(block)
    finally:
        stop.set()
        go.set()
        restores = drain(done)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    row = measured(quiet, attacked)
    row.update(attacker_cores=attackers / max(spent, 1e-9), restores_s=restores)
    print(line(kind, row) + f"; attackers {row['attacker_cores']:.2f} cores"
          + (f"; restores whole: {', '.join(f'{x:.1f} s' for x in restores)}"
             if restores else ""), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leases", type=int, default=320)
    ap.add_argument("--attackers", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=8, help="quiet/attacked block pairs per case")
    ap.add_argument("--cases", default="snapshot,status,shuffle,restore,owner_restore,"
                                       "big_lease,bad_input,control_reports,slow_bodies,owner_flood,"
                                       "worker_flood,worker_names,give_back,expire,retry_failed,delete,"
                                       "health,not_found,malformed")
    ap.add_argument("--name", default=None,
                    help="results/<name>.json (default: the script's name)")
    ap.add_argument("--attacker-nice", type=int, default=19,
                    help="the attackers' niceness (0: they take CPU as the job does; on a busy"
                         " machine at 19 they may hardly run)")
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="a setting of the service's config (repeatable), e.g."
                         " requests_per_token_s=50")
    args = ap.parse_args()
    SERVICE_SETS[:] = args.set
    NICE[0] = args.attacker_nice
    ATTACKERS[0] = args.attackers
    tmp = Path(tempfile.mkdtemp(prefix="adapt-dos-"))
    db = tmp / "shards.db"
    t = time.perf_counter()
    big_db(db)
    print(f"setup: 655,360-row data set in {time.perf_counter() - t:.1f} s")
    proc, url = start_service(db)
    try:
        job = ShardClient(url, "job", "w", token=JOB)
        job.create_dataset(DatasetConfig("job", 500_000, 10, num_epochs=None))
        job.join()
        measure(url, 20)   # warm (its shuffle, connections)
        rows = {}
        for kind in args.cases.split(","):
            rows[kind] = run_case(kind, url, db, proc.pid, args)
            # an attack of anonymous requests (a flood, a stranger's restores) leaves
            # loopback's anonymous turns spent up to the pace's longest wait ahead: the next
            # case's first (anonymous) creation or restore would be refused 429
            time.sleep(ANONYMOUS_MAX_WAIT_S + 2)
        alone = None
        if "owner_restore" in args.cases.split(","):
            t = time.perf_counter()
            wait_for(db, "SELECT 1 FROM row_sets LIMIT 1", present=False)
            print(f"the attack's replaced rows deleted {time.perf_counter() - t:.1f} s later")
            alone = restore_alone(url)
            print(f"one 655,360-row restore alone: {alone:.1f} s (paced)")
        print(json.dumps({"cases": rows, "cpus": os.cpu_count(), "restore_alone_s": alone}))
        write(Run(benchmark="Shard service lease latency under DoS", issue="34",
                  command=f".venv/bin/python benchmarks/adapt_dos.py --leases {args.leases} "
                          f"--blocks {args.blocks} --attackers {args.attackers} "
                          f"--cases {args.cases} --attacker-nice {args.attacker_nice}"
                          + "".join(f" --set {pair}" for pair in args.set)
                          + (f" --name {args.name}" if args.name else ""),
                  figures=figures(rows, "lease + ack latency"),
                  note=f"{os.cpu_count()} CPUs; {args.blocks} alternated quiet/attacked "
                       f"block pairs of {max(1, args.leases // args.blocks)} round trips"
                       + (f"; one 655,360-row restore alone {alone:.1f} s" if alone else "")),
              args.name)
    finally:
        proc.terminate()   # (a restore under way is finished first)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)   # the 655,360-row database: ~400 MB a run


if __name__ == "__main__":
    main()
