"""The shuffle threads and the reader thread serve tokens in turn (keyed_turns.KeyedTurns):
one token's (or client's) backlog queues another job's lease behind one of its calls at most,
on the small shuffle thread as on the big one, and on the reader (a data set's first lease reads
its shard size there). Counted, not timed: the threads are held on events."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError

import httpx
import pytest

from stragglers.adapt.keyed_turns import KeyedTurns


def _until(check, what: str) -> None:
    deadline = time.monotonic() + 60   # (a bound against a hang, not a timing)
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_key_whose_call_runs_goes_behind_the_keys_that_came_meanwhile():
    turns = KeyedTurns(1, "test-turns")
    held, order = threading.Event(), []
    try:
        first = turns.submit("a", lambda: (held.wait(60), order.append("a1")))
        _until(lambda: turns.counts() == (0, 1), "a1 never ran")
        futures = [turns.submit(k[0], order.append, k) for k in ("a2", "a3")]
        futures += [turns.submit(k[0], order.append, k) for k in ("b1", "c1", "b2")]
        failed = turns.submit("c", lambda: 1 / 0)
        gone = turns.submit("d", order.append, "d1")
        assert gone.cancel()   # (its caller left: skipped)
        assert turns.counts() == (7, 1)
        held.set()
        for f in [first] + futures:
            f.result(60)
        with pytest.raises(ZeroDivisionError):
            failed.result(60)
        assert order == ["a1", "b1", "c1", "a2", "b2", "a3"]
        assert turns.counts() == (0, 0)
    finally:
        held.set()
        turns.shutdown()


def test_shutdown_cancels_the_waiting_calls():
    turns = KeyedTurns(1, "test-turns")
    held = threading.Event()
    running = turns.submit("a", held.wait, 60)
    _until(lambda: turns.counts() == (0, 1), "the first call never ran")
    waiting = turns.submit("b", held.wait, 60)
    stopper = threading.Thread(target=turns.shutdown)
    stopper.start()
    _until(lambda: waiting.cancelled(), "shutdown left a call waiting")
    held.set()
    stopper.join(60)
    assert running.result(0) is True
    with pytest.raises(CancelledError):
        waiting.result(0)
    with pytest.raises(RuntimeError):
        turns.submit("c", print)


def test_one_tokens_small_shuffles_queue_another_jobs_lease_behind_one_of_them(tmp_path):
    """Token H leases a shard of each of three small data sets (distinct seeds: three
    shuffles on the small thread) while the thread is held on H's first; job V's lease of its
    own new epoch comes last. V's shuffle is the second computed (was the fourth: one FIFO)."""
    from stragglers.adapt.service import EmbeddedServer

    hostile = {"Authorization": "Bearer hostile-fair-shuffles-token-0123"}
    job = {"Authorization": "Bearer job-fair-shuffles-token-0123456789"}
    server = EmbeddedServer(tmp_path / "s.db", durable=False).start()   # (no fsync: faster)
    perms = server.app.state.store.permutations
    small = server.app.state.shuffles[False]
    held = threading.Event()
    threads = []
    clients = [httpx.Client(base_url=server.url, headers=h, timeout=60) for h in (hostile, job)]
    try:
        fences = {}
        for name, seed, c in [("h0", 1, clients[0]), ("h1", 2, clients[0]),
                              ("h2", 3, clients[0]), ("v", 99, clients[1])]:
            r = c.post("/datasets", json={"name": name, "num_samples": 4096, "shard_size": 64,
                                          "seed": seed})
            assert r.status_code == 200, r.text
            r = c.post(f"/datasets/{name}/join", json={"worker": "w"})
            fences[name] = (r.json()["fence"], c)

        def lease(name):
            fence, c = fences[name]
            r = c.post(f"/datasets/{name}/lease", json={"worker": "w", "fence": fence})
            assert r.status_code == 200, r.text

        with perms._lock:   # h0's shuffle "under way": the thread waits for it (single flight)
            perms._running[(4096, 1, 0)] = held
        for names, queued in ((["h0"], (0, 1)), (["h1", "h2"], (2, 1)), (["v"], (3, 1))):
            for name in names:
                threads.append(threading.Thread(target=lease, args=(name,)))
                threads[-1].start()
            _until(lambda q=queued: small.counts() == q, f"{names}' shuffles never queued")
        with perms._lock:
            del perms._running[(4096, 1, 0)]
        held.set()
        for t in threads:
            t.join(60)
        order = [seed for _, seed, _ in perms._cache]   # (the order they were computed in)
        assert order[:2] == [1, 99], order
    finally:
        held.set()
        for t in threads:
            t.join(60)
        for c in clients:
            c.close()
        server.stop()


def test_a_jobs_first_lease_reads_its_shard_size_behind_one_read_of_another_client(tmp_path):
    """The reader thread is held by a read of the loopback clients without a token (the key
    their snapshot and status GETs wait under), another of theirs and an anonymous status GET
    queued behind it; job V's first lease of its data set reads the shard size there. Once the
    first read ends, V's goes next: V is answered while the anonymous client's next read is
    still held (one FIFO: V waited for all of them)."""
    from stragglers.adapt import reads
    from stragglers.adapt.service import EmbeddedServer

    job = {"Authorization": "Bearer job-fair-reads-token-0123456789"}
    server = EmbeddedServer(tmp_path / "s.db", durable=False).start()
    reader = server.app.state.reader
    first, second = threading.Event(), threading.Event()
    threads: list[threading.Thread] = []
    out: dict = {}
    v = httpx.Client(base_url=server.url, headers=job, timeout=60)
    anyone = httpx.Client(base_url=server.url, timeout=60)
    try:
        r = v.post("/datasets", json={"name": "v", "num_samples": 4096, "shard_size": 64})
        assert r.status_code == 200, r.text
        fence = v.post("/datasets/v/join", json={"worker": "w"}).json()["fence"]
        anonymous = reads.READ_KEY.set(("client", None))   # (as service._pressure_key says)
        try:
            reader.submit(lambda conn: first.wait(60))
            _until(lambda: reader._pool.counts() == (0, 1), "the first read never ran")
            reader.submit(lambda conn: second.wait(60))
        finally:
            reads.READ_KEY.reset(anonymous)
        calls = [("status", lambda: anyone.get("/datasets/v/status")),
                 ("lease", lambda: v.post("/datasets/v/lease",
                                          json={"worker": "w", "fence": fence}))]
        for (name, call), queued in zip(calls, [(2, 1), (3, 1)]):
            threads.append(threading.Thread(target=lambda n=name, c=call: out.setdefault(n, c())))
            threads[-1].start()
            _until(lambda q=queued: reader._pool.counts() == q, f"{name}'s read never queued")
        first.set()
        threads[1].join(60)   # (a bound against a hang: V's lease needs no read but its own)
        assert "lease" in out and not second.is_set(), "V's lease waited for the next read"
        assert out["lease"].status_code == 200, out["lease"].text
    finally:
        first.set()
        second.set()
        for t in threads:
            t.join(60)
        v.close()
        anyone.close()
        server.stop()
    assert out["status"].status_code == 200, out["status"].text
