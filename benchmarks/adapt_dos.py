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
  attackers are answered 503 Busy).

Each case alternates `--blocks` quiet and attacked blocks (the attackers paused between them),
and its row is the median of the attacked blocks over that of the quiet ones (goal: <= 2x),
with each block pair's own ratio, and the CPU the service and the attackers used while
attacking (cores, /proc) beside the machine's load average.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.shards import ShardStore

JOB, BIG = "job-token-0123456789abcdef", "big-owner-token-0123456789"
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
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.cli", "adapt", "serve", "--db",
                             str(db), "--port", "0"], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    url = line.split(" on ", 1)[1].split(" ", 1)[0]
    return proc, url


def attack(kind: str, url: str, i: int, stop, go, inflight, done=None) -> None:
    """One attacker process: `kind` in a loop while `go` is set (paused between the measured
    blocks; `inflight` counts its requests under way, so a quiet block starts without any)."""
    http = httpx.Client(base_url=url, timeout=600)
    if kind == "shuffle":
        client = ShardClient(url, f"huge{i}", "w", token=f"{STRANGER}{i}", timeout_s=600)
        client.create_dataset(DatasetConfig(f"huge{i}", 1 << 26, 1024, num_epochs=None,
                                            seed=i))
        client.join()
    body = b'{"dataset":' + b" " * 60_000_000 + b"}"
    if kind == "owner_restore":
        body = http.get("/datasets/big/snapshot").content
    while not stop.is_set():
        if not go.wait(0.1):
            continue
        with inflight.get_lock():
            inflight.value += 1
        try:
            t0 = time.perf_counter()
            if once(kind, http, body) and done is not None:
                done.put(time.perf_counter() - t0)
        except httpx.HTTPError:
            pass   # the service may cut a refused upload short
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
                  headers={"Authorization": f"Bearer {STRANGER}"})
    elif kind == "owner_restore":
        r = http.post("/datasets/big/restore", content=body,
                      headers={"Authorization": f"Bearer {BIG}"})
        assert r.status_code in (200, 503), r.text[:200]
        return r.status_code == 200
    return False


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
                      headers={"Authorization": f"Bearer {BIG}"})
        if r.status_code == 200:
            return time.perf_counter() - t0
        time.sleep(1.0)   # an attacker's restore still being written


def drain(q) -> list[float]:
    out = []
    while not q.empty():
        out.append(q.get())
    return out


def measure(url: str, leases: int) -> list[float]:
    client = ShardClient(url, "job", "w", token=JOB)
    out = []
    for _ in range(leases):
        t = time.perf_counter()
        got = client.lease()
        lease = got["lease"]
        client.ack(lease["epoch"], lease["shard"], lease["size"])
        out.append(time.perf_counter() - t)
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summary(xs: list[float]) -> tuple[float, float]:
    xs = sorted(xs)
    return statistics.median(xs) * 1e3, xs[int(0.95 * (len(xs) - 1))] * 1e3


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
    quiet, loaded, blocks = [], [], []
    service = attackers = spent = 0.0
    try:
        for b in range(args.blocks):
            go.clear()
            deadline = time.monotonic() + 120
            while inflight.value and time.monotonic() < deadline:
                time.sleep(0.05)   # the attack's requests under way finish first
            q = measure(url, n)
            go.set()
            time.sleep(3.0 if b == 0 else 1.0)   # the attack under way again
            if kind == "owner_restore" and b == 0:
                wait_for_staged_rows(db)
            pids = [pid] + [p.pid for p in procs]
            before, t0 = [cpu_s(x) for x in pids], time.perf_counter()
            got = measure(url, n)
            took = time.perf_counter() - t0
            after = [cpu_s(x) for x in pids]
            service += after[0] - before[0]
            attackers += sum(after[1:]) - sum(before[1:])
            spent += took
            quiet += q
            loaded += got
            blocks.append(statistics.median(got) / statistics.median(q))
    finally:
        stop.set()
        go.set()
        restores = drain(done)
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    qs, ls = summary(quiet), summary(loaded)
    row = {"quiet_ms": qs, "loaded_ms": ls, "ratio": ls[0] / qs[0], "blocks": blocks,
           "service_cores": service / spent, "attacker_cores": attackers / spent,
           "load": os.getloadavg()[0], "restores_s": restores}
    print(f"{kind:<13} {qs[0]:>9.2f} {ls[0]:>10.2f} {qs[1]:>10.2f} {ls[1]:>11.2f}"
          f" {ls[0] / qs[0]:>6.2f} {min(blocks):>7.2f}-{max(blocks):<7.2f}"
          f" {row['service_cores']:>8.2f} {row['attacker_cores']:>10.2f} {row['load']:>5.1f}"
          + (f"   restores whole: {', '.join(f'{x:.1f} s' for x in restores)}"
             if restores else ""), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--leases", type=int, default=300)
    ap.add_argument("--attackers", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=4, help="quiet/attacked block pairs per case")
    ap.add_argument("--cases", default="snapshot,status,shuffle,restore,owner_restore")
    args = ap.parse_args()
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
        print(f"{'case':<13} {'quiet ms':>9} {'loaded ms':>10} {'p95 quiet':>10}"
              f" {'p95 loaded':>11} {'ratio':>6} {'per block':>16} {'service':>8}"
              f" {'attackers':>10} {'load':>5}")
        rows = {}
        for kind in args.cases.split(","):
            rows[kind] = run_case(kind, url, db, proc.pid, args)
        alone = None
        if "owner_restore" in args.cases.split(","):
            t = time.perf_counter()
            wait_for(db, "SELECT 1 FROM row_sets LIMIT 1", present=False)
            print(f"the attack's replaced rows deleted {time.perf_counter() - t:.1f} s later")
            alone = restore_alone(url)
            print(f"one 655,360-row restore alone: {alone:.1f} s (paced)")
        print(json.dumps({"cases": rows, "cpus": os.cpu_count(), "restore_alone_s": alone}))
    finally:
        proc.terminate()   # (a restore under way is finished first)
        try:
            proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    main()
