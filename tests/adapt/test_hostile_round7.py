"""Hostile cases of a seventh round against a real service on loopback: accounting that must
stay exact when requests overlap."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from conftest import store_tables as tables
from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.service import EmbeddedServer, ServiceConfig
from stragglers.errors import InputError

JOB = {"policy": "bsp", "world_size": 2, "global_batch": 8}


class Continued:
    """A JSON write on its own connection, told `100 Continue` (admitted from its head) and
    holding its body until `finish`."""

    def __init__(self, port: int, path: str, token: str):
        self.path = path
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.sendall((f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                           "application/json\r\nContent-Length: 64\r\nExpect: 100-continue\r\n"
                           f"Authorization: Bearer {token}\r\n\r\n").encode())
        got = b""
        while b"\r\n\r\n" not in got:
            got += self.sock.recv(65536)
        assert got.startswith(b"HTTP/1.1 100 Continue\r\n"), got

    def finish(self, body: dict) -> int:
        """Send the body (padded to the 64 bytes declared); the status of the answer."""
        raw = json.dumps(body).encode()
        self.sock.sendall(raw + b" " * (64 - len(raw)))
        got = b""
        while b"\r\n" not in got:
            got += self.sock.recv(65536)
        self.sock.close()
        return int(got.split()[1])


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["dataset", "job"])
@pytest.mark.parametrize("order", ["refused_first", "refused_last"])
def test_overlapping_creations_of_a_new_token_count_it_once_whichever_is_refused(
        tmp_path, kind, order):
    # (fails before for refused_first: the second request of a token counted new by the first,
    # in flight, was let through as known; the first, refused, gave the count back, and the
    # second created uncounted: with one new token a minute, another token could then create)
    srv = EmbeddedServer(tmp_path / "s.db", config=ServiceConfig(
        new_tokens_per_minute=1.0)).start()
    try:
        def path(i: int) -> str:
            return "/datasets" if kind == "dataset" else f"/jobs/j{i}/control/config"

        def good(i: int) -> dict:
            return {"name": f"d{i}", "num_samples": 10, "shard_size": 5} if kind == "dataset" \
                else JOB
        token = "fresh-token-aaaaaaaaaaaa"
        first = Continued(srv.port, path(1), token)    # counted as a new token
        second = Continued(srv.port, path(2), token)   # admitted while the first is in flight
        bad = {"nope": 1}
        if order == "refused_first":
            assert first.finish(bad) == 400
            assert second.finish(good(2)) == 200
        else:
            assert second.finish(good(2)) == 200
            assert first.finish(bad) == 400
        # the token created once: it used the minute's only new token
        r = httpx.post(srv.url + path(3), json=good(3), timeout=60,
                       headers={"Authorization": "Bearer other-token-bbbbbbbbbbbb"})
        assert r.status_code == 429 and r.json()["kind"] == "RateLimited", r.text
        # and the token itself creates again, counted no more
        r = httpx.post(srv.url + path(4), json=good(4), timeout=60,
                       headers={"Authorization": f"Bearer {token}"})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_new_token_refused_on_every_overlapping_request_is_given_back(tmp_path):
    srv = EmbeddedServer(tmp_path / "s.db", config=ServiceConfig(
        new_tokens_per_minute=1.0)).start()
    try:
        token = "fresh-token-aaaaaaaaaaaa"
        held = [Continued(srv.port, "/datasets", token) for _ in range(3)]
        assert [h.finish({"nope": 1}) for h in held] == [400] * 3
        r = httpx.post(srv.url + "/datasets", timeout=60, json={
            "name": "d", "num_samples": 10, "shard_size": 5},
            headers={"Authorization": "Bearer other-token-bbbbbbbbbbbb"})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()


def _report(c: httpx.Client, rank: int, records: list) -> httpx.Response:
    return c.post("/jobs/j/control/report", json={"rank": rank, "records": records,
                                                  "incarnation": 0})


@pytest.mark.slow
@pytest.mark.parametrize("ahead", [5_000, 19_000])
def test_a_step_further_ahead_than_the_job_could_run_is_refused_and_later_records_count(
        tmp_path, ahead):
    # (fails before: a step 5,000 ahead of the real ones was taken; every later record of its
    # rank, up to that step, counted as a report sent again and was ignored, answered 200: no
    # window of the job closed and no action came until the real steps caught up)
    srv = EmbeddedServer(tmp_path / "s.db").start()
    h = {"Authorization": "Bearer job-token-0123456789"}
    try:
        with httpx.Client(base_url=srv.url, headers=h, timeout=60) as c:
            r = c.post("/jobs/j/control/config", json={
                "policy": "dd", "world_size": 2, "global_batch": 64, "window": 2,
                "min_change": 0.0, "lag_s": 0.0})
            assert r.status_code == 200, r.text
            for step in range(2, 10):
                for rank in (0, 1):
                    assert _report(c, rank, [[step, 0.5, 32]]).status_code == 200
            before = c.get("/jobs/j/control/state").json()
            # one report's step far ahead of the job (a corrupted counter), beside a real one
            r = _report(c, 0, [[10, 0.5, 32], [9 + ahead, 0.5, 32]])
            assert r.status_code == 400, r.text
            assert r.json()["field"] == "records[1][0]" and "implausible" in r.json()["error"]
            assert c.get("/jobs/j/control/state").json() == before   # nothing of it applied
            actions = []
            for step in range(10, 40):
                for rank in (0, 1):
                    r = _report(c, rank, [[step, 1.0 if rank == 0 else 3.0, 32]])
                    assert r.status_code == 200, r.text
                    actions += r.json()["actions"]
            assert actions, "no window closed after the refused step"
            assert all(a["effective_step"] < 100 for a in actions), actions
    finally:
        srv.stop()


def test_a_jump_the_job_had_the_time_to_run_is_taken():
    # the bound is the steps the job could have run since its latest step: after an outage of
    # every rank's reports (an hour at 0.5 s a step: 7,200 steps) their jump is real
    from stragglers.adapt.control import ControlPlane
    from stragglers.adapt.controller import ControlConfig
    plane = ControlPlane()
    plane.configure("j", ControlConfig(policy="dd", world_size=2, global_batch=64), None)
    now = [1000.0]
    plane._jobs["j"][1].monitor.clock = lambda: now[0]
    for step in range(2, 10):
        for rank in (0, 1):
            plane.report("j", rank, [(step, 0.5, 32)], "", 0, 0, None)
    with pytest.raises(InputError) as refused:
        plane.report("j", 0, [(9 + 7_200, 0.5, 32)], "", 0, 0, None)
    assert refused.value.field == "records[0][0]"
    now[0] += 3600.0
    plane.report("j", 0, [(9 + 7_200, 0.5, 32)], "", 0, 0, None)
    plane.report("j", 1, [(9 + 7_200, 0.5, 32)], "", 0, 0, None)
    assert plane._jobs["j"][1].monitor.latest_step == 9 + 7_200


OWNER = "owner-token-0123456789"
SERVICE = "service-token-0123456789"


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    db = tmp_path_factory.mktemp("hostile-round7") / "shards.db"
    srv = EmbeddedServer(db, service_token=SERVICE).start()
    try:
        owner = ShardClient(srv.url, "d", "w", token=OWNER, service_token=SERVICE)
        owner.create_dataset(DatasetConfig("d", 400, 10, lease_s=600))
        owner.join()
        held = owner.lease(1).leases[0]
        owner.configure_control({**JOB, "incarnation": 1})
        yield {"url": srv.url, "port": srv.port, "db": db, "fence": owner.fence, "held": held}
    finally:
        srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("query", ["fence=99", "worker=x&worker=y", "x"])
def test_a_write_with_a_query_string_is_refused_and_changes_nothing(svc, query):
    # (fails before: the query was ignored and the write done — `?fence=99` beside the body's
    # fence, or `?worker=x`: which value counts was the service's guess, not the client's)
    f, held = svc["fence"], svc["held"]
    writes = {
        "/datasets": {"name": "q", "num_samples": 10, "shard_size": 5},
        "/datasets/d/join": {"worker": "q"},
        "/datasets/d/lease": {"worker": "w", "fence": f, "request_id": "r2"},
        "/datasets/d/ack": {"worker": "w", "fence": f, "epoch": held.epoch,
                            "shard": held.shard, "consumed": 1},
        "/datasets/d/release": {"worker": "w", "fence": f},
        "/datasets/d/retry-failed": {},
        "/jobs/j2/control/config": JOB,
        "/jobs/d/control/report": {"rank": 0, "records": [[5, 0.1, 4]], "incarnation": 1},
    }
    before = tables(svc["db"])
    state = httpx.get(f"{svc['url']}/jobs/d/control/state", timeout=60).json()
    with httpx.Client(base_url=svc["url"], timeout=60, headers={
            "Authorization": f"Bearer {OWNER}", "X-Service-Token": SERVICE}) as c:
        for path, body in writes.items():
            r = c.post(f"{path}?{query}", json=body)
            assert r.status_code == 400 and r.json()["field"] == "query", (path, r.text)
        assert c.get("/jobs/j2/control/state").status_code == 404
        assert c.get("/jobs/d/control/state").json() == state
    assert tables(svc["db"]) == before


@pytest.mark.slow
@pytest.mark.parametrize("coding", ["gzip", "deflate", "br, identity", "x-custom"])
def test_a_body_declared_in_a_content_coding_is_refused_415(svc, coding):
    # (fails before: Content-Encoding was ignored, so a body declared gzip that was plain JSON
    # was taken as it came — a body is taken only as what it says it is)
    import gzip
    plain = json.dumps({"worker": "coded"}).encode()
    before = tables(svc["db"])
    for body in (plain, gzip.compress(plain)):
        r = httpx.post(f"{svc['url']}/datasets/d/join", content=body, timeout=60, headers={
            "Authorization": f"Bearer {OWNER}", "Content-Type": "application/json",
            "Content-Encoding": coding})
        assert r.status_code == 415 and r.json()["field"] == "Content-Encoding", r.text
    assert tables(svc["db"]) == before


def test_an_identity_content_coding_is_taken(svc):
    r = httpx.post(f"{svc['url']}/datasets/d/join", json={"worker": "identity"}, timeout=60,
                   headers={"Authorization": f"Bearer {OWNER}", "Content-Encoding": "identity"})
    assert r.status_code == 200, r.text


def test_a_jobs_token_file_is_read_as_the_services_is(tmp_path):
    # (fails before: read whole, a token file of two lines gave a token with a newline in it,
    # refused 401 on every write of the job; one others may read was taken silently, and a
    # FIFO blocked rank 0's start for good)
    import os

    from stragglers.adapt.launch import read_or_create_token
    two = tmp_path / "two.token"
    two.write_text("job-token-0123456789abcdef\nsecond line\n")
    two.chmod(0o600)
    assert read_or_create_token(two) == "job-token-0123456789abcdef"
    shared = tmp_path / "shared.token"
    shared.write_text("job-token-0123456789abcdef\n")
    shared.chmod(0o644)
    with pytest.raises(InputError, match="chmod 600"):
        read_or_create_token(shared)
    fifo = tmp_path / "fifo.token"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(InputError, match="not a regular file"):
        read_or_create_token(fifo)
    made = tmp_path / "new.token"   # none yet: made, 0600, and read back the same
    token = read_or_create_token(made)
    assert read_or_create_token(made) == token and made.stat().st_mode & 0o777 == 0o600


def test_a_job_reporting_its_step_times_in_another_unit_is_not_refused():
    # the controller uses BPT ratios only: a job reporting milliseconds (100 "s" a step) works,
    # and its reports a few steps ahead of the other rank's are taken
    from stragglers.adapt.control import ControlPlane
    from stragglers.adapt.controller import ControlConfig
    plane = ControlPlane()
    plane.configure("j", ControlConfig(policy="dd", world_size=2, global_batch=64), None)
    plane._jobs["j"][1].monitor.clock = lambda: 0.0
    for step in range(2, 200, 10):
        for rank in (0, 1):
            plane.report("j", rank, [(s, 100.0, 32) for s in range(step, step + 10)], "", 0, 0,
                         None)
    assert plane._jobs["j"][1].monitor.latest_step == 201


@pytest.mark.parametrize("version", ["2.0", "0.9"])
def test_a_request_line_claiming_another_http_version_is_505(svc, version):
    # (fails before: httptools served a text request line claiming HTTP/2.0 or 0.9 as 1.1, 200)
    from conftest import request_line_status
    status, reply = request_line_status(svc["port"], version)
    assert status == 505 and b'"error"' in reply, reply
    assert request_line_status(svc["port"], "1.1")[0] == 200
