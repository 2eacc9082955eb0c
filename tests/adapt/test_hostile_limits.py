"""Hostile requests that grow what the service keeps or spends: invented worker names, keys
given twice in a big restore body, a restore whose every row is bad. Each is refused in the
service's error shape and changes nothing (a real service on loopback, a real SQLite file)."""

from __future__ import annotations

import json
import sqlite3

import httpx
import pytest
from conftest import eventually, readable
from pydantic import ValidationError

from stragglers.adapt import requests as rq
from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.service import EmbeddedServer, ServiceConfig
from stragglers.errors import InputError

OWNER, SERVICE = "owner-token-0123456789", "service-token-0123456789"
BIG_SHARDS = 65_536   # a snapshot of 2.6 MB: past the 1 MiB under which keys were checked


def tables(db) -> dict:
    with sqlite3.connect(db) as c:
        return {t: c.execute(f"SELECT * FROM {t} ORDER BY 1, 2, 3").fetchall()
                for t in ("datasets", "shards", "workers", "lease_requests", "row_sets")}


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    db = tmp_path_factory.mktemp("hostile-limits") / "shards.db"
    srv = EmbeddedServer(db, service_token=SERVICE,
                         config=ServiceConfig(max_workers_per_dataset=4)).start()
    owner = ShardClient(srv.url, "big", "w0", token=OWNER, service_token=SERVICE)
    owner.create_dataset(DatasetConfig("big", BIG_SHARDS, 1, lease_s=600))
    owner.join()
    snap = httpx.get(f"{srv.url}/datasets/big/snapshot", timeout=120).content
    yield {"url": srv.url, "db": db, "snapshot": snap}
    srv.stop()


def post(svc, path: str, body: bytes) -> httpx.Response:
    return httpx.post(svc["url"] + path, content=body, timeout=300, headers={
        "Authorization": f"Bearer {OWNER}", "Content-Type": "application/json"})


@pytest.mark.slow
def test_a_data_set_keeps_a_bounded_number_of_worker_names(svc):
    # each name keeps a row and up to 256 lease replies: invented in a loop, they grew the
    # file without bound
    for i in range(1, 4):
        assert post(svc, "/datasets/big/join", b'{"worker":"w%d"}' % i).status_code == 200
    before = tables(svc["db"])
    resp = post(svc, "/datasets/big/join", b'{"worker":"w4"}')
    assert resp.status_code == 429, resp.text
    reply = resp.json()
    assert reply["kind"] == "QuotaExceeded" and "max_workers_per_dataset=4" in reply["error"]
    assert tables(svc["db"]) == before, "a refused join changed the database"
    # a name the data set knows joins again (a restarted worker is never locked out)
    again = post(svc, "/datasets/big/join", b'{"worker":"w2"}')
    assert again.status_code == 200 and again.json()["fence"] == 2


@pytest.mark.slow
def test_a_key_given_twice_in_a_big_restore_body_is_refused(svc):
    snap = svc["snapshot"]
    assert len(snap) > 1 << 20
    # the same value twice: valid for any parser, refused as ambiguous all the same
    twice = snap.replace(b'"seed":0,', b'"seed":0,"seed":0,', 1)
    assert twice != snap
    before = tables(svc["db"])
    resp = post(svc, "/datasets/big/restore", twice)
    assert resp.status_code == 400, resp.text[:300]
    assert resp.json()["field"] == "seed" and "twice" in resp.json()["error"]
    assert tables(svc["db"]) == before, "a refused restore changed the database"
    assert post(svc, "/datasets/big/restore", snap).status_code == 200   # the body itself is fine
    # (the rows it replaced are deleted in paced steps: done before the next test looks)
    eventually(lambda: not tables(svc["db"])["row_sets"], what="the replaced rows deleted")


