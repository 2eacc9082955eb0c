"""Hostile requests against a real service on loopback: each is a 4xx naming what is wrong,
and changes nothing (the SQLite file and the controller's state are compared after each).

State set up first: data set "d" owned by job token OWNER (worker "w" joined with fence 1,
holding shard 0/s with 3 samples acknowledged), data set "e" owned by OTHER, and job "d"'s
controller (incarnation 1). The service requires its own token to create anything.
"""

from __future__ import annotations

import json
import sqlite3

import httpx
import pytest

from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.replies import to_builtins
from stragglers.adapt.service import EmbeddedServer

OWNER, OTHER, NEW = "owner-token-0123456789", "other-token-0123456789", "new-job-token-0123456789"
SERVICE = "service-token-0123456789"
HEADERS = {
    "owner": {"Authorization": f"Bearer {OWNER}"},
    "other": {"Authorization": f"Bearer {OTHER}"},
    "none": {},
    "malformed": {"Authorization": "Bearer short"},
    "basic": {"Authorization": f"Basic {OWNER}"},
    "create": {"Authorization": f"Bearer {NEW}", "X-Service-Token": SERVICE},
    "create-nosvc": {"Authorization": f"Bearer {NEW}"},
    "create-badsvc": {"Authorization": f"Bearer {NEW}", "X-Service-Token": "wrong-" + SERVICE},
    "owner-svc": {"Authorization": f"Bearer {OWNER}", "X-Service-Token": SERVICE},
    "other-svc": {"Authorization": f"Bearer {OTHER}", "X-Service-Token": SERVICE},
}
DS = {"name": "n", "num_samples": 100, "shard_size": 10}
W = {"worker": "w", "fence": 1}


def ds(**kw):
    return {**DS, **kw}


def raw(text: str) -> bytes:
    return text.encode()


CONFIG = {"policy": "nd", "world_size": 2, "global_batch": 64, "incarnation": 1}
REPORT = {"rank": 0, "records": [[5, 0.1, 32]], "incarnation": 1}

