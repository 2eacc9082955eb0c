"""Backpressure per token (else per client): one owner flooding on many connections, or a
flood of cheap anonymous requests, is answered at a pace (429 with Retry-After past the
longest wait), while another job's calls, a few at a time, never wait."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from adapt_clock import Clock
from stragglers.adapt.service import EmbeddedServer, ServiceConfig, token_digest
from stragglers.serving_quota import Backpressure, CpuContention, RateLimited

OWNER, OTHER = "flooding-owner-token-0123", "well-behaved-token-012345"


def test_past_its_free_requests_a_key_waits_its_turn_and_is_refused_past_the_longest_wait():
    clock = Clock(100.0)
    p = Backpressure("token", free=2, rate=10, burst=1, max_wait_s=0.25, clock=clock)
    assert p.turn("a") == 0 and p.turn("a") == 0          # free: no turn taken
    assert p.turn("a") == 0                               # the burst
    assert p.turn("a") == 0                               # (GCRA: one interval late at most)
    assert p.turn("a") == pytest.approx(0.1)
    assert p.turn("a") == pytest.approx(0.2)
    with pytest.raises(RateLimited) as refused:
        p.turn("a")
    assert refused.value.retry_after_s == pytest.approx(0.3)
    assert p.requests["a"] == 6                            # the refused one is not counted
    assert p.turn("b") == 0                               # another key never waits for "a"
    for _ in range(6):
        p.leave("a")
    assert "a" not in p.requests
    assert p.turn("a") == 0                               # nothing in progress: free again
    clock.now += 10                                       # turns refill with time
    p.turn("a")
    assert p.turn("a") == 0


def _counted(srv: EmbeddedServer, key: object, n: int) -> None:
    """Wait until the service counts `n` requests of `key` in progress (a state, polled)."""
    for _ in range(600):
        if srv.app.pressure.requests.get(key, 0) == n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the service never counted {n} requests of {key!r} in progress")


def _held_request(port: int, token: str | None) -> socket.socket:
    """A lease whose body never comes: one request of `token` in progress until closed."""
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /datasets/d/lease HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: "
              "application/json\r\nContent-Length: 100\r\n\r\n".encode())
    return s


@pytest.mark.slow
def test_a_token_flooding_is_refused_429_after_the_longest_wait_others_are_served(tmp_path):
    # One owner on 256 connections was answered as fast as it asked (its clients spinning the
    # CPUs another job's leases need); now past one request in progress its turns come at
    # requests_per_token_s (here one per 100 s: two in a burst, then 429 with Retry-After).
    cfg = ServiceConfig(free_requests_per_token=1, requests_per_token_s=0.01,
                        request_burst_per_token=1, max_turn_wait_s=0.5,
                        contended_requests_per_token_s=0)   # (its own pace: no share)
    srv = EmbeddedServer(tmp_path / "s.db", config=cfg).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for token, name in ((OWNER, "d"), (OTHER, "e")):
                h = {"Authorization": f"Bearer {token}"}
                assert c.post("/datasets", headers=h, json={"name": name, "num_samples": 100,
                                                             "shard_size": 10}).status_code == 200
            held = _held_request(srv.port, OWNER)
            _counted(srv, token_digest(OWNER), 1)
            try:
                h = {"Authorization": f"Bearer {OWNER}"}
                codes = [c.post("/datasets/d/join", headers=h, json={"worker": f"w{i}"})
                         for i in range(3)]
                assert [r.status_code for r in codes[:2]] == [200, 200], codes[0].text
                t0 = time.monotonic()
                refused = c.post("/datasets/d/join", headers=h, json={"worker": "late"})
                assert refused.status_code == 429, refused.text
                assert time.monotonic() - t0 >= 0.5   # answered after the longest wait
                assert int(refused.headers["retry-after"]) >= 1
                assert set(refused.json()) == {"error", "kind", "field"}
                # another token, one call at a time, never waits for the flooding one
                h2 = {"Authorization": f"Bearer {OTHER}"}
                for i in range(5):
                    assert c.post("/datasets/e/join", headers=h2,
                                  json={"worker": f"w{i}"}).status_code == 200
                assert c.get("/health").status_code == 200
            finally:
                held.close()
            # the flooding token's status: only the refused join left nothing behind
            workers = c.get("/datasets/d/status").json()
            assert "late" not in str(workers)
            # nothing of it in progress any more: free again (the held request gone)
            for _ in range(50):
                if c.post("/datasets/d/join", headers=h, json={"worker": "again"}
                          ).status_code == 200:
                    break
                time.sleep(0.1)   # (the server learns of the closed socket when it reads)
            else:
                pytest.fail("the owner stayed paced after its requests ended")
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_flood_of_anonymous_requests_is_paced_too(tmp_path):
    # /health, unknown paths and tokenless writes were answered as fast as they came
    # (the held request is a tokenless write, in progress until its 401 is answered after
    # auth_failure_delay_s: its longest, 10 s, for the requests below on a loaded machine;
    # unknown paths answered at once)
    cfg = ServiceConfig(free_requests_per_token=1, requests_per_token_s=0.01,
                        request_burst_per_token=1, max_turn_wait_s=0.3,
                        auth_failure_delay_s=10.0, refusal_delay_s=0.0)
    srv = EmbeddedServer(tmp_path / "s.db", config=cfg).start()
    try:
        held = _held_request(srv.port, None)
        _counted(srv, ("client", None), 1)
        try:
            with httpx.Client(base_url=srv.url, timeout=60) as c:
                codes = [c.get(p).status_code for p in ("/health", "/nowhere", "/health")]
                assert codes == [200, 404, 429], codes
                # a job with a token is not an anonymous client
                h = {"Authorization": f"Bearer {OTHER}"}
                assert c.post("/datasets", headers=h, json={"name": "e", "num_samples": 100,
                                                             "shard_size": 10}).status_code == 200
        finally:
            held.close()
    finally:
        srv.stop()


def _join(port: int, token: str, worker: str, s: socket.socket | None = None) -> socket.socket:
    body = f'{{"worker": "{worker}"}}'.encode()
    s = s or socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /datasets/d/join HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
              f"{token}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
              "\r\n\r\n".encode() + body)
    return s


def _response(s: socket.socket) -> bytes:
    """One whole response read from `s` (head and Content-Length body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(4096)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:")))
    while len(body) < length:
        body += s.recv(4096)
    return head


@pytest.mark.slow
def test_requests_waiting_their_turn_give_their_connections_up_at_the_cap(tmp_path):
    # A flooding owner's requests waiting their turns held every connection a loopback
    # address may have: another job's new connection was refused 503 (fails before: no
    # connection was closable). Now one waiting its turn is closed (503, nothing done).
    cfg = ServiceConfig(max_connections=8, free_requests_per_token=1,
                        requests_per_token_s=0.02, request_burst_per_token=1,
                        max_turn_wait_s=600)
    srv = EmbeddedServer(tmp_path / "s.db", config=cfg).start()
    try:
        h = {"Authorization": f"Bearer {OWNER}"}
        assert httpx.post(f"{srv.url}/datasets", headers=h, timeout=60, json={
            "name": "d", "num_samples": 100, "shard_size": 10}).status_code == 200
        held = _held_request(srv.port, OWNER)
        first = None
        for i in range(2):   # the burst: answered at once (on a connection kept, not idle after)
            first = _join(srv.port, OWNER, f"b{i}", first)
            assert _response(first).startswith(b"HTTP/1.1 200"), i
        parked = [_join(srv.port, OWNER, "p0", first)]
        parked += [_join(srv.port, OWNER, f"p{i}") for i in range(1, 7)]   # 8: the cap
        try:
            _counted(srv, token_digest(OWNER), 8)
            h2 = {"Authorization": f"Bearer {OTHER}"}
            r = httpx.post(f"{srv.url}/datasets", headers=h2, timeout=60, json={
                "name": "e", "num_samples": 100, "shard_size": 10})
            assert r.status_code == 200, r.text
            answers = []
            for s in parked:
                s.settimeout(0.5)
                try:
                    answers.append(s.recv(4096))
                except OSError:
                    answers.append(b"")
            closed = [a for a in answers if a]
            assert closed and all(a.startswith(b"HTTP/1.1 503") for a in closed), answers
        finally:
            held.close()
            for s in parked:
                s.close()
    finally:
        srv.stop()


@pytest.mark.slow
def test_the_serving_layers_own_refusals_are_answered_after_a_pause(tmp_path):
    # a Host not allowed or a header twice was answered at once: a client looping on them spun
    srv = EmbeddedServer(tmp_path / "s.db").start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for headers in ({"Host": "evil.example"}, [("X-Service-Token", "a"),
                                                       ("X-Service-Token", "b")]):
                t0 = time.monotonic()
                r = c.get("/health", headers=headers)
                assert r.status_code == 400, r.text
                assert time.monotonic() - t0 >= 0.25   # a lower bound load cannot break
                assert set(r.json()) == {"error", "kind", "field"}
    finally:
        srv.stop()


def test_under_contention_a_key_past_its_free_requests_yields_to_the_others():
    # One owner's 256 local connections were answered at 2,000 a second, as fast as their own
    # CPU let them ask, while another job's leases waited for a CPU (3.7x at nice 0). Now,
    # while another key is active and the machine has no CPU to spare, a key past its free
    # requests takes turns at shared_rate; the other key, a few at a time, never waits.
    clock, busy = Clock(100.0), [True]
    p = Backpressure("token", free=1, rate=1000, burst=100, max_wait_s=0.35, clock=clock,
                     shared_rate=10, contended=lambda: busy[0], recent_s=1.0)
    assert [p.turn("a") for _ in range(20)] == [0] * 20     # alone: its own pace, the burst
    assert p.turn("b") == 0                                  # another key active
    waits = [p.turn("a") for _ in range(5)]                  # 10 a second, no burst
    assert waits[0] == 0 and [round(y - x, 6) for x, y in zip(waits[1:], waits[2:])] == [0.1] * 3
    with pytest.raises(RateLimited) as refused:
        p.turn("a")
    assert "10 a second" in str(refused.value)
    busy[0] = False                                          # CPUs to spare: its own pace
    clock.now += 1.0                                         # (the shared turns taken, past)
    assert [p.turn("a") for _ in range(5)] == [0] * 5
    busy[0] = True
    p.leave("b")                                             # "b" answered just now
    p.turn("a")
    assert p.turn("a") > 0                                   # the shared pace again
    clock.now += 1.5                                         # "b" idle past recent_s
    assert [p.turn("a") for _ in range(5)] == [0] * 5
    # under contention a turn is waited for longer (a 429 is an answer too), by at most
    # max_waiting requests of a key at once
    waits = Backpressure("token", free=1, rate=1000, burst=1, max_wait_s=0.05, clock=clock,
                         shared_rate=10, shared_max_wait_s=10, max_waiting=6,
                         shared_refusal_wait_s=30)
    waits.turn("b")
    assert [waits.turn("a") for _ in range(6)] == pytest.approx([0, 0, 0.1, 0.2, 0.3, 0.4],
                                                                abs=0.002)   # (own burst 1)
    with pytest.raises(RateLimited, match="waiting their turns") as refused:
        waits.turn("a")
    assert refused.value.park_s == 30   # answered after the refusal wait (no turn taken)
    # never faster than the key's own pace
    slow = Backpressure("token", free=1, rate=1, burst=1, max_wait_s=10, clock=clock,
                        shared_rate=100, contended=lambda: True)
    slow.turn("b")
    assert [slow.turn("a") for _ in range(5)] == pytest.approx([0, 0, 0, 1, 2])   # 1 free


def test_cpu_contention_is_the_share_of_wanting_a_cpu_spent_waiting_for_one():
    clock = Clock(100.0)
    samples = iter([(0, 0), (8_000_000, 1_000_000), (10_000_000, 5_000_000),
                    (10_000_100, 5_000_000), None])
    c = CpuContention(share=0.25, window_s=0.5, clock=clock, read=lambda: next(samples))
    assert c() is True                      # nothing known yet: contended
    clock.now += 0.1
    assert c() is True                      # within the window: the last verdict, no read
    clock.now += 0.5
    assert c() is False                     # 1 ms waited of 9: CPUs to spare
    clock.now += 0.5
    assert c() is True                      # 4 of 6 ms waited
    clock.now += 0.5
    assert c() is True                      # under 1 ms of wanting: the last verdict
    clock.now += 0.5
    assert c() is True                      # the kernel does not say: contended
    assert CpuContention(share=0.0, read=lambda: (1, 0))() is True
    real = CpuContention()
    assert real() in (True, False)          # this machine's schedstat reads (or not) cleanly


@pytest.mark.slow
def test_a_flooding_token_yields_to_another_active_token_over_http(tmp_path):
    # the same through the service: the owner (two requests held, its free ones; past them
    # turns at the shared pace, one every 100 s) is refused 429 with the shared pace's Retry-After while the
    # other job (a request in progress all along) is served; before, its own pace (2,000 a
    # second, a burst of 4,000) answered it at once
    cfg = ServiceConfig(free_requests_per_token=2, contended_requests_per_token_s=0.01,
                        cpu_contended_share=0.0, max_turn_wait_s=0.2,
                        contended_max_turn_wait_s=0.3, contended_refusal_wait_s=0.5)
    srv = EmbeddedServer(tmp_path / "s.db", config=cfg).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for token, name in ((OWNER, "d"), (OTHER, "e")):
                h = {"Authorization": f"Bearer {token}"}
                assert c.post("/datasets", headers=h, json={"name": name, "num_samples": 100,
                                                             "shard_size": 10}).status_code == 200
            held = [_held_request(srv.port, OWNER), _held_request(srv.port, OWNER),
                    _held_request(srv.port, OTHER)]
            _counted(srv, token_digest(OWNER), 2)
            _counted(srv, token_digest(OTHER), 1)
            try:
                h = {"Authorization": f"Bearer {OWNER}"}
                # (retry-failed: no worker's write, whose credit would settle its turn)
                codes = [c.post("/datasets/d/retry-failed", headers=h, json={})
                         .status_code for i in range(1)]
                assert codes == [200], codes   # past its free ones: the shared pace's first
                t0 = time.monotonic()
                refused = c.post("/datasets/d/retry-failed", headers=h, json={})
                assert refused.status_code == 429, refused.text
                assert int(refused.headers["retry-after"]) >= 50
                assert time.monotonic() - t0 >= 0.5   # after the contended longest wait
                h2 = {"Authorization": f"Bearer {OTHER}"}
                for i in range(5):
                    assert c.post("/datasets/e/join", headers=h2,
                                  json={"worker": f"w{i}"}).status_code == 200
            finally:
                for s in held:
                    s.close()
    finally:
        srv.stop()


def test_a_big_jobs_workers_are_free_of_the_shared_pace_and_anonymous_probes_are_no_job():
    # The shared pace held a legitimate big job to it: its 48 workers share one token, so past
    # 4 requests in progress every one waited (10 steps a second instead of 150; at ~800
    # workers joins failed), and one anonymous /health probe a second was "another key". A key
    # may have its allowance in progress free of the shared pace; only counted keys are others.
    clock = Clock(100.0)
    p = Backpressure("token", free=4, rate=1000, burst=1000, max_wait_s=10, clock=clock,
                     shared_rate=10, contended=lambda: True, shared_max_wait_s=10,
                     allowance=lambda key: 96 if key == "big" else 4,
                     counts=lambda key: isinstance(key, str))
    assert p.turn("small") == 0                               # another job active
    assert [p.turn("big") for _ in range(96)] == [0] * 96     # two per worker, none waits
    assert [p.turn("big") for _ in range(3)][-1] > 0          # past it: the shared pace
    q = Backpressure("token", free=1, rate=1000, burst=100, max_wait_s=10, clock=clock,
                     shared_rate=10, contended=lambda: True,
                     counts=lambda key: isinstance(key, str))
    q.turn(("client", None))                                  # a /health probe in progress
    q.leave(("client", None))
    assert [q.turn("big") for _ in range(20)] == [0] * 20     # its own pace and burst
    q.turn("small")
    q.turn("big")
    assert q.turn("big") > 0                                  # a job beside it: shared


def test_a_tokens_allowance_is_two_per_worker_joined_to_its_data_sets(tmp_path):
    from stragglers.adapt.dataset import DatasetConfig
    from stragglers.adapt.service import WorkerAllowance
    from stragglers.adapt.shards import ShardStore
    store = ShardStore(tmp_path / "s.db")
    try:
        mine, theirs = token_digest(OWNER), token_digest(OTHER)
        for name, owner in (("a", mine), ("b", mine), ("c", theirs)):
            store.create_dataset(DatasetConfig(name, 640, 10), token_sha256=owner)
        for name, workers in (("a", 30), ("b", 18), ("c", 3)):
            for w in range(workers):
                store.join(name, f"w{w}", token_sha256=mine if name != "c" else theirs)
        clock = Clock(100.0)
        allowance = WorkerAllowance(store, free=4, clock=clock)
        assert allowance(mine) == 96 and allowance(theirs) == 6
        assert allowance(("client", None)) == 4 and allowance(token_digest("nobody")) == 4
        store.join("a", "w-new", token_sha256=mine)
        assert allowance(mine) == 96                          # read at most once a second
        clock.now += 1.5
        assert allowance(mine) == 98
    finally:
        store.close()