@pytest.mark.slow
def test_a_restore_whose_every_row_is_bad_is_refused_at_the_first(svc):
    # an error object per bad row was built first: 589,824 rows took 19 s and 1.6 GB
    doc = json.loads(svc["snapshot"])
    doc["shards"] = [[e, s, "BAD", c, r, p, err] for e, s, _, c, r, p, err in doc["shards"]]
    body = json.dumps(doc).encode()
    with pytest.raises(ValidationError) as info:
        rq.Snapshot.model_validate_json(body)
    assert info.value.error_count() == 1
    before = tables(svc["db"])
    resp = post(svc, "/datasets/big/restore", body)
    assert resp.status_code == 400 and resp.json()["field"] == "shards.0.2", resp.text[:300]
    assert tables(svc["db"]) == before


STRUCTURE_IN_STRINGS = [
    (b'{"a": "}{\\"a\\":", "b": {"a": 1}, "c": [{"a": 1}, {"a": 2}]}', None),
    (b'[{"x": 1, "y": {"x": 2}}, {"x": 3}]', None),
    (b'{"a": {"b": 1}, "b": 2, "a": 3}', "a"),
    (b'{"a": 1, "\\u0061": 2}', "a"),
    (b'{"k": "x\\\\", "k" : 2}', "k"),
    (b'{"\\"": 1, "\\u0022": 2}', '"'),
    (b'{"a": "x", "b": "y\\\\", "a\\\\": 1, "c": "{\\"a\\": 1}"}', None),
]


@pytest.mark.parametrize("body,twice", STRUCTURE_IN_STRINGS)
def test_keys_given_twice_are_found_by_a_scan_of_the_bytes(body, twice):
    json.loads(body)   # each case is valid JSON
    if twice is None:
        rq.refuse_duplicate_keys(body)
        return
    with pytest.raises(InputError) as info:
        rq.refuse_duplicate_keys(body)
    assert info.value.field == twice


def python_calls(fn) -> int:
    """How many Python function calls (and generator steps) `fn()` makes: a measure of its
    work that does not depend on the machine's speed or load."""
    import sys

    count = [0]

    def profile(frame, event, arg):
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


@pytest.mark.parametrize("policy", ["nd", "dd"])
def test_a_controllers_work_grows_linearly_with_its_world_size(policy):
    # a job may declare 65,536 ranks: every record scanned every rank (is the window full?)
    # and the batch split scanned every rank per sample it rounded; a 16,384-rank job's
    # reports took 66 s per 2,000 and its first window 188 s, on the service's event loop
    from stragglers.adapt.control import ControlPlane
    from stragglers.adapt.controller import ControlConfig

    def feed(world: int) -> int:
        plane = ControlPlane()
        cfg = ControlConfig.from_mapping({"policy": policy, "world_size": world,
                                          "global_batch": 7 * world + 3, "incarnation": 1}, "t")
        plane.configure("j", cfg, "owner")

        def reports():
            for rank in range(world):   # one rank in seven slower: the window closes with a split
                bpt = 0.3 if rank % 7 == 0 else 0.1
                plane.report("j", rank, [(10 + i, bpt, 7) for i in range(5)], "", 1, 0, "owner")
        calls = python_calls(reports)
        assert plane.actions("j", 0).actions, "the window closed with an action"
        return calls

    small, big = feed(256), feed(4096)
    assert big < 16 * small * 1.5, (small, big)   # 16x the ranks: about 16x the work