# (id, method, path, body, headers, status, field or error substring)
CASES = [
    # -- create ------------------------------------------------------------------------
    ("name-int", "POST", "/datasets", ds(name=123), "create", 400, "name"),
    ("name-empty", "POST", "/datasets", ds(name=""), "create", 400, "name"),
    ("name-slash", "POST", "/datasets", ds(name="a/b"), "create", 400, "name"),
    ("name-long", "POST", "/datasets", ds(name="x" * 200), "create", 400, "name"),
    ("name-16MiB", "POST", "/datasets", ds(name="x" * (16 << 20)), "create", 413, None),
    ("samples-string", "POST", "/datasets", ds(num_samples="100"), "create", 400, "num_samples"),
    ("samples-float", "POST", "/datasets", ds(num_samples=10.9), "create", 400, "num_samples"),
    ("samples-integral-float", "POST", "/datasets", ds(num_samples=100.0), "create", 400, "num_samples"),
    ("samples-zero", "POST", "/datasets", ds(num_samples=0), "create", 400, "num_samples"),
    ("samples-negative", "POST", "/datasets", ds(num_samples=-1), "create", 400, "num_samples"),
    ("samples-2^63", "POST", "/datasets", ds(num_samples=2 ** 63), "create", 400, "num_samples"),
    ("samples-huge", "POST", "/datasets", raw('{"name":"n","num_samples":1' + "0" * 400 + ',"shard_size":1}'), "create", 400, "num_samples"),
    ("samples-infinity", "POST", "/datasets", raw('{"name":"n","num_samples":Infinity,"shard_size":1}'), "create", 400, "num_samples"),
    ("samples-bool", "POST", "/datasets", ds(num_samples=True), "create", 400, "num_samples"),
    ("samples-null", "POST", "/datasets", ds(num_samples=None), "create", 400, "num_samples"),
    ("shard-size-zero", "POST", "/datasets", ds(shard_size=0), "create", 400, "shard_size"),
    ("million-shards", "POST", "/datasets", ds(num_samples=1_000_000, shard_size=1), "create", 400, "shard_size"),
    ("lease-nan", "POST", "/datasets", raw('{"name":"n","num_samples":10,"shard_size":1,"lease_s":NaN}'), "create", 400, "lease_s"),
    ("lease-inf", "POST", "/datasets", raw('{"name":"n","num_samples":10,"shard_size":1,"lease_s":1e999}'), "create", 400, "lease_s"),
    ("lease-tiny", "POST", "/datasets", ds(lease_s=0.001), "create", 400, "lease_s"),
    ("lease-negative", "POST", "/datasets", ds(lease_s=-1), "create", 400, "lease_s"),
    ("lease-string", "POST", "/datasets", ds(lease_s="30"), "create", 400, "lease_s"),
    ("retries-negative", "POST", "/datasets", ds(max_retries=-1), "create", 400, "max_retries"),
    ("retries-huge", "POST", "/datasets", ds(max_retries=10 ** 6), "create", 400, "max_retries"),
    ("epochs-zero", "POST", "/datasets", ds(num_epochs=0), "create", 400, "num_epochs"),
    ("seed-negative", "POST", "/datasets", ds(seed=-1), "create", 400, "seed"),
    ("seed-2^64", "POST", "/datasets", ds(seed=2 ** 64), "create", 400, "seed"),
    ("create-extra-field", "POST", "/datasets", ds(evil=1), "create", 400, "evil"),
    ("create-missing-name", "POST", "/datasets", {"num_samples": 10, "shard_size": 1}, "create", 400, "name"),
    ("create-not-json", "POST", "/datasets", raw("hello"), "create", 400, "JSON"),
    ("create-list", "POST", "/datasets", raw("[]"), "create", 400, "object"),
    ("create-deep", "POST", "/datasets", raw("[" * 100_000 + "]" * 100_000), "create", 400, "JSON"),
    ("create-2MiB", "POST", "/datasets", raw(json.dumps(ds(pad="x" * (2 << 20)))), "create", 413, None),
    ("create-no-token", "POST", "/datasets", ds(), "none", 401, None),
    ("create-malformed-token", "POST", "/datasets", ds(), "malformed", 401, None),
    ("create-basic-auth", "POST", "/datasets", ds(), "basic", 401, None),
    ("create-no-service-token", "POST", "/datasets", ds(), "create-nosvc", 403, None),
    ("create-bad-service-token", "POST", "/datasets", ds(), "create-badsvc", 403, None),
    ("recreate-other-lease", "POST", "/datasets", ds(name="d", num_samples=40, lease_s=0.05), "owner-svc", 409, "lease_s"),
    ("recreate-by-other-job", "POST", "/datasets", ds(name="d", num_samples=40), "other-svc", 403, None),
    # -- join ----------------------------------------------------------------------------
    ("join-worker-int", "POST", "/datasets/d/join", {"worker": 123}, "owner", 400, "worker"),
    ("join-worker-empty", "POST", "/datasets/d/join", {"worker": ""}, "owner", 400, "worker"),
    ("join-worker-long", "POST", "/datasets/d/join", {"worker": "w" * 16384}, "owner", 400, "worker"),
    ("join-worker-newline", "POST", "/datasets/d/join", {"worker": "a\nb"}, "owner", 400, "worker"),
    ("join-no-token", "POST", "/datasets/d/join", {"worker": "w"}, "none", 401, None),
    ("join-other-job", "POST", "/datasets/d/join", {"worker": "w"}, "other", 403, None),
    ("join-unknown-dataset", "POST", "/datasets/zzz/join", {"worker": "w"}, "owner", 404, None),
    ("join-bad-path-name", "POST", "/datasets/a%20b/join", {"worker": "w"}, "owner", 400, "name"),
    # -- lease ---------------------------------------------------------------------------
    ("count-string", "POST", "/datasets/d/lease", {**W, "count": "2"}, "owner", 400, "count"),
    ("count-float", "POST", "/datasets/d/lease", {**W, "count": 2.0}, "owner", 400, "count"),
    ("count-zero", "POST", "/datasets/d/lease", {**W, "count": 0}, "owner", 400, "count"),
    ("count-257", "POST", "/datasets/d/lease", {**W, "count": 257}, "owner", 400, "count"),
    ("count-2^63", "POST", "/datasets/d/lease", {**W, "count": 2 ** 63}, "owner", 400, "count"),
    ("fence-string", "POST", "/datasets/d/lease", {"worker": "w", "fence": "1"}, "owner", 400, "fence"),
    ("fence-zero", "POST", "/datasets/d/lease", {"worker": "w", "fence": 0}, "owner", 400, "fence"),
    ("fence-negative", "POST", "/datasets/d/lease", {"worker": "w", "fence": -5}, "owner", 400, "fence"),
    ("fence-float", "POST", "/datasets/d/lease", {"worker": "w", "fence": 1.5}, "owner", 400, "fence"),
    ("fence-missing", "POST", "/datasets/d/lease", {"worker": "w"}, "owner", 400, "fence"),
    ("fence-stale", "POST", "/datasets/d/lease", {"worker": "w", "fence": 99}, "owner", 409, "fence"),
    ("lease-not-joined", "POST", "/datasets/d/lease", {"worker": "ghost", "fence": 1}, "owner", 409, "joined"),
    ("request-id-long", "POST", "/datasets/d/lease", {**W, "request_id": "r" * 100}, "owner", 400, "request_id"),
    ("request-id-slash", "POST", "/datasets/d/lease", {**W, "request_id": "a/b"}, "owner", 400, "request_id"),
    ("request-id-int", "POST", "/datasets/d/lease", {**W, "request_id": 5}, "owner", 400, "request_id"),
    ("lease-other-job", "POST", "/datasets/d/lease", W, "other", 403, None),
    ("lease-no-token", "POST", "/datasets/d/lease", W, "none", 401, None),
    ("lease-empty-body", "POST", "/datasets/d/lease", raw(""), "owner", 400, "worker"),
    # -- ack -----------------------------------------------------------------------------
    ("consumed-float", "POST", "/datasets/d/ack", {**W, "epoch": 0, "shard": "S", "consumed": 10.9}, "owner", 400, "consumed"),
    ("consumed-string", "POST", "/datasets/d/ack", {**W, "epoch": 0, "shard": "S", "consumed": "3"}, "owner", 400, "consumed"),
    ("consumed-negative", "POST", "/datasets/d/ack", {**W, "epoch": 0, "shard": "S", "consumed": -1}, "owner", 400, "consumed"),
    ("consumed-nan", "POST", "/datasets/d/ack", raw('{"worker":"w","fence":1,"epoch":0,"shard":S,"consumed":NaN}'), "owner", 400, "consumed"),
    ("consumed-past-shard", "POST", "/datasets/d/ack", {**W, "epoch": 0, "shard": "S", "consumed": 11}, "owner", 400, "consumed"),
    ("epoch-negative", "POST", "/datasets/d/ack", {**W, "epoch": -1, "shard": "S", "consumed": 4}, "owner", 400, "epoch"),
    ("epoch-2^63", "POST", "/datasets/d/ack", {**W, "epoch": 2 ** 63, "shard": "S", "consumed": 4}, "owner", 400, "epoch"),
    ("shard-huge", "POST", "/datasets/d/ack", {**W, "epoch": 0, "shard": 99_999_999, "consumed": 4}, "owner", 400, "shard"),
    ("shard-missing-row", "POST", "/datasets/d/ack", {**W, "epoch": 0, "shard": 50, "consumed": 4}, "owner", 400, "shard"),
    ("ack-not-leased", "POST", "/datasets/d/ack", {**W, "epoch": 0, "shard": "T", "consumed": 4}, "owner", 409, "not leased"),
    ("ack-extra", "POST", "/datasets/d/ack", {**W, "epoch": 0, "shard": "S", "consumed": 4, "x": 1}, "owner", 400, "x"),
    ("ack-other-job", "POST", "/datasets/d/ack", {**W, "epoch": 0, "shard": "S", "consumed": 4}, "other", 403, None),
    ("ack-stale-fence", "POST", "/datasets/d/ack", {"worker": "w", "fence": 2, "epoch": 0, "shard": "S", "consumed": 4}, "owner", 409, "fence"),
    # -- release / retry-failed ----------------------------------------------------------
    ("error-4MiB", "POST", "/datasets/d/release", {**W, "error": "x" * (4 << 20)}, "owner", 413, None),
    ("error-long", "POST", "/datasets/d/release", {**W, "error": "x" * 2000}, "owner", 400, "error"),
    ("failure-string", "POST", "/datasets/d/release", {**W, "failure": "yes"}, "owner", 400, "failure"),
    ("failure-int", "POST", "/datasets/d/release", {**W, "failure": 1}, "owner", 400, "failure"),
    ("release-other-job", "POST", "/datasets/d/release", {"worker": "w"}, "other", 403, None),
    ("release-fence-zero", "POST", "/datasets/d/release", {"worker": "w", "fence": 0}, "owner", 400, "fence"),
    ("retry-failed-extra", "POST", "/datasets/d/retry-failed", {"x": 1}, "owner", 400, "x"),
    ("retry-failed-other-job", "POST", "/datasets/d/retry-failed", {}, "other", 403, None),
    # -- restore -------------------------------------------------------------------------
    ("restore-bogus-state", "POST", "/datasets/d/restore", "SNAP:state", "owner", 400, "shards.0.2"),
    ("restore-other-name", "POST", "/datasets/d/restore", "SNAP:name", "owner", 400, "dataset.name"),
    ("restore-other-lease", "POST", "/datasets/d/restore", "SNAP:lease", "owner", 409, "lease_s"),
    ("restore-missing-shard", "POST", "/datasets/d/restore", "SNAP:drop", "owner", 400, "shards"),
    ("restore-consumed-past", "POST", "/datasets/d/restore", "SNAP:consumed", "owner", 400, "consumed"),
    ("restore-other-job", "POST", "/datasets/d/restore", "SNAP:same", "other", 403, None),
    ("restore-not-object", "POST", "/datasets/d/restore", raw('"x"'), "owner", 400, "object"),
    ("restore-creates-without-service-token", "POST", "/datasets/n/restore", "SNAP:new", "owner", 403, "service token"),
    # -- control plane -------------------------------------------------------------------
    ("policy-unknown", "POST", "/jobs/n/control/config", {**CONFIG, "policy": "asp"}, "create", 400, "policy"),
    ("world-zero", "POST", "/jobs/n/control/config", {**CONFIG, "world_size": 0}, "create", 400, "world_size"),
    ("batch-below-world", "POST", "/jobs/n/control/config", {**CONFIG, "world_size": 8, "global_batch": 4}, "create", 400, "global_batch"),
    ("theta-nan", "POST", "/jobs/n/control/config", raw('{"policy":"nd","world_size":2,"global_batch":64,"theta":NaN}'), "create", 400, "theta"),
    ("config-other-job", "POST", "/jobs/d/control/config", {**CONFIG, "incarnation": 2}, "other", 403, None),
    ("config-older-incarnation", "POST", "/jobs/d/control/config", {**CONFIG, "incarnation": 0, "window": 9}, "owner", 409, "incarnation"),
    ("config-no-service-token", "POST", "/jobs/n/control/config", CONFIG, "create-nosvc", 403, None),
    ("report-nan", "POST", "/jobs/d/control/report", raw('{"rank":0,"records":[[5,NaN,32]],"incarnation":1}'), "owner", 400, "records.0.1"),
    # (fails before: 5e-324 s was a per-sample time of 0, and ND gave that, the fastest, rank
    # no samples)
    ("report-bpt-subnormal", "POST", "/jobs/d/control/report", raw('{"rank":0,"records":[[5,5e-324,32]],"incarnation":1}'), "owner", 400, "records.0.1"),
    ("report-rank-past-world", "POST", "/jobs/d/control/report", {**REPORT, "rank": 99}, "owner", 400, "rank"),
    ("report-bad-last-record", "POST", "/jobs/d/control/report", {**REPORT, "records": [[5, 0.1, 32], [6, 0.1, 32], [7, -1.0, 32]]}, "owner", 400, "records.2.1"),
    ("report-too-many", "POST", "/jobs/d/control/report", {**REPORT, "records": [[i, 0.1, 32] for i in range(10_001)]}, "owner", 400, "records"),
    ("report-step-string", "POST", "/jobs/d/control/report", {**REPORT, "records": [["5", 0.1, 32]]}, "owner", 400, "records.0.0"),
    ("report-other-job", "POST", "/jobs/d/control/report", REPORT, "other", 403, None),
    ("report-unknown-job", "POST", "/jobs/zzz/control/report", REPORT, "owner", 404, None),
    ("actions-negative", "GET", "/jobs/d/control/actions?since=-1", None, "none", 400, "since"),
    ("actions-not-int", "GET", "/jobs/d/control/actions?since=abc", None, "none", 400, "since"),
    # (the next two fail before: '00' was read as 0 and the second `since` silently won)
    ("actions-leading-zero", "GET", "/jobs/d/control/actions?since=00", None, "none", 400, "since"),
    ("actions-since-twice", "GET", "/jobs/d/control/actions?since=1&since=2", None, "none", 400, "since"),
    ("actions-wide-digit", "GET", "/jobs/d/control/actions?since=%EF%BC%91", None, "none", 400, "since"),
    ("actions-plus", "GET", "/jobs/d/control/actions?since=%2B1", None, "none", 400, "since"),
    ("state-unknown-job", "GET", "/jobs/zzz/control/state", None, "none", 404, None),
]


