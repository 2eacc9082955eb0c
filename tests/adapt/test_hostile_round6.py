"""Hostile cases of a sixth round against a real service on loopback: a request's token is
judged from its head, before `100 Continue` is sent or any of its body is read, on every write
route."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import continued_write, head_only
from conftest import store_tables as tables
from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.service import EmbeddedServer

OWNER = "owner-token-0123456789"
STRANGER = "stranger-token-0123456789"
SERVICE = "service-token-0123456789"

# every write route of the service, with the data set or job the fixture makes
WRITES = ["/datasets", "/datasets/d/join", "/datasets/d/lease", "/datasets/d/ack",
          "/datasets/d/release", "/datasets/d/retry-failed", "/datasets/d/restore",
          "/jobs/j/control/config", "/jobs/j/control/report"]


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    db = tmp_path_factory.mktemp("hostile-round6") / "shards.db"
    srv = EmbeddedServer(db, service_token=SERVICE).start()
    try:
        owner = ShardClient(srv.url, "d", "w", token=OWNER, service_token=SERVICE)
        owner.create_dataset(DatasetConfig("d", 400, 10, lease_s=600))
        owner.join()
        owner.lease(1)
        got = httpx.post(srv.url + "/jobs/j/control/config", timeout=60, json={
            "policy": "bsp", "world_size": 2, "global_batch": 8},
            headers={"Authorization": f"Bearer {OWNER}", "X-Service-Token": SERVICE})
        assert got.status_code == 200, got.text
        yield {"url": srv.url, "db": db, "port": srv.port, "app": srv.app}
    finally:
        srv.stop()


def post_head(port: int, path: str, auth: str | None, length: int = 1 << 20) -> bytes:
    """conftest.head_only for a JSON POST (before the fix the service said 100 Continue and
    waited for the body)."""
    return head_only(port, "POST", path, auth, length,
                     headers="Content-Type: application/json\r\n")


def status_and_body(raw: bytes) -> tuple[int, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_every_write_route_is_listed_here(svc):
    # a route added later without a head check would otherwise escape the tests below
    paths = {r.path.replace("{name}", "d").replace("{job}", "j")
             for r in svc["app"].app.routes if "POST" in (getattr(r, "methods", None) or ())}
    assert paths == set(WRITES)


@pytest.mark.parametrize("path", WRITES)
@pytest.mark.parametrize("auth,status", [(f"Bearer {STRANGER}", 403), (None, 401),
                                         ("Bearer short", 401), (f"Basic {OWNER}", 401)])
def test_a_token_that_may_not_write_is_refused_from_the_head(svc, path, auth, status):
    # (fails before: join, lease, ack, release, retry-failed, control config and report read
    # the body first, so a stranger's well-formed token was answered 100 Continue and the
    # service read up to 1 MiB before its 403; creating a data set without the service token
    # the same)
    before = tables(svc["db"])
    got, reply = status_and_body(post_head(svc["port"], path, auth))
    assert got == status, reply
    assert set(reply) == {"error", "kind", "field"}, reply
    assert tables(svc["db"]) == before


def test_the_owner_is_still_told_to_continue(svc):
    # the head check lets the owner's body in: 100 Continue, then the answer to its body
    body = json.dumps({"worker": "w2"}).encode()
    got = continued_write(svc["port"], "POST", "/datasets/d/join", OWNER, body)
    assert got.split()[1] == b"200", got


def test_an_unknown_data_set_or_job_is_refused_from_the_head(svc):
    for path in ("/datasets/nope/lease", "/jobs/nope/control/report"):
        got, reply = status_and_body(post_head(svc["port"], path, f"Bearer {OWNER}"))
        assert got == 404 and reply["kind"] == "NotFound", reply


@pytest.mark.parametrize("path,good", [
    ("/datasets", {"name": "made", "num_samples": 10, "shard_size": 5}),
    ("/datasets/made/restore", None),
    ("/jobs/made/control/config", {"policy": "bsp", "world_size": 2, "global_batch": 8})])
def test_a_refused_creation_leaves_the_rate_of_new_tokens_as_it_was(tmp_path, path, good):
    # (fails before: a fresh token was counted against new_tokens_per_minute from the head, so
    # a creation refused for its body (400) used up the minute's only new token and the next
    # client's valid creation was refused 429)
    from stragglers.adapt.service import ServiceConfig
    from stragglers.adapt.shards import ShardStore
    store = ShardStore(tmp_path / "s.db")   # (in process: no token counted)
    store.create_dataset(DatasetConfig("src", 10, 5))
    store.close()
    srv = EmbeddedServer(tmp_path / "s.db", config=ServiceConfig(
        new_tokens_per_minute=1.0)).start()
    try:
        if good is None:   # a restore that creates: a real snapshot of another data set
            good = httpx.get(srv.url + "/datasets/src/snapshot", timeout=60).json()
            good["dataset"]["name"] = "made"
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            bad = c.post(path, content=b'{"nope": 1}', headers={
                "Authorization": "Bearer fresh-token-aaaaaaaaaaaa",
                "Content-Type": "application/json"})
            assert bad.status_code == 400, bad.text
            ok = c.post(path, json=good,
                        headers={"Authorization": "Bearer fresh-token-bbbbbbbbbbbb"})
            assert ok.status_code == 200, ok.text
    finally:
        srv.stop()


@pytest.mark.parametrize("wild", [1 << 40, 10**9, 50_000])
def test_one_wild_step_does_not_stop_a_jobs_windows_or_actions(wild):
    # (fails before: a rank's records after a step far ahead of the job — a bad clock, a
    # corrupted counter — were all taken for a report sent again (step <= its last) and
    # ignored, so no window closed again for the job; and every later action was made
    # effective past that step, never applied)
    from stragglers.adapt.controller import ControlConfig, Controller
    ctl = Controller(ControlConfig(policy="dd", world_size=2, global_batch=64, window=2,
                                   min_change=0.0, lag_s=0.0))
    ctl.observe(0, wild, 1.0, 32)
    actions = []
    for step in range(2, 40):
        for rank in (0, 1):
            actions += ctl.observe(rank, step, 1.0 if rank == 0 else 3.0, 32)
    assert actions, "no window closed after the wild step"
    assert all(a.effective_step < 100 for a in actions), actions
    assert ctl.monitor.latest_step == 39


def test_a_report_sent_again_is_still_counted_once():
    # the rule above keeps what it replaced: records at or below a rank's last step, within
    # a report's span, are a report sent again (its reply lost) and change nothing
    from stragglers.adapt.monitor import SpeedMonitor
    mon = SpeedMonitor(world_size=1, window=3)
    report = [(s, 1.0, 8) for s in range(2, 900)]
    for _ in range(2):
        for step, bpt, batch in report:
            mon.record(0, step, bpt, batch)
    assert len(mon.workers[0].records) == 256 and mon.workers[0].records[-1].step == 899
    assert mon.workers[0].since_eval == len(report)


def test_a_request_answered_from_its_head_ends_its_connection(svc):
    # (fails before: a write refused from its head for another reason than its token — an
    # unknown data set, 404 — kept the connection open with its announced body unread: a
    # client told no 100 Continue that then sends no body had its next request read as
    # that body, one that sends it had the body read as its next request's head)
    raw = post_head(svc["port"], "/datasets/nope/join", f"Bearer {OWNER}", length=20)
    head = raw.partition(b"\r\n\r\n")[0].lower()
    assert head.startswith(b"http/1.1 404") and b"connection: close" in head, raw
    # (head_only read until the service closed the connection)


@pytest.mark.parametrize("path", ["/datasets/nope/lease", "/no/such/route"])
def test_a_write_to_nothing_is_answered_after_a_pause(svc, path):
    # (fails before: with a new token on every connection (no token's turn to wait for) a
    # loop of writes to an unknown data set or path was answered as fast as it asked)
    import time
    start = time.monotonic()
    got = httpx.post(svc["url"] + path, json={"worker": "w", "fence": 1}, timeout=60,
                     headers={"Authorization": "Bearer fresh-token-cccccccccccc"})
    assert got.status_code == 404 and time.monotonic() - start >= 0.25, got.text
    assert set(got.json()) == {"error", "kind", "field"}


def test_leases_never_acked_cannot_write_epochs_without_end(tmp_path):
    # (fails before: a worker leasing in a loop without acking had a new epoch written each
    # time the open ones were all held — 300 leases of 256 one-shard epochs wrote 1,200
    # epochs and 10 MB; without an end only MAX_EPOCHS (2**20) epochs of up to 65,536 rows
    # each bounded it. Now an epoch is written only while the one `epochs_ahead` before it
    # has nothing held (`max_rows_ahead` rows): a new one past that answers "wait", as when peers hold the last shards)
    import sqlite3

    from stragglers.adapt.shards import ShardStore
    store = ShardStore(tmp_path / "s.db", max_rows_ahead=64)
    try:
        store.create_dataset(DatasetConfig("d", 16, 1, num_epochs=None, lease_s=3600))
        fence = store.join("d", "w").fence
        statuses = [store.lease("d", "w", fence, count=16).status for _ in range(20)]
        # (64 rows ahead of 16-shard epochs: 4 epochs held at most)
        assert statuses[:4] == ["ok"] * 4 and set(statuses[4:]) == {"wait"}, statuses
        with sqlite3.connect(tmp_path / "s.db") as c:
            assert c.execute("SELECT MAX(epoch) FROM shards").fetchone()[0] == 3
        # once the oldest epoch's shards are acked the next one is written
        for shard in range(16):
            store.ack("d", "w", fence, 0, shard, 1)
        assert store.lease("d", "w", fence, count=16).leases[0].epoch == 4
    finally:
        store.close()