def test_a_controller_keeps_a_bounded_number_of_actions(svc):
    # every ADJUST_BS was kept (a list of world_size ints each): a job reporting noisy times
    # with min_change 0 grew the list, and every reply asking since 0, without bound
    from stragglers.adapt.controller import MAX_KEPT_ADJUSTS

    headers = {"Authorization": f"Bearer {OWNER}", "X-Service-Token": SERVICE}
    with httpx.Client(base_url=svc["url"], headers=headers, timeout=60) as c:
        r = c.post("/jobs/noisy/control/config", json={
            "policy": "nd", "world_size": 2, "global_batch": 64, "window": 1, "min_change": 0,
            "persistent_windows": 1000, "incarnation": 1})
        assert r.status_code == 200, r.text
        for step in range(2, 2 + 4 * MAX_KEPT_ADJUSTS):
            slow = step % 2   # ranks 0 and 1 take turns being slow: a new split every window
            for rank in (0, 1):
                bpt = 0.3 if rank == slow else 0.1
                r = c.post("/jobs/noisy/control/report", json={
                    "rank": rank, "records": [[step, bpt, 32]], "incarnation": 1})
                assert r.status_code == 200, r.text
        got = c.get("/jobs/noisy/control/actions", params={"since": 0}).json()["actions"]
        seqs = [a["seq"] for a in got]
        assert len(got) == MAX_KEPT_ADJUSTS and seqs == sorted(seqs), seqs
        assert seqs[-1] >= 2 * MAX_KEPT_ADJUSTS, "more were decided than are kept"
        last = c.get("/jobs/noisy/control/actions", params={"since": seqs[-1]}).json()
        assert [a["seq"] for a in last["actions"]] == [seqs[-1]]
        assert len(c.get("/jobs/noisy/control/state").json()["actions"]) == MAX_KEPT_ADJUSTS


ADVERSARIAL = {"deep": b"[" * 100_000, "quotes": b'"' * 100_001,
               "escaped-quotes": b'"' + b'\\"' * 50_000, "trailing-backslash": b'"ab\\',
               "backslash-newline": b'"' + b'\\\n' * 50_000, "colons": b'"a"' + b' :' * 50_000,
               "unterminated": b'{"a": 1, "b' + b"x" * 100_000,
               "spaces": (b'"a"' + b" " * 100 + b'"b"') * 1000}


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_the_key_scan_never_retries_a_start_position(name):
    # a big body is scanned before it is parsed, so the scan sees any bytes: when a match
    # failed at one position the regex engine tried again from the next (200 KB of "[" took
    # 244 s); here the matches tile the body, each starting where the last ended
    body = ADVERSARIAL[name]
    end = 0
    for m in rq._NEXT_KEY_OR_BRACE.finditer(body):
        assert m.start() == end, (name, m.start(), end)
        end = m.end()
    assert end == len(body)


@pytest.mark.slow
def test_a_body_of_many_unknown_keys_is_refused_before_it_is_parsed(svc):
    # pydantic made an error per unknown key (90,000 in 1.1 MB: 0.7 s of the event loop
    # before the 400); the key scan stops at the 65th key
    body = json.dumps({"worker": "w9", **{f"k{i}": 0 for i in range(80_000)}}).encode()
    before = tables(svc["db"])
    resp = post(svc, "/datasets/big/join", body)
    assert resp.status_code == 400 and resp.json()["field"] == "k63", resp.text[:300]
    assert "more than 64 keys" in resp.json()["error"]
    many = b'{"worker": "w9", "x": [' + b",".join([b"{}"] * 1000) + b"]}"
    resp = post(svc, "/datasets/big/join", many + b" " * 5000)
    assert resp.status_code == 400 and "more than 64 JSON objects" in resp.json()["error"]
    assert tables(svc["db"]) == before


def test_the_control_plane_works_off_the_event_loop(svc, monkeypatch):
    # a window of a 65,536-rank job (classes, fits, the split) and its state are seconds of
    # Python: on the event loop they held every job's leases; each call is seen where it runs
    import threading

    from stragglers.adapt.control import ControlPlane

    seen: dict[str, str] = {}
    for name in ("configure", "report", "actions", "state"):
        real = getattr(ControlPlane, name)

        def spy(self, *a, _real=real, _name=name, **kw):
            seen[_name] = threading.current_thread().name
            return _real(self, *a, **kw)
        monkeypatch.setattr(ControlPlane, name, spy)
    headers = {"Authorization": f"Bearer {OWNER}", "X-Service-Token": SERVICE}
    with httpx.Client(base_url=svc["url"], headers=headers, timeout=60) as c:
        assert c.post("/jobs/where/control/config", json={
            "policy": "dd", "world_size": 2, "global_batch": 8, "incarnation": 1}).status_code == 200
        assert c.post("/jobs/where/control/report", json={
            "rank": 0, "records": [[5, 0.1, 4]], "incarnation": 1}).status_code == 200
        assert c.get("/jobs/where/control/actions").status_code == 200
        assert c.get("/jobs/where/control/state").status_code == 200
    assert set(seen) == {"configure", "report", "actions", "state"}
    assert all(name.startswith("shard-control") for name in seen.values()), seen


