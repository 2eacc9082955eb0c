"""Work one caller starts that others wait on (session 50, issue 34): another token's big shuffle
holds no job's lease, a shared status/snapshot build runs in whichever caller's turn comes
first, and the owner's own first call after a restart checks its rows off the commit thread.
Ordered by events (a shuffle or the reader held), not timed."""

from __future__ import annotations

import asyncio
import sqlite3
import threading

import httpx
import numpy as np
import pytest

from stragglers.adapt import reads
from stragglers.adapt.dataset import DatasetConfig, epoch_permutation
from stragglers.adapt.permutations import Permutations
from stragglers.adapt.service import EmbeddedServer, token_digest
from stragglers.adapt.shards import ShardStore

HOSTILE, JOB = "hostile-s50-shuffle-token-0123456789", "job-s50-shuffle-token-0123456789"
BIG = (1 << 20) + 1   # samples: a big shuffle (over 2**20), ~40 ms


class _HeldShuffle(Permutations):
    """Permutations whose computation of seed `held_seed` waits for `go` (after `entered`)."""

    def __init__(self, held_seed: int):
        super().__init__()
        self.held_seed, self.entered, self.go = held_seed, threading.Event(), threading.Event()

    def get(self, key):
        if key[1] == self.held_seed and not self.go.is_set():
            self.entered.set()
            self.go.wait(60)
        return super().get(key)


def _own(c: httpx.Client, name: str, seed: int) -> int:
    r = c.post("/datasets", json={"name": name, "num_samples": BIG, "shard_size": 4096,
                                  "seed": seed})
    assert r.status_code == 200, r.text
    return c.post(f"/datasets/{name}/join", json={"worker": "w"}).json()["fence"]


def test_another_tokens_big_shuffle_under_way_holds_no_jobs_lease(tmp_path):
    """H's lease needs a big shuffle, held while computed; job V's first lease (its own big
    shuffle) is answered meanwhile, with its epoch's indices. Before: both on the one
    `shard-shuffles-big` thread, V's behind H's (a 2**26 one: 5 s), answered only once H's
    ended. Each token is charged its shuffles' CPU time (PacedKeys)."""
    server = EmbeddedServer(tmp_path / "s.db", durable=False).start()
    store = server.app.state.store
    store.permutations = held = _HeldShuffle(held_seed=7)
    out: dict = {}
    try:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {HOSTILE}"}) as h, \
                httpx.Client(base_url=server.url, timeout=30,
                             headers={"Authorization": f"Bearer {JOB}"}) as v:
            fh, fv = _own(h, "h", 7), _own(v, "v", 1)
            t = threading.Thread(target=lambda: out.setdefault("h", h.post(
                "/datasets/h/lease", json={"worker": "w", "fence": fh})))
            t.start()
            assert held.entered.wait(60), "H's shuffle never started"
            try:
                r = v.post("/datasets/v/lease", json={"worker": "w", "fence": fv})
                assert not held.go.is_set()   # (H's shuffle still held when V is answered)
            finally:
                held.go.set()
                t.join(60)
        assert r.status_code == 200, r.text
        lease = r.json()["leases"][0]
        start = lease["shard"] * 4096 + lease["offset"]
        perm = epoch_permutation(BIG, 1, lease["epoch"])
        assert lease["indices"] == perm[start:(lease["shard"] + 1) * 4096].tolist()
        assert out["h"].status_code == 200, out["h"].text
        charged = server.app.state.shuffling.charged
        assert set(charged) == {token_digest(HOSTILE), token_digest(JOB)}, charged
    finally:
        held.go.set()
        server.stop()


def test_a_tokens_big_shuffles_run_one_at_a_time_each_charged_its_cpu(tmp_path):
    """PacedKeys: a key's second call starts once its first ended, another key's runs beside
    them; a call ended, its key's next one is due (its CPU time) x 3 later (share 0.25)."""
    from concurrent.futures import ThreadPoolExecutor

    from stragglers.adapt.turns import PacedKeys

    now = [100.0]
    pool = ThreadPoolExecutor(2, thread_name_prefix="shard-shuffles-test")
    paced = PacedKeys(pool, 0.25, clock=lambda: now[0])
    first, order = threading.Event(), []

    def call(name, wait=None):
        order.append(f"{name} starts")
        if wait is not None:
            wait.wait(60)
        np.random.default_rng(0).permutation(1 << 18)   # (some CPU to charge)
        order.append(f"{name} ends")
        return name

    async def main():
        a1 = asyncio.ensure_future(paced.run("A", call, "a1", first))
        a2 = asyncio.ensure_future(paced.run("A", call, "a2"))
        b = asyncio.ensure_future(paced.run("B", call, "b"))
        assert await asyncio.wait_for(b, 60) == "b"   # (A's first still held)
        assert order == ["a1 starts", "b starts", "b ends"] and not a2.done()
        first.set()
        assert await asyncio.wait_for(a1, 60) == "a1"
        due = paced._due["A"] - now[0]   # (the clock still: A's pause after a1 not over)
        assert paced.charged["A"] > 0 and due == pytest.approx(3 * paced.charged["A"])
        now[0] += due   # (its pause over)
        assert await asyncio.wait_for(a2, 60) == "a2"
        assert order.index("a2 starts") > order.index("a1 ends")

    try:
        asyncio.run(main())
    finally:
        first.set()
        pool.shutdown(wait=True)


