"""Shard-service throughput: leases/s with durable (fsynced) commits, over HTTP and in-process.

    .venv/bin/python benchmarks/adapt_shards.py [--seconds 5] [--clients 4]

Baselines side by side in the same run: the same store without fsync (synchronous=NORMAL) and
the bare HTTP round trip (/health), so the cost of durability and of HTTP are both visible.
Each client is a separate process with a keep-alive connection doing lease (or lease+ack)
calls; the last row leases 16 shards per request (a worker prefetching), counted per shard.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import tempfile
import time
from pathlib import Path

from stragglers.adapt.client import ShardClient
from stragglers.adapt.service import EmbeddedServer
from stragglers.adapt.shards import DatasetConfig, ShardStore

SHARD = 64


def store_rate(db: Path, durable: bool, seconds: float) -> float:
    store = ShardStore(db, durable=durable)
    store.create_dataset(DatasetConfig("bench", SHARD * 40_000, SHARD))
    store.lease("bench", "warm-up")  # computes and caches the epoch's permutation
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        lease = store.lease("bench", "w")["lease"]
        store.ack("bench", "w", lease["epoch"], lease["shard"], lease["size"])
        n += 1
    store.close()
    return n / (time.perf_counter() - start)


def _client(url: str, worker: str, op: str, seconds: float, start_at: float, out) -> None:
    client = ShardClient(url, "bench", worker)
    while time.time() < start_at:
        time.sleep(0.001)
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        if op == "health":
            client._call("GET", "/health")
        elif op.startswith("lease*"):
            k = int(op[6:])
            got = len(client.lease(count=k)["leases"])
            n += got - 1
        else:
            lease = client.lease()["lease"]
            if op == "lease+ack":
                client.ack(lease["epoch"], lease["shard"], lease["size"])
        n += 1
    out.put(n / (time.perf_counter() - t0))


def http_rate(db: Path, durable: bool, op: str, clients: int, seconds: float) -> float:
    # The server runs in its own process so its GIL is not shared with the clients.
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    port_q = ctx.Queue()
    proc = ctx.Process(target=_serve, args=(str(db), durable, port_q, stop))
    proc.start()
    url = port_q.get(timeout=60)
    setup = ShardClient(url, "bench", "setup")
    setup.create_dataset(DatasetConfig("bench", SHARD * 40_000, SHARD))
    setup.lease()  # computes and caches the epoch's permutation
    out = ctx.Queue()
    start_at = time.time() + 2.0
    workers = [ctx.Process(target=_client, args=(url, f"w{i}", op, seconds, start_at, out))
               for i in range(clients)]
    for w in workers:
        w.start()
    rates = [out.get(timeout=seconds + 120) for _ in workers]
    for w in workers:
        w.join()
    stop.set()
    proc.join(timeout=10)
    return sum(rates)


def _serve(db: str, durable: bool, port_q, stop) -> None:
    server = EmbeddedServer(db, durable=durable).start()
    port_q.put(server.url)
    stop.wait()
    server.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=4)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="adapt-bench-"))
    results = {}
    results["store_durable_lease+ack_per_s"] = store_rate(tmp / "s1.db", True, args.seconds)
    results["store_nondurable_lease+ack_per_s"] = store_rate(tmp / "s2.db", False, args.seconds)
    results["http_health_per_s"] = http_rate(tmp / "h0.db", True, "health", args.clients, args.seconds)
    results["http_durable_leases_per_s"] = http_rate(tmp / "h1.db", True, "lease", args.clients, args.seconds)
    results["http_durable_lease+ack_per_s"] = http_rate(tmp / "h2.db", True, "lease+ack", args.clients,
                                                        args.seconds)
    results["http_nondurable_leases_per_s"] = http_rate(tmp / "h3.db", False, "lease", args.clients,
                                                        args.seconds)
    results["http_durable_leases_per_s_16_per_request"] = http_rate(tmp / "h4.db", True, "lease*16",
                                                                   args.clients, args.seconds)
    results["goal_leases_per_s"] = 2000
    results["goal_met_one_per_request"] = results["http_durable_leases_per_s"] >= 2000
    results["goal_met_16_per_request"] = results["http_durable_leases_per_s_16_per_request"] >= 2000
    print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in results.items()},
                     indent=1))


if __name__ == "__main__":
    main()
