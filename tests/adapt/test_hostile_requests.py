"""Hostile requests of kinds the first suite missed, against a real service on loopback: keys
given twice, bodies not declared JSON, headers given twice, a client that half-closes. Each
refused one is answered in the service's error shape and changes nothing."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from conftest import store_tables as tables
from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.service import EmbeddedServer

OWNER, OTHER = "owner-token-0123456789", "other-token-0123456789"
NEW, SERVICE = "new-job-token-0123456789", "service-token-0123456789"
JSON = "application/json"


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    db = tmp_path_factory.mktemp("hostile-requests") / "shards.db"
    srv = EmbeddedServer(db, service_token=SERVICE).start()
    owner = ShardClient(srv.url, "d", "w", token=OWNER, service_token=SERVICE)
    owner.create_dataset(DatasetConfig("d", 400, 10, lease_s=600))
    owner.join()
    owner.configure_control({"policy": "nd", "world_size": 2, "global_batch": 64,
                             "incarnation": 1})
    yield {"url": srv.url, "db": db, "port": srv.port}
    srv.stop()


def refused(svc, path: str, content: bytes, headers: dict | list, status: int) -> dict:
    """POST it; assert `status` in the error shape and no change to the state; the reply."""
    before = tables(svc["db"])
    state = httpx.get(f"{svc['url']}/jobs/d/control/state").json()
    resp = httpx.post(svc["url"] + path, content=content, headers=headers, timeout=120)
    assert resp.status_code == status, resp.text[:300]
    reply = resp.json()
    assert "error" in reply and len(reply["error"]) < 2000, reply
    assert tables(svc["db"]) == before, "a refused request changed the database"
    assert httpx.get(f"{svc['url']}/jobs/d/control/state").json() == state
    return reply


DUPLICATES = [
    ("lease-fence", "/datasets/d/lease", b'{"worker":"w","fence":1,"fence":1}', "fence"),
    ("lease-worker", "/datasets/d/lease", b'{"worker":"x","fence":1,"worker":"w"}', "worker"),
    ("join-worker", "/datasets/d/join", b'{"worker":"a","worker":"b"}', "worker"),
    ("escaped-twin", "/datasets/d/join", b'{"worker":"a","\\u0077orker":"b"}', "worker"),
    ("release-failure", "/datasets/d/release",
     b'{"worker":"w","fence":1,"failure":true,"failure":false}', "failure"),
    ("create-name", "/datasets", b'{"name":"n1","num_samples":10,"shard_size":1,"name":"n2"}',
     "name"),
    ("config-policy", "/jobs/d/control/config",
     b'{"policy":"nd","world_size":2,"global_batch":64,"incarnation":2,"policy":"dd"}',
     "policy"),
]


@pytest.mark.parametrize("case", DUPLICATES, ids=[c[0] for c in DUPLICATES])
def test_a_key_given_twice_is_refused(svc, case):
    # pydantic took the last of the two (another parser takes the first): a lease was granted
    _, path, body, key = case
    token = NEW if path == "/datasets" else OWNER
    reply = refused(svc, path, body, {"Authorization": f"Bearer {token}",
                                      "X-Service-Token": SERVICE, "Content-Type": JSON}, 400)
    assert reply["field"] == key and "twice" in reply["error"], reply


MEDIA = [
    ("text-plain", "text/plain"),
    ("form", "application/x-www-form-urlencoded"),
    ("latin-1", "application/json; charset=latin-1"),
    ("json-lookalike", "application/jsonx"),
    ("missing", None),
]


@pytest.mark.parametrize("case", MEDIA, ids=[c[0] for c in MEDIA])
@pytest.mark.parametrize("path,body", [("/datasets/d/join", b'{"worker":"m"}'),
                                       ("/datasets/d/lease", b'{"worker":"w","fence":1}')])
def test_a_body_not_declared_json_is_refused(svc, case, path, body):
    # it was parsed as JSON whatever it said it was (a join was made from a text/plain body)
    headers = {"Authorization": f"Bearer {OWNER}"}
    if case[1] is not None:
        headers["Content-Type"] = case[1]
    reply = refused(svc, path, body, headers, 415)
    assert reply["field"] == "Content-Type", reply


def test_json_with_its_charset_and_an_empty_body_without_a_type_are_taken(svc):
    ok = httpx.post(f"{svc['url']}/datasets/d/join", content=b'{"worker":"cs"}', headers={
        "Authorization": f"Bearer {OWNER}", "Content-Type": "Application/JSON; charset=UTF-8"})
    assert ok.status_code == 200, ok.text
    empty = httpx.post(f"{svc['url']}/datasets/d/retry-failed",
                       headers={"Authorization": f"Bearer {OWNER}"})
    assert empty.status_code == 200, empty.text


TWICE = [
    ("authorization", [("Authorization", f"Bearer {OWNER}"), ("Authorization", f"Bearer {OTHER}")]),
    ("authorization", [("Authorization", f"Bearer {OTHER}"), ("Authorization", f"Bearer {OWNER}")]),
    ("content-type", [("Authorization", f"Bearer {OWNER}"), ("Content-Type", "text/plain")]),
]


@pytest.mark.parametrize("name,headers", TWICE)
def test_a_header_given_twice_is_refused(svc, name, headers):
    # the first of two Authorization headers was used (a proxy that checks the last one is
    # fooled); the same for the service token below
    reply = refused(svc, "/datasets/d/join", b'{"worker":"t2"}',
                    [*headers, ("Content-Type", JSON)], 400)
    assert name in reply["error"] and "more than once" in reply["error"], reply


def test_a_service_token_given_twice_is_refused(svc):
    body = json.dumps({"name": "twice", "num_samples": 10, "shard_size": 1}).encode()
    for pair in ([SERVICE, "wrong-service-token-000"], ["wrong-service-token-000", SERVICE]):
        reply = refused(svc, "/datasets", body, [("Authorization", f"Bearer {NEW}"),
                                                 ("X-Service-Token", pair[0]),
                                                 ("X-Service-Token", pair[1]),
                                                 ("Content-Type", JSON)], 400)
        assert "x-service-token" in reply["error"], reply


def exchange(port: int, request: bytes) -> bytes:
    """Send `request`, half-close (shutdown SHUT_WR), read until the service closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as k:
        k.sendall(request)
        k.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := k.recv(65536):
            out += chunk
    return out


