"""Hostile requests, third round, against a real service on loopback: framing the services
do not take (transfer codings, expectations), numbers at the edges in every numeric field,
acks of shards a worker never held. Each is refused in the service's error shape and changes
nothing."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from conftest import store_tables as tables
from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.service import EmbeddedServer

OWNER = "owner-token-0123456789"


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    db = tmp_path_factory.mktemp("hostile-round3") / "shards.db"
    srv = EmbeddedServer(db).start()
    owner = ShardClient(srv.url, "d", "w", token=OWNER)
    owner.create_dataset(DatasetConfig("d", 400, 10, lease_s=600))
    fence = owner.join()
    held = owner.lease(1)
    other = ShardClient(srv.url, "d", "v", token=OWNER)
    other_fence = other.join()
    yield {"url": srv.url, "db": db, "port": srv.port, "fence": fence,
           "held": held.leases[0], "other_fence": other_fence}
    srv.stop()


def exchange(port: int, request: bytes) -> tuple[int, dict]:
    """The status and JSON body of the one answer to `request` (raw bytes)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as k:
        k.sendall(request)
        k.shutdown(socket.SHUT_WR)
        got = b""
        while chunk := k.recv(65536):
            got += chunk
    if got.startswith(b"HTTP/1.1 100 "):
        got = got.partition(b"\r\n\r\n")[2]
    head, _, body = got.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def lease_request(svc, extra_headers: str, body: bytes, chunked: bool) -> bytes:
    head = (f"POST /datasets/d/lease HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer "
            f"{OWNER}\r\nContent-Type: application/json\r\n{extra_headers}")
    if chunked:
        return head.encode() + b"\r\n" + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    return head.encode() + f"Content-Length: {len(body)}\r\n\r\n".encode() + body


@pytest.mark.parametrize("headers,chunked,status", [
    ("Transfer-Encoding: gzip, chunked\r\n", True, 501),
    ("Transfer-Encoding: identity\r\n", False, 400),   # (refused by the parser already)
    ("Expect: 200-ok\r\n", False, 417),
    ("Expect: 100-continue, x\r\n", False, 417),
])
def test_framing_the_service_does_not_take_is_refused(svc, headers, chunked, status):
    # (fails before: 'gzip, chunked' and unknown expectations were served, a shard leased)
    body = json.dumps({"worker": "w", "fence": svc["fence"]}).encode()
    before = tables(svc["db"])
    got, reply = exchange(svc["port"], lease_request(svc, headers, body, chunked))
    assert got == status, reply
    assert set(reply) == {"error", "kind", "field"}, reply
    assert tables(svc["db"]) == before
    # plain chunked and 100-continue are taken as before
    ok, _ = exchange(svc["port"], lease_request(
        svc, "Transfer-Encoding: chunked\r\n" if chunked else "Expect: 100-continue\r\n",
        json.dumps({"worker": "w", "fence": svc["fence"], "request_id": "same"}).encode(),
        chunked))
    assert ok == 200


EDGES = ["NaN", "Infinity", "-Infinity", "1e400", "-1e400", "9223372036854775808",
         "18446744073709551616", "-0", "-0.0", "1.5", "1e2", "true", "null", '"1"', "[]", "{}",
         "-1"]
FIELDS = [("/datasets/d/lease", "fence"), ("/datasets/d/lease", "count"),
          ("/datasets/d/ack", "fence"), ("/datasets/d/ack", "epoch"),
          ("/datasets/d/ack", "shard"), ("/datasets/d/ack", "consumed")]


@pytest.mark.parametrize("edge", EDGES)
@pytest.mark.parametrize("path,field", FIELDS, ids=[f"{p.rsplit('/', 1)[1]}-{f}"
                                                    for p, f in FIELDS])
def test_numbers_at_the_edges_in_every_numeric_field_are_refused(svc, path, field, edge):
    held = svc["held"]
    body = {"worker": "w", "fence": svc["fence"]}
    if path.endswith("ack"):
        body.update(epoch=held.epoch, shard=held.shard, consumed=1)
    text = json.dumps(body)
    key = f'"{field}": '
    if key in text:
        start = text.index(key) + len(key)
        end = start + len(text[start:].split(",")[0].split("}")[0])
        text = text[:start] + edge + text[end:]
    else:
        text = text[:-1] + f', {key}{edge}}}'
    before = tables(svc["db"])
    resp = httpx.post(svc["url"] + path, content=text.encode(), timeout=60,
                      headers={"Authorization": f"Bearer {OWNER}",
                               "Content-Type": "application/json"})
    if edge == "1e2" or (edge == "-0" and field in ("epoch", "shard", "consumed")):
        return   # (1e2 is a float: refused below; -0 is the integer 0, a value like any)
    assert resp.status_code == 400, resp.text
    assert resp.json()["field"] == field, resp.text
    assert tables(svc["db"]) == before


@pytest.mark.slow
def test_acks_of_shards_never_leased_or_held_by_another_worker_change_nothing(svc):
    held = svc["held"]
    h = {"Authorization": f"Bearer {OWNER}"}
    before = tables(svc["db"])
    for worker, fence, epoch, shard in [
            ("v", svc["other_fence"], held.epoch, held.shard),       # another worker's shard
            ("w", svc["fence"], held.epoch, (held.shard + 7) % 40),  # a shard never leased
            ("w", svc["fence"], 5, 0),                               # an epoch not created
            ("w", svc["fence"], held.epoch, 39999)]:                 # no such shard
        r = httpx.post(f"{svc['url']}/datasets/d/ack", json={
            "worker": worker, "fence": fence, "epoch": epoch, "shard": shard,
            "consumed": 10}, headers=h)
        assert r.status_code in (400, 404, 409), r.text
        assert set(r.json()) == {"error", "kind", "field"}
        assert tables(svc["db"]) == before