def tables(db):
    with sqlite3.connect(db) as c:
        return {t: c.execute(f"SELECT * FROM {t} ORDER BY 1, 2, 3").fetchall()
                for t in ("datasets", "shards", "workers")}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    db = tmp_path_factory.mktemp("hostile") / "shards.db"
    srv = EmbeddedServer(db, service_token=SERVICE).start()
    owner = ShardClient(srv.url, "d", "w", token=OWNER, service_token=SERVICE)
    owner.create_dataset(DatasetConfig("d", 40, 10, lease_s=600))
    assert owner.join() == 1
    held = owner.lease().leases[0]
    owner.ack(held.epoch, held.shard, 3)
    other = ShardClient(srv.url, "e", "w", token=OTHER, service_token=SERVICE)
    other.create_dataset(DatasetConfig("e", 40, 10))
    owner.configure_control(CONFIG)
    owner.report_steps(0, [[3, 0.1, 32]], "", 1)
    snap = to_builtins(owner.snapshot())   # the JSON document, to tamper with
    free = next(s for s in range(4) if s != held.shard)
    yield {"url": srv.url, "db": db, "shard": held.shard, "free": free, "snap": snap,
           "tables": tables(db), "state": httpx.get(f"{srv.url}/jobs/d/control/state").json()}
    srv.stop()


