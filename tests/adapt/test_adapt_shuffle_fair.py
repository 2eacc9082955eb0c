"""The shuffle threads serve tokens in turn (keyed_turns.KeyedTurns): one token's backlog of
shuffles queues another job's lease behind one of them at most, on the small thread as on the
big one. Counted, not timed: the shuffle thread is held on an event."""

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
    """Token H leases a shard of each of four small data sets (distinct seeds: four shuffles
    on the small thread) while the thread is held on H's first; job V's lease of its own new
    epoch comes last. V's shuffle is the second computed (was the fifth: one FIFO)."""
    from stragglers.adapt.service import EmbeddedServer

    hostile = {"Authorization": "Bearer hostile-fair-shuffles-token-0123"}
    job = {"Authorization": "Bearer job-fair-shuffles-token-0123456789"}
    server = EmbeddedServer(tmp_path / "s.db").start()
    perms = server.app.state.store.permutations
    small = server.app.state.shuffles[False]
    held = threading.Event()
    threads = []
    try:
        fences = {}
        for name, seed, headers in [("h0", 1, hostile), ("h1", 2, hostile), ("h2", 3, hostile),
                                    ("h3", 4, hostile), ("v", 99, job)]:
            r = httpx.post(f"{server.url}/datasets", headers=headers, json={
                "name": name, "num_samples": 4096, "shard_size": 64, "seed": seed})
            assert r.status_code == 200, r.text
            r = httpx.post(f"{server.url}/datasets/{name}/join", headers=headers,
                           json={"worker": "w"})
            fences[name] = (r.json()["fence"], headers)

        def lease(name):
            fence, headers = fences[name]
            r = httpx.post(f"{server.url}/datasets/{name}/lease", headers=headers,
                           timeout=60, json={"worker": "w", "fence": fence})
            assert r.status_code == 200, r.text

        with perms._lock:   # h0's shuffle "under way": the thread waits for it (single flight)
            perms._running[(4096, 1, 0)] = held
        for names, queued in ((["h0"], (0, 1)), (["h1", "h2", "h3"], (3, 1)), (["v"], (4, 1))):
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
        server.stop()