def post(path: str, body: dict) -> bytes:
    raw = json.dumps(body).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {OWNER}\r\n"
            f"Content-Type: {JSON}\r\nContent-Length: {len(raw)}\r\n\r\n").encode() + raw


def test_a_client_that_half_closes_after_its_request_gets_the_answer(svc):
    # The connection was closed at the client's FIN while the app went on: the join (or a
    # lease) was made and its answer thrown away.
    fence = httpx.post(f"{svc['url']}/datasets/d/join", json={"worker": "hc"},
                       headers={"Authorization": f"Bearer {OWNER}"}).json()["fence"]
    out = exchange(svc["port"], post("/datasets/d/lease",
                                     {"worker": "hc", "fence": fence, "request_id": "hc-1"}))
    assert out.startswith(b"HTTP/1.1 200"), out[:200]
    reply = json.loads(out.split(b"\r\n\r\n", 1)[1])
    again = httpx.post(f"{svc['url']}/datasets/d/lease", headers={"Authorization": f"Bearer {OWNER}"},
                       json={"worker": "hc", "fence": fence, "request_id": "hc-1"}).json()
    assert [x["shard"] for x in reply["leases"]] == [x["shard"] for x in again["leases"]]


def test_half_closed_pipelined_requests_are_all_answered(svc):
    out = exchange(svc["port"], b"".join(post("/datasets/d/join", {"worker": f"p{i}"})
                                         for i in range(5)))
    assert out.count(b"HTTP/1.1 200") == 5, out[:400]


def test_a_half_closed_request_whose_body_never_comes_is_closed(svc):
    head = (f"POST /datasets/d/join HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {OWNER}"
            f"\r\nContent-Type: {JSON}\r\nContent-Length: 100\r\n\r\n").encode()
    before = tables(svc["db"])
    exchange(svc["port"], head + b'{"worker":')   # returns: the service closed it
    assert tables(svc["db"]) == before
    assert httpx.get(f"{svc['url']}/health").status_code == 200


@pytest.mark.slow
def test_a_refused_body_is_answered_after_a_pause(svc):
    # Three clients looping on refused bodies (keys twice, a form, 1 MB of ints in an unknown
    # field) took the event loop from every job's leases; each refusal now waits
    # refusal_delay_s (0.25 s) first, as a refused token does.
    import time

    for body, ctype in ((b'{"worker":"a","worker":"b"}', JSON), (b"worker=a", "text/plain"),
                        (json.dumps({"worker": "a", "pad": list(range(50_000))}).encode(), JSON)):
        start = time.monotonic()
        resp = httpx.post(f"{svc['url']}/datasets/d/join", content=body, headers={
            "Authorization": f"Bearer {OWNER}", "Content-Type": ctype})
        assert resp.status_code in (400, 415) and time.monotonic() - start >= 0.25, resp.text