def snapshot_variant(snap: dict, kind: str) -> dict:
    snap = json.loads(json.dumps(snap))
    if kind == "state":
        snap["shards"][0][2] = "BOGUS"
    elif kind == "name":
        snap["dataset"]["name"] = "e"
    elif kind == "lease":
        snap["dataset"]["lease_s"] = 60.0
    elif kind == "drop":
        snap["shards"].pop()
    elif kind == "consumed":
        snap["shards"][0][3] = 11
    elif kind == "new":
        snap["dataset"]["name"] = "n"
    return snap


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_is_refused_and_changes_nothing(setup, case):
    _, method, path, body, headers, status, named = case
    if isinstance(body, str) and body.startswith("SNAP:"):
        body = snapshot_variant(setup["snap"], body[5:])
    if isinstance(body, dict):
        body = {k: setup["shard"] if v == "S" else setup["free"] if v == "T" else v
                for k, v in body.items()}
        content = json.dumps(body).encode()
    else:
        content = body.replace(b"shard\":S", f"shard\":{setup['shard']}".encode()) if body else body
    resp = httpx.request(method, setup["url"] + path, content=content, timeout=120,
                         headers={"Content-Type": "application/json", **HEADERS[headers]})
    assert resp.status_code == status, resp.text[:500]
    reply = resp.json()
    assert set(reply) == {"error", "kind", "field"} and len(reply["error"]) < 2000
    if named is not None:
        assert named == reply["field"] or named in reply["error"], reply
    assert tables(setup["db"]) == setup["tables"], "a refused request changed the database"
    assert httpx.get(f"{setup['url']}/jobs/d/control/state").json() == setup["state"]


