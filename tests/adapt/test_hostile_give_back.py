"""Shards given back on the commit thread (issue 34): a release or join of many held shards,
expired leases, retry-failed and deleted rows, each in bounded steps."""

from __future__ import annotations

import threading

import httpx

from stragglers.adapt.requeues import GIVE_BACK_STEP
from stragglers.adapt.service import EmbeddedServer

OWNER = "owner-token-0123456789"
HELD = 1024   # what a worker may hold (max_held_per_worker)


class Requeues:
    """Requeue UPDATEs of shard rows per transaction on the store's write connection (SQLite's
    trace of the statements it runs: BEGIN ... COMMIT)."""

    def __init__(self, conn):
        self.per_tx: list[int] = []
        self._n = 0
        self._lock = threading.Lock()
        conn.set_trace_callback(self._trace)

    def _trace(self, sql: str) -> None:
        with self._lock:
            if sql.startswith("BEGIN"):
                self._n = 0
            elif sql.startswith("UPDATE shards SET state=") and "worker=NULL" in sql:
                self._n += 1
            elif sql.startswith(("COMMIT", "ROLLBACK")):
                self.per_tx.append(self._n)


def held_worker(http: httpx.Client, name: str) -> int:
    """A data set whose worker `w` holds HELD shards; its fence."""
    r = http.post("/datasets", json={"name": name, "num_samples": 4 * HELD, "shard_size": 1,
                                     "lease_s": 3600, "max_retries": 1000})
    assert r.status_code == 200, r.text
    fence = http.post(f"/datasets/{name}/join", json={"worker": "w"}).json()["fence"]
    for _ in range(HELD // 256):
        r = http.post(f"/datasets/{name}/lease", json={"worker": "w", "fence": fence,
                                                       "count": 256})
        assert len(r.json()["leases"]) == 256, r.text[:200]
    return fence


def test_a_release_or_join_of_many_held_shards_gives_them_back_in_bounded_steps(tmp_path):
    # (fails before: a worker's release, or its next join, requeued every shard it held in
    # one transaction: 1,024 requeued beside the other calls of their batch, which waited
    # for all of them; five tokens doing so in a loop held another job's lease + ack at 29x
    # its quiet latency)
    srv = EmbeddedServer(tmp_path / "s.db").start()
    try:
        http = httpx.Client(base_url=srv.url, timeout=60,
                            headers={"Authorization": f"Bearer {OWNER}"})
        trace = Requeues(srv.app.state.store._conn)
        for how in ("release", "release-unfenced", "join"):
            fence = held_worker(http, how)
            trace.per_tx.clear()
            if how == "join":
                r = http.post(f"/datasets/{how}/join", json={"worker": "w"})
            else:
                body = {"worker": "w", "failure": False}
                if how == "release":
                    body["fence"] = fence
                r = http.post(f"/datasets/{how}/release", json=body)
            assert r.status_code == 200, r.text
            released = sorted(map(tuple, r.json()["released"]))
            assert len(released) == HELD and len(set(released)) == HELD, how
            assert sum(trace.per_tx) == HELD, how
            assert max(trace.per_tx) <= GIVE_BACK_STEP, (how, max(trace.per_tx))
            counts = http.get(f"/datasets/{how}/status").json()["epochs"]["0"]
            assert counts.get("DOING", 0) == 0 and counts["TODO"] == 4 * HELD, (how, counts)
        srv.app.state.store._conn.set_trace_callback(None)
    finally:
        srv.stop()


def test_a_heavy_keys_calls_are_paced_and_light_ones_run_between(tmp_path):
    # (fails before: a batch took up to 8 calls of every key in turns, heavy or not: five
    # tokens leasing 1,024 shards and giving them back in a loop put five such calls, ~15 ms
    # each, in every batch, and another job's lease waited for all of them, 5x quiet)
    import asyncio

    from stragglers.adapt.dataset import DatasetConfig
    from stragglers.adapt.service import GroupCommitter
    from stragglers.adapt.shards import ShardStore

    store = ShardStore(tmp_path / "s.db")
    store.create_dataset(DatasetConfig("d", 4 * HELD, 1, lease_s=3600, max_retries=1000))
    store.create_dataset(DatasetConfig("j", 100, 1))
    commit = GroupCommitter(store)
    order: list[str] = []
    batches: dict[str, int] = {}

    def heavy(tag: str, fence: int):
        def call():   # (1,024 shards leased and given back: ~10 ms of CPU anywhere)
            order.append(tag)
            batches[tag] = commit.batches
            for _ in range(HELD // 256):
                store.lease("d", "a", fence, count=256)
            store.release("d", "a", fence, failure=False)
        return call

    def light(tag: str, fence: int):
        def call():
            order.append(tag)
            batches[tag] = commit.batches
            store.lease("j", "b", fence)
        return call

    async def main() -> None:
        fa = await commit.run(lambda: store.join("d", "a").fence, "A")
        fb = await commit.run(lambda: store.join("j", "b").fence, "B")
        await commit.run(heavy("A0", fa), "A")   # A is heavy from now on
        started, gate = threading.Event(), threading.Event()
        blocked = asyncio.ensure_future(commit.run(
            lambda: (started.set(), gate.wait(60)), "G"))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 60)
        # queued while the writer is busy: A's two heavy calls, then B's two light ones
        calls = [asyncio.ensure_future(commit.run(fn, key)) for fn, key in (
            (heavy("A1", fa), "A"), (heavy("A2", fa), "A"), (light("B1", fb), "B"),
            (light("B2", fb), "B"))]
        await asyncio.sleep(0)   # (each task queued its call)
        gate.set()
        await asyncio.wait_for(asyncio.gather(blocked, *calls), 120)

    try:
        asyncio.run(main())
        assert order.index("A2") > order.index("B2"), order   # B's ran before A's second
        assert batches["A2"] > batches["A1"]          # never two heavy calls in one batch
        assert batches["B1"] == batches["B2"]         # light calls are not held
    finally:
        commit.close()
        store.close()