def test_a_shared_build_runs_in_the_first_turn_of_any_of_its_callers(tmp_path):
    """The reader held; S queues two reads of its own (the second held), then the snapshot of
    v; V asks the same snapshot (the same build). V's turn comes after S's first read: the
    build runs there, before S's second read. Before: the build was S's third read, V waiting
    for all of S's (counted: no snapshot built when S's second read starts)."""
    db = tmp_path / "s.db"
    store = ShardStore(db)
    store.create_dataset(DatasetConfig("v", 4096, 64))
    store.close()
    reader = reads.ReadSide(str(db), lambda name: 0, max_queued=8)
    held, second = threading.Event(), threading.Event()
    built_before_second: list[int] = []

    async def keyed(key, call):
        reads.READ_KEY.set(key)
        return await call()

    def s2(conn):
        built_before_second.append(reader.computed)
        return second.wait(60)

    async def main():
        blocker = reader.submit(lambda conn: held.wait(60))   # (in no turn: the thread held)
        s = [asyncio.ensure_future(keyed("S", lambda: reader.read(lambda conn: "s1"))),
             asyncio.ensure_future(keyed("S", lambda: reader.read(s2))),
             asyncio.ensure_future(keyed("S", lambda: reader.snapshot("v")))]
        await asyncio.sleep(0)
        v = asyncio.ensure_future(keyed("V", lambda: reader.snapshot("v")))
        for _ in range(100):   # (V's own turn queued, where it takes one)
            await asyncio.sleep(0)
            if "V" in reader._turns._waiting:
                break
        held.set()
        body = await asyncio.wait_for(v, 60)
        second.set()
        assert await asyncio.wait_for(s[2], 60) == body   # (the same build)
        assert [await x for x in s[:2]] == ["s1", True] and blocker.result(60) is True
        assert b'"name":"v"' in body and reader.computed == 1
        assert reader._queued == 0 and not reader._flights

    try:
        asyncio.run(main())
    finally:
        held.set()
        second.set()
        reader.close()
    assert built_before_second == [1], "S's second read ran before the build V waits for"


SCAN = "FROM shards WHERE dataset='big' AND NOT COALESCE"
OWNER = "owner-s50-verify-token-0123456789"


def _restarted_first_join(db, damage: bool):
    """Data set 'big' made and leased, the service restarted (`damage`: a shard row made
    invalid meanwhile), the owner's first call a join: (its answer, the SQL the commit
    connection ran for it: (thread, statement))."""
    server = EmbeddedServer(db, durable=False).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {OWNER}"}) as c:
            r = c.post("/datasets", json={"name": "big", "num_samples": 4096, "shard_size": 64})
            assert r.status_code == 200, r.text
            fence = c.post("/datasets/big/join", json={"worker": "w"}).json()["fence"]
            assert c.post("/datasets/big/lease", json={"worker": "w", "fence": fence}
                          ).status_code == 200
    finally:
        server.stop()
    if damage:
        with sqlite3.connect(db) as conn:
            conn.execute("UPDATE shards SET consumed=-5 WHERE dataset='big' AND shard=("
                         "SELECT MAX(shard) FROM shards WHERE dataset='big')")
    server = EmbeddedServer(db, durable=False).start()
    seen: list[tuple[str, str]] = []
    conn = server.app.state.store._conn
    conn.set_trace_callback(lambda sql: seen.append((threading.current_thread().name, sql)))
    try:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {OWNER}"}) as c:
            return c.post("/datasets/big/join", json={"worker": "v"}), seen
    finally:
        conn.set_trace_callback(None)
        server.stop()


def test_the_owners_first_call_after_a_restart_checks_its_rows_off_the_commit_thread(
        tmp_path):
    """After a restart the owner's own first call (a join) is answered without its data set's
    rows scanned on the commit connection (before: scanned there, every other job's calls
    waiting; a 655,360-row data set 0.8 s); a damaged row found so is 503 Quarantined, and
    nothing written (no worker 'v')."""
    r, seen = _restarted_first_join(tmp_path / "s.db", damage=False)
    assert r.status_code == 200, r.text
    assert not [s for _, s in seen if SCAN in s], "the writer scanned 'big'"
    r, seen = _restarted_first_join(tmp_path / "d.db", damage=True)
    assert r.status_code == 503 and r.json()["kind"] == "Quarantined", r.text
    assert not [s for _, s in seen if SCAN in s], "the writer scanned 'big'"
    with sqlite3.connect(tmp_path / "d.db") as conn:
        assert conn.execute("SELECT COUNT(*) FROM workers WHERE worker='v'").fetchone() == (0,)