def test_the_service_still_serves_after_the_hostile_requests(setup):
    client = ShardClient(setup["url"], "d", "w", token=OWNER)
    client.fence = 1
    assert client.ack(0, setup["shard"], 4).consumed == 4
    with sqlite3.connect(setup["db"]) as c:
        assert c.execute("PRAGMA integrity_check").fetchone() == ("ok",)


def test_a_lease_whose_reply_was_lost_is_returned_again(setup):
    """The client timed out and sends the same request again: the same shard, not a second."""
    headers = HEADERS["owner"]
    f = httpx.post(f"{setup['url']}/datasets/e/join", json={"worker": "x"},
                   headers=HEADERS["other"]).json()["fence"]
    body = {"worker": "x", "fence": f, "request_id": "attempt-1"}
    first = httpx.post(f"{setup['url']}/datasets/e/lease", json=body, headers=HEADERS["other"]).json()
    again = httpx.post(f"{setup['url']}/datasets/e/lease", json=body, headers=HEADERS["other"]).json()
    assert first["leases"] == again["leases"] and len(first["leases"]) == 1
    status = httpx.get(f"{setup['url']}/datasets/e/status", headers=headers).json()
    assert status["epochs"]["0"]["DOING"] == 1


def test_jobs_have_separate_controllers(setup):
    other = ShardClient(setup["url"], "e", "agent", token=OTHER, service_token=SERVICE)
    other.configure_control({"policy": "dd", "world_size": 4, "global_batch": 128})
    assert other.control_state().config["policy"] == "dd"
    assert httpx.get(f"{setup['url']}/jobs/d/control/state").json()["config"]["policy"] == "nd"


