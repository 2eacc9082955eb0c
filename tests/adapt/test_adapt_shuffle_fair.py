"""The reader thread takes the service's reads in turns by caller (reads.READ_KEY, the
shuffle threads' turns.TakeTurns): a job's first lease of a data set reads the data set's limits
there, and waited for every snapshot build other clients had queued. Ordered by events (the
thread held), not timed."""

from __future__ import annotations

import asyncio
import threading

from adapt_jobs import held_reader
from conftest import eventually
from stragglers.adapt import reads
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.shards import ShardStore


def test_a_read_of_another_key_goes_before_a_keys_next_read(tmp_path):
    """The thread held; S's first read on it, S's second waiting, V's after it: once S's first
    ends V's runs, while S's second is still held (one FIFO: V's waited for it); a waiting read
    whose caller leaves gives its place of max_queued back."""
    db = tmp_path / "s.db"
    ShardStore(db).close()
    reader = reads.ReadSide(str(db), lambda name: 0, max_queued=8)
    held, second = threading.Event(), threading.Event()

    async def keyed(key, fn):
        reads.READ_KEY.set(key)
        return await reader.read(fn)

    async def main():
        blocker = reader.submit(lambda conn: held.wait(60))   # (in no turn: the thread held)
        s1 = asyncio.ensure_future(keyed("S", lambda conn: "s1"))
        await asyncio.sleep(0)
        s2 = asyncio.ensure_future(keyed("S", lambda conn: second.wait(60) and "s2"))
        v = asyncio.ensure_future(keyed("V", lambda conn: "v"))
        gone = asyncio.ensure_future(keyed("G", lambda conn: "never"))
        await asyncio.sleep(0)
        assert reader._queued == 5
        gone.cancel()
        held.set()
        assert await asyncio.wait_for(v, 60) == "v"   # (s2 still held)
        assert not s2.done() and await s1 == "s1"
        second.set()
        assert await s2 == "s2" and blocker.result(60) is True
        assert gone.cancelled() and reader._queued == 0

    try:
        asyncio.run(main())
    finally:
        held.set()
        second.set()
        reader.close()


def test_the_service_queues_each_callers_reads_under_its_token_else_its_client(tmp_path):
    """The reader thread held: an anonymous status GET is next on it; job V's first lease
    (its data set's limits) and another anonymous GET wait their turns, under V's token and
    under the loopback clients' key, V's first (the anonymous key ran last): each request's
    reads are keyed by whom it comes from (service._pressure_key), not all one queue."""
    from stragglers.adapt.service import token_digest

    token = "job-fair-reads-token-0123456789"
    with held_reader(tmp_path, token, verified=False) as h:
        reader = h.reader
        calls = [("status", lambda: h.anyone.get("/datasets/v/status"),
                  lambda: reader._queued == 2),
                 ("lease", lambda: h.v.post("/datasets/v/lease", json={"worker": "w",
                                                                       "fence": h.fence}),
                  lambda: list(reader._turns._waiting) == [token_digest(token)]),
                 ("again", lambda: h.anyone.get("/datasets/v/status"),
                  lambda: len(reader._turns._waiting) == 2)]
        for name, call, queued in calls:
            h.start(name, call)
            eventually(queued, timeout=60, interval=0.005,   # (a bound against a hang)
                       what=f"{name}'s read never queued: {list(reader._turns._waiting)}")
        assert list(reader._turns._waiting) == [token_digest(token), ("client", None)]
        assert h.release() is True
        assert {n: r.status_code for n, r in h.out.items()} == {
            "status": 200, "lease": 200, "again": 200}, {n: r.text for n, r in h.out.items()}
