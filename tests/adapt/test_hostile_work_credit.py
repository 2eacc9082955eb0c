"""Under contention a token's requests are free of the shared pace only as far as its workers
earn them by their work: joining as many workers as it floods with connections no longer
makes a token's flood a big job's traffic."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from stragglers.adapt.service import EmbeddedServer, ServiceConfig, token_digest
from stragglers.adapt.working import WorkCredit

OWNER, OTHER = "flooding-owner-token-0123", "well-behaved-token-012345"
BIG = "big-job-starting-token-0123"


class Clock:
    """A clock the test moves."""

    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_worker_spends_credits_and_earns_them_by_moving_its_shard():
    clock = Clock()
    c = WorkCredit(start=2, earn=3, cap=8, per_worker=2, pool=7, pool_per_s=1, clock=clock)
    assert c.take("a") and c.take("a")          # its start: a join and a first lease
    c.leave("a")
    c.leave("a")
    assert not c.take("a")                      # no credit left: leases earn nothing
    c.worked("a")                               # an ack moved its shard
    assert [c.take("a"), c.take("a"), c.take("a")] == [True, True, False]   # two at once
    c.leave("a")
    assert c.take("a") and not c.take("a")      # its third credit; then none left
    for _ in range(10):
        c.worked("b")                           # (a worker first seen by its ack: no start)
    took = 0
    while c.take("b"):
        took += 1
        c.leave("b")
    assert took == 8                            # at most `cap` held
    # fresh names draw their start from one pool (7, "a" took 2): 5 for three new workers
    assert [c.take(w) for w in ("x", "y", "z")] == [True, True, True]
    assert [c.take(w) for w in ("x", "y", "z")] == [True, True, False]
    clock.now += 10                             # the pool refills (at most its size)
    assert c.take("fresh") and c.take("fresh")


def _held(port: int, token: str, dataset: str) -> socket.socket:
    """A lease of `token` on its own data set whose body never comes: in progress until
    closed."""
    s = socket.create_connection(("127.0.0.1", port))
    s.sendall(f"POST /datasets/{dataset}/lease HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization:"
              f" Bearer {token}\r\nContent-Type: application/json\r\nContent-Length: 100"
              "\r\n\r\n".encode())
    return s


def _counted(srv: EmbeddedServer, key: object, n: int) -> None:
    """Wait until the service counts `n` requests of `key` in progress (a state, polled)."""
    for _ in range(600):
        if srv.app.pressure.requests.get(key, 0) == n:
            return
        time.sleep(0.05)
    raise AssertionError(f"the service never counted {n} requests of {key!r} in progress")


@pytest.mark.slow
def test_a_flood_from_many_joined_workers_waits_while_working_workers_go_free(tmp_path):
    # A token that joined 8 workers had 16 requests in progress free of the shared pace (two
    # per worker joined), whatever they were: its leases in a loop (each a write, no shard
    # ever acked) went unpaced beside another job (fails before: the 4th lease is answered
    # 200). Now a worker's requests are free only on credits its acks earn; past them it takes
    # the token's shared turns (here one per 100 s: the first at once, then 429).
    cfg = ServiceConfig(free_requests_per_token=1, contended_requests_per_token_s=0.01,
                        cpu_contended_share=0.0, max_turn_wait_s=0.2,
                        contended_max_turn_wait_s=0.3, contended_refusal_wait_s=0.5,
                        refusal_delay_s=0.0)
    srv = EmbeddedServer(tmp_path / "s.db", config=cfg).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            for token, name in ((OWNER, "d"), (OTHER, "e"), (BIG, "b")):
                h = {"Authorization": f"Bearer {token}"}
                assert c.post("/datasets", headers=h, json={
                    "name": name, "num_samples": 1000, "shard_size": 10}).status_code == 200
            h = {"Authorization": f"Bearer {OWNER}"}
            fences = {f"w{i}": c.post("/datasets/d/join", headers=h, json={"worker": f"w{i}"})
                      .json()["fence"] for i in range(8)}
            held = [_held(srv.port, OWNER, "d"), _held(srv.port, OTHER, "e"),
                    _held(srv.port, BIG, "b")]
            for token in (OWNER, OTHER, BIG):
                _counted(srv, token_digest(token), 1)
            try:
                def lease(worker: str, rid: str) -> httpx.Response:
                    return c.post("/datasets/d/lease", headers=h, json={
                        "worker": worker, "fence": fences[worker], "request_id": rid})

                start = WorkCredit().start
                codes = [lease("w0", f"r{k}").status_code for k in range(start + 2)]
                # on its start credits, the token's one shared turn, then refused
                assert codes == [200] * (start + 1) + [429], codes
                # a working worker of the same token: each ack moves its shard and earns its
                # next requests, while the token's shared turns are 100 s away
                for k in range(4):
                    r = lease("w1", f"s{k}")
                    assert r.status_code == 200, r.text
                    shard = r.json()["leases"][0]
                    r = c.post("/datasets/d/ack", headers=h, json={
                        "worker": "w1", "fence": fences["w1"], "epoch": shard["epoch"],
                        "shard": shard["shard"], "consumed": 10})
                    assert r.status_code == 200, r.text
                # a worker joining now: its join, first lease and first ack on its start
                # (with two, a big job's first acks all waited shared turns: 256 workers'
                # leases took up to 8.5 s)
                r = c.post("/datasets/d/join", headers=h, json={"worker": "late"})
                assert r.status_code == 200, r.text
                fences["late"] = r.json()["fence"]
                shard = lease("late", "t0").json()["leases"][0]
                r = c.post("/datasets/d/ack", headers=h, json={
                    "worker": "late", "fence": fences["late"], "epoch": shard["epoch"],
                    "shard": shard["shard"], "consumed": 10})
                assert r.status_code == 200, r.text
                # a job whose workers join now, none joined before (no allowance from the
                # store yet): their joins and first leases go on their start credits (they
                # took the token's shared turns, 256 workers' leases up to 7.4 s)
                hb = {"Authorization": f"Bearer {BIG}"}
                for i in range(3):
                    r = c.post("/datasets/b/join", headers=hb, json={"worker": f"b{i}"})
                    assert r.status_code == 200, r.text
                    r = c.post("/datasets/b/lease", headers=hb, json={
                        "worker": f"b{i}", "fence": r.json()["fence"]})
                    assert r.status_code == 200, r.text
                # a refused body (its worker never known) waits the shared turn too: a flood
                # of bad bodies from many joined workers' connections went free of it
                t0 = time.monotonic()
                r = c.post("/datasets/d/lease", headers=h, json={"worker": "w2"})
                assert r.status_code == 400, r.text
                assert time.monotonic() - t0 >= 0.5   # (after the refusal wait; a lower bound)
                # the other job, a request at a time, never waits
                h2 = {"Authorization": f"Bearer {OTHER}"}
                assert c.post("/datasets/e/join", headers=h2,
                              json={"worker": "x"}).status_code == 200
            finally:
                for s in held:
                    s.close()
    finally:
        srv.stop()