@pytest.mark.slow
def test_stalled_connections_past_the_limit_do_not_lock_clients_out(tmp_path, caplog):
    # Clients that send a request head and part of a body, then nothing, past max_connections:
    # the serving layer evicts stalled connections, so /health is still answered (it used to
    # be 503 for everyone until they hung up); their hang-ups leave no traceback in the log.
    import logging
    import socket
    import time

    from stragglers.adapt.service import ServiceConfig

    srv = EmbeddedServer(tmp_path / "s.db", config=ServiceConfig(max_connections=8)).start()
    held = []
    try:
        with caplog.at_level(logging.INFO):
            for _ in range(12):
                k = socket.create_connection(("127.0.0.1", srv.port))
                k.sendall(b"POST /datasets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                          b"\r\nContent-Length: 100\r\n\r\n{")
                held.append(k)
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{srv.url}/health", timeout=30).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "/health never answered"
                time.sleep(0.05)
            for k in held:
                k.close()
            assert httpx.get(f"{srv.url}/health", timeout=30).status_code == 200
        assert not [r for r in caplog.records if r.exc_info], \
            [r.getMessage() for r in caplog.records if r.exc_info]
    finally:
        for k in held:
            k.close()
        srv.stop()


@pytest.mark.slow
@pytest.mark.parametrize("path", ["/datasets", "/datasets/d/restore", "/datasets/d/join",
                                  "/jobs/d/control/config", "/jobs/d/control/report"])
def test_a_write_without_a_token_is_refused_before_its_body_is_read(setup, path):
    # The request head announces a 60 MB body and none of it is sent: the service answers 401
    # from the head alone (it used to read and parse the body first — up to 64 MiB of JSON for
    # a restore — before looking at the token).
    import socket

    host, port = setup["url"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as k:
        k.sendall(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: 60000000\r\n\r\n".encode())
        head = k.recv(4096).decode(errors="replace")
    assert head.startswith("HTTP/1.1 401"), head[:200]
