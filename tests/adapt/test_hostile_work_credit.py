"""Under contention a token's requests are free of the shared pace only as far as its workers
earn them by their work: joining as many workers as it floods with connections no longer
makes a token's flood a big job's traffic."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from adapt_clock import Clock
from stragglers.adapt.service import EmbeddedServer, ServiceConfig, token_digest
from stragglers.adapt.start_pool import StartPool
from stragglers.adapt.working import WorkCredit

OWNER, OTHER = "flooding-owner-token-0123", "well-behaved-token-012345"
BIG = "big-job-starting-token-0123"


def test_a_worker_spends_credits_and_earns_them_by_moving_its_shard():
    clock = Clock(100.0)
    c = WorkCredit(start=2, earn=3, cap=8, per_worker=2, progress_acks=4, pool=7, pool_per_s=1,
                   clock=clock)
    assert not c.take("a")                      # not known to the store: no credit
    c.known("a")                                # a request of it done: its start from the pool
    assert c.take("a") and c.take("a")          # its start: a first lease and ack
    c.leave("a", True)
    c.leave("a", True)
    assert not c.take("a")                      # no credit left: leases earn nothing
    c.worked("a", 1.0)                          # an ack moved its whole shard: 3 + its own 1
    assert [c.take("a"), c.take("a"), c.take("a")] == [True, True, False]   # two at once
    c.leave("a", True)
    assert c.take("a") and not c.take("a")      # its third credit; then none in progress free
    c.leave("a", True)
    c.leave("a", True)
    assert c.take("a") and not c.take("a")      # its fourth; then none left
    c.leave("a", True)
    c.known("b")                                # (the pool's last 3: "b" draws 2, 1 left)
    for _ in range(10):
        c.worked("b", 1.0)
    took = 0
    while c.take("b"):
        took += 1
        c.leave("b", True)
    assert took == 8                            # at most `cap` held
    c.worked("never-known", 1.0)                # (an ack of no worker known earns nothing)
    assert not c.take("never-known")


def test_an_ack_earns_the_share_of_its_shard_it_moved():
    # Was: any forward move earned 3 credits and cost 1, so a worker acking one sample at a
    # time (its requests between them too) never ran out.
    c = WorkCredit(start=3, earn=3, cap=8, progress_acks=8, clock=Clock(100.0))
    c.known("flood")
    free = 0
    for _ in range(1000):
        if not c.take("flood"):
            break
        free += 1
        c.leave("flood", True)
        c.worked("flood", 1 / 65536)            # one sample of a 65,536-sample shard
    assert free == 3                            # its start, then what one-sample acks earn
    c.known("steps")                            # acks of an eighth of a shard each pay for
    for _ in range(40):                         # themselves, and the shard its lease and more
        for k in range(9):                      # a lease, then 8 acks
            assert c.take("steps")
            c.leave("steps", True)
            if k:
                c.worked("steps", 1 / 8)


def test_only_a_join_draws_for_a_name_not_known_and_a_refused_one_gives_it_back():
    # Was: a lease naming a made-up worker drew a worker's start from the pool all tokens
    # share: a flood of fresh names drained it.
    clock = Clock(100.0)
    c = WorkCredit(start=3, pool=4, pool_per_s=0, clock=clock)
    assert not any(c.take(f"made-up-{k}") for k in range(100))   # (leases, acks of no worker)
    for k in range(10):                          # joins refused (too many workers, a bad
        assert c.take(f"refused-{k}", joining=True)   # fence): each credit given back
        c.leave(f"refused-{k}", False)
    assert c.take("j", joining=True)             # a join done: its credit, then 2 more drawn
    c.known("j")
    c.leave("j", True)
    assert c.take("j") and c.take("j") and not c.take("j")
    assert c.take("k", joining=True)             # the pool's last one
    assert not c.take("l", joining=True)


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


CONTENDED = ServiceConfig(free_requests_per_token=1, contended_requests_per_token_s=0.01,
                          cpu_contended_share=0.0, max_turn_wait_s=0.2,
                          contended_max_turn_wait_s=0.3, contended_refusal_wait_s=0.5,
                          refusal_delay_s=0.0)


@pytest.mark.slow
def test_one_sample_acks_and_made_up_workers_wait_their_turns_while_steps_go_free(tmp_path):
    # Was: an ack moving one sample of a 1,000-sample shard earned 3 credits and cost 1, so a
    # worker's one-sample acks (and leases between them) went free of the shared pace for good
    # (200 of each answered in 0.92 s); and leases naming made-up workers each drew a start
    # from the pool all tokens share (2,587 answered without waiting in 12 s). Now one-sample
    # acks earn what they move, names the store does not know draw nothing, and a worker acking
    # an eighth of its shard a step keeps going free.
    srv = EmbeddedServer(tmp_path / "s.db", config=CONTENDED).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            h = {"Authorization": f"Bearer {OWNER}"}
            for name, size in (("d", 1000), ("s", 80)):
                assert c.post("/datasets", headers=h, json={
                    "name": name, "num_samples": 100_000, "shard_size": size}).status_code == 200
            h2 = {"Authorization": f"Bearer {OTHER}"}
            assert c.post("/datasets", headers=h2, json={
                "name": "e", "num_samples": 1000, "shard_size": 10}).status_code == 200
            fences = {(d, w): c.post(f"/datasets/{d}/join", headers=h, json={"worker": w})
                      .json()["fence"] for d, w in (("d", "flood"), ("s", "steps"))}
            held = [_held(srv.port, OWNER, "d"), _held(srv.port, OTHER, "e")]
            for token in (OWNER, OTHER):
                _counted(srv, token_digest(token), 1)
            try:
                def lease(d: str, w: str, rid: str) -> httpx.Response:
                    return c.post(f"/datasets/{d}/lease", headers=h, json={
                        "worker": w, "fence": fences[(d, w)], "request_id": rid})

                def ack(d: str, w: str, shard: dict, consumed: int) -> httpx.Response:
                    return c.post(f"/datasets/{d}/ack", headers=h, json={
                        "worker": w, "fence": fences[(d, w)], "epoch": shard["epoch"],
                        "shard": shard["shard"], "consumed": consumed})

                # a worker acking an eighth of its shard a step: 3 shards, 27 requests, free
                for k in range(3):
                    r = lease("s", "steps", f"s{k}")
                    assert r.status_code == 200, r.text
                    shard = r.json()["leases"][0]
                    for step in range(1, 9):
                        r = ack("s", "steps", shard, 10 * step)
                        assert r.status_code == 200, (k, step, r.text)
                # leases naming workers never joined: none answered free of the shared pace
                # (the token's one shared turn, then refused)
                codes = [c.post("/datasets/d/lease", headers=h, json={
                    "worker": f"made-up-{k}", "fence": 1}).status_code for k in range(4)]
                assert codes.count(429) >= 3, codes
                # one-sample acks: on its start credits (a lease and two acks), then what
                # they earn runs out (the token's shared turn spent above): refused
                r = lease("d", "flood", "f0")
                assert r.status_code == 200, r.text
                shard = r.json()["leases"][0]
                codes = []
                for consumed in range(1, 21):
                    codes.append(ack("d", "flood", shard, consumed).status_code)
                    if codes[-1] != 200:
                        break
                assert codes == [200, 200, 429], codes
            finally:
                for s in held:
                    s.close()
    finally:
        srv.stop()


def test_one_token_joining_many_real_workers_leaves_other_tokens_their_starts():
    # Was: one level all tokens drew from: a token joining 2,048 real workers (its data sets
    # may hold 65,536) drew 3 each and emptied it, and another token's new workers then found
    # no start (their joins, first leases and acks waited shared turns) for as long as it kept
    # joining. Now a token draws only while it owes the pool less than is left.
    clock = Clock(100.0)
    c = WorkCredit(clock=clock)                  # the service's pool (6,144, 6,144 a minute)
    started = 0
    for i in range(2048):                        # joins of real workers: each join done
        who = ("flood", f"d{i // 1024}", f"w{i}")
        if c.take(who, joining=True):
            c.known(who)
            c.leave(who, True)
            started += c.take(who)
    assert started == 1024                       # half the pool: a whole data set at once
    for k in range(4):                           # more tokens of the same client: each less
        for i in range(2048):
            who = (f"flood-{k}", "d", f"w{i}")
            if c.take(who, joining=True):
                c.known(who)
                c.leave(who, True)
    for i in range(32):                          # another token's job: 32 workers, each on
        who = ("honest", "e", f"x{i}")           # its start (its join, first lease, first ack)
        assert c.take(who, joining=True), i
        c.known(who)
        c.leave(who, True)
        assert c.take(who) and c.take(who), i
        c.leave(who, True)
        c.leave(who, True)


def test_the_start_pool_refill_pays_the_tokens_owing_it_in_equal_parts():
    clock = Clock(100.0)
    p = StartPool(size=100, per_s=10, clock=clock)
    assert p.draw("a", 40) == 40 and p.draw("b", 4) == 4
    assert p.draw("a", 40) == 40 and p.draw("a", 1) == 0   # a owes 80: not less than 16 left
    assert p.draw("c", 20) == 16                           # (c owing nothing: what is left)
    p.give_back("c", 16)
    clock.now += 1                                         # 10 paid: 4 each, then a's 2
    assert (p.owes("a"), p.owes("b"), p.level()) == (74, 0, 26)
    assert p.draw("b", 3) == 3
    p.give_back("b", 5)                                    # (only what it owes)
    assert (p.owes("b"), p.level()) == (0, 26)
    clock.now += 10
    assert (p.owes("a"), p.level()) == (0, 100)
    single = WorkCredit(start=3, pool=30, pool_per_s=0, clock=clock)
    for i in range(10):                          # one token alone: up to half the pool
        single.known(("t", "d", f"w{i}"))
    assert [single.take(("t", "d", f"w{i}")) for i in range(6)] == [True] * 5 + [False]
