"""Shard-service throughput: leases/s with durable (fsynced) commits, over HTTP and in-process.

    .venv/bin/python benchmarks/adapt_shards.py [--seconds 5] [--clients 4]

Side by side in one run: the store alone (with and without fsync), the bare HTTP round trip
(/health), and one-shard leases on uvicorn's pure-Python stack (h11 + asyncio, the baseline)
against httptools + uvloop (the service's default), then 16 and 64 shards per request (a
worker prefetching), counted per shard. Each client is a separate process with a keep-alive
connection, its own worker name and the job's token. Goals (issue 12): >= 2,000 leases/s
durable with one shard per request, >= 10,000/s batched.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import tempfile
import time
from pathlib import Path

from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.service import EmbeddedServer, ServiceConfig
from stragglers.adapt.shards import ShardStore

SHARD = 64
SHARDS = 60_000
TOKEN = "benchmark-token-0123456789"


def store_rate(db: Path, durable: bool, seconds: float) -> float:
    store = ShardStore(db, durable=durable)
    store.create_dataset(DatasetConfig("bench", SHARD * SHARDS, SHARD, num_epochs=None))
    fence = store.join("bench", "w")["fence"]
    store.lease("bench", "w", fence)  # computes and caches the epoch's permutation
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        lease = store.lease("bench", "w", fence)["leases"][0]
        store.ack("bench", "w", fence, lease["epoch"], lease["shard"], lease["size"])
        n += 1
    store.close()
    return n / (time.perf_counter() - start)


def _client(url: str, worker: str, op: str, seconds: float, start_at: float, out) -> None:
    client = ShardClient(url, "bench", worker, token=TOKEN)
    client.join()
    while time.time() < start_at:
        time.sleep(0.001)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if op == "health":
            client._call("GET", "/health")
            n += 1
        else:
            count = int(op.split("*")[1]) if "*" in op else 1
            n += len(client.lease(count=count)["leases"])
    out.put(n / (time.perf_counter() - t0))


def http_rate(db: Path, config: ServiceConfig, op: str, clients: int, seconds: float) -> float:
    # The server runs in its own process so its GIL is not shared with the clients.
    ctx = mp.get_context("spawn")
    stop, port_q = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_serve, args=(str(db), config, port_q, stop))
    proc.start()
    url = port_q.get(timeout=120)
    setup = ShardClient(url, "bench", "setup", token=TOKEN)
    setup.create_dataset(DatasetConfig("bench", SHARD * SHARDS, SHARD, num_epochs=None))
    setup.lease()  # computes and caches the epoch's permutation
    out = ctx.Queue()
    start_at = time.time() + 3.0
    workers = [ctx.Process(target=_client, args=(url, f"w{i}", op, seconds, start_at, out))
               for i in range(clients)]
    for w in workers:
        w.start()
    rates = [out.get(timeout=seconds + 300) for _ in workers]
    for w in workers:
        w.join()
    stop.set()
    proc.join(timeout=30)
    return sum(rates)


def _serve(db: str, config: ServiceConfig, port_q, stop) -> None:
    server = EmbeddedServer(db, config=config).start()
    port_q.put(server.url)
    stop.wait()
    server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=4)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="adapt-bench-"))
    lean = ServiceConfig(port=0)
    baseline = lean.replace(http="h11", loop="asyncio")
    r = {"cpus": os.cpu_count(), "clients": args.clients}
    r["store_durable_lease+ack_per_s"] = store_rate(tmp / "s1.db", True, args.seconds)
    r["store_nondurable_lease+ack_per_s"] = store_rate(tmp / "s2.db", False, args.seconds)
    r["http_health_per_s"] = http_rate(tmp / "h0.db", lean, "health", args.clients, args.seconds)
    r["http_h11_asyncio_durable_leases_per_s"] = http_rate(tmp / "h1.db", baseline, "lease",
                                                           args.clients, args.seconds)
    r["http_durable_leases_per_s"] = http_rate(tmp / "h2.db", lean, "lease", args.clients,
                                               args.seconds)
    r["http_nondurable_leases_per_s"] = http_rate(tmp / "h3.db", lean.replace(durable=False),
                                                  "lease", args.clients, args.seconds)
    r["http_durable_leases_per_s_16_per_request"] = http_rate(tmp / "h4.db", lean, "lease*16",
                                                              args.clients, args.seconds)
    r["http_durable_leases_per_s_64_per_request"] = http_rate(tmp / "h5.db", lean, "lease*64",
                                                              args.clients, args.seconds)
    r["lean_over_baseline"] = r["http_durable_leases_per_s"] / r["http_h11_asyncio_durable_leases_per_s"]
    r["goal_met_one_per_request_2000"] = r["http_durable_leases_per_s"] >= 2000
    r["goal_met_batched_10000"] = max(r["http_durable_leases_per_s_16_per_request"],
                                      r["http_durable_leases_per_s_64_per_request"]) >= 10_000
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in r.items()},
                     indent=1))


if __name__ == "__main__":
    main()