REFUSED_BELOW_THE_APP = {
    "host": b"GET /health HTTP/1.1\r\nHost: evil.example\r\n\r\n",
    "absolute-target": b"GET http://evil.example/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
    "header-twice": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nHost: 127.0.0.1\r\n\r\n",
    "not-http": b"NOT HTTP AT ALL\r\n\r\n",
    "head-too-large": b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * (80 << 10),
}


@pytest.mark.parametrize("name", REFUSED_BELOW_THE_APP)
def test_refusals_of_the_serving_layer_have_the_services_error_shape(svc, name):
    # the README: {"error", "kind", "field"} for every status; the serving layer's refusals
    # (Host, target, headers, a head not HTTP or too large) were {"error"} alone
    import socket

    port = int(svc["url"].rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as k:
        k.sendall(REFUSED_BELOW_THE_APP[name])
        k.settimeout(30)
        raw = b""
        while b"\r\n\r\n" not in raw or not raw.rstrip().endswith(b"}"):
            chunk = k.recv(65536)
            if not chunk:
                break
            raw += chunk
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    reply = json.loads(body)
    assert 400 <= status < 500 and set(reply) == {"error", "kind", "field"}, (status, reply)
    assert reply["kind"] and reply["error"]
    assert httpx.get(svc["url"] + "/health").status_code == 200


def trickled_restore(port: int) -> bytes:
    """A 1 MiB restore body of data set `a` sent 16 KB at a time, 64 KB/s (above the serving
    layer's minimum rate), until the service answers; what it answered."""
    import socket

    k = socket.create_connection(("127.0.0.1", port), timeout=30)
    k.sendall(f"POST /datasets/a/restore HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer"
              f" {OWNER}\r\nContent-Type: application/json\r\nContent-Length: {1 << 20}"
              "\r\n\r\n".encode())
    answer = b""
    for _ in range(1 << 20 >> 14):
        if readable([k], 0.25):
            answer = k.recv(65536)
            break
        k.sendall(b" " * (1 << 14))
    k.close()
    return answer


@pytest.mark.slow
def test_a_restore_body_trickled_in_loses_its_slot(tmp_path):
    # the restore slot (one in all) is taken before the body is read; a body sent at the
    # serving layer's minimum rate (8 KB/s) held it, and every other restore got 503, for hours
    srv = EmbeddedServer(tmp_path / "s.db", config=ServiceConfig(restore_upload_s=2)).start()
    try:
        owner = ShardClient(srv.url, "a", "w", token=OWNER)
        owner.create_dataset(DatasetConfig("a", 100, 10))
        snap = owner.snapshot()
        answer = trickled_restore(srv.port)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b'"kind": "BodyTooSlow"' in answer or b'"kind":"BodyTooSlow"' in answer
        assert owner.restore(snap).restored == 10   # the slot is free again
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_restore_body_must_arrive_within_a_time_bounded_by_its_size(tmp_path):
    # A 64 MiB body trickled at 220 KB/s held the only restore slot for the whole
    # restore_upload_s (300 s): every other owner's restore was refused meanwhile. A body of
    # n bytes now has restore_grace_s + n / restore_bytes_per_s (fails before: this 1 MiB body,
    # sent at 64 KB/s, arrived whole in 16 s and was read)
    cfg = ServiceConfig(restore_grace_s=1.0, restore_bytes_per_s=float(1 << 20))
    srv = EmbeddedServer(tmp_path / "s.db", config=cfg).start()
    try:
        owner = ShardClient(srv.url, "a", "w", token=OWNER)
        owner.create_dataset(DatasetConfig("a", 100, 10))
        snap = owner.snapshot()
        answer = trickled_restore(srv.port)
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b"restore_bytes_per_s" in answer
        assert owner.restore(snap).restored == 10   # the slot is free again
    finally:
        srv.stop()
