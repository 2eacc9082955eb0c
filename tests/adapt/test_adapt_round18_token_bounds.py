"""Round 17's leftovers: what one token may multiply over its data sets — shard rows, and the
lease request history of workers joining one after another. Real server on loopback, real
SQLite."""

from __future__ import annotations

import contextlib
import sqlite3

import httpx

from stragglers.adapt.history import HISTORY_MIN
from stragglers.adapt.service import EmbeddedServer, ServiceConfig
from stragglers.adapt.shards import ShardStore
from stragglers.adapt.dataset import DatasetConfig

OWNER = "owner-round18-token-0123456789"
OTHER = "other-round18-token-0123456789"
H = {"Authorization": f"Bearer {OWNER}"}
JSON = {"content-type": "application/json"}


def _tables(db) -> dict:
    """Every row the service keeps of its data sets: what a refused request leaves as it was."""
    with contextlib.closing(sqlite3.connect(db)) as c:
        return {t: sorted(map(repr, c.execute(f"SELECT * FROM {t}").fetchall()))
                for t in ("datasets", "shards", "workers", "lease_requests", "row_sets")}


def _server(db, **settings) -> EmbeddedServer:
    quick = ServiceConfig(refusal_delay_s=0.0, auth_failure_delay_s=0.0, **settings)
    return EmbeddedServer(db, durable=False, config=quick).start()


def _refused(r: httpx.Response, setting: str) -> None:
    assert r.status_code == 429, r.text
    body = r.json()
    assert set(body) == {"error", "kind", "field"} and body["kind"] == "QuotaExceeded", body
    assert setting in body["error"] and "\n" not in body["error"], body


def test_one_tokens_data_sets_hold_a_bounded_number_of_shard_rows_in_all(tmp_path):
    # (fails before: each data set was bounded alone, max_rows_ahead rows ahead of its oldest
    # epoch held, so one token's 64 data sets wrote 64 x 2**18 = 16.7M rows without an ack;
    # here the third data set, and d1's second epoch while its first was leased and not acked,
    # were written past the token's 25)
    db = tmp_path / "s.db"
    server = _server(db, max_shard_rows_per_token=25)
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=H) as c:
            for name in ("d1", "d2"):   # 10 rows each (one epoch of 10 one-sample shards)
                assert c.post("/datasets", json={"name": name, "num_samples": 10,
                                                 "shard_size": 1, "num_epochs": 3}
                              ).status_code == 200
            before = _tables(db)
            r = c.post("/datasets", json={"name": "d3", "num_samples": 10, "shard_size": 1})
            _refused(r, "max_shard_rows_per_token=25")
            assert _tables(db) == before, "a refused creation changed the database"
            # d1's first epoch leased and not acked: its second would be 30 rows not done
            fence = c.post("/datasets/d1/join", json={"worker": "w"}).json()["fence"]
            leases = c.post("/datasets/d1/lease", json={"worker": "w", "fence": fence,
                                                        "count": 10}).json()["leases"]
            assert len(leases) == 10
            before = _tables(db)
            r = c.post("/datasets/d1/lease", json={"worker": "w", "fence": fence,
                                                   "request_id": "r1"})
            _refused(r, "max_shard_rows_per_token=25")
            assert _tables(db) == before, "a refused lease changed the database"
            # acked, the epoch is done and counts no more: a long job's epochs go on (each
            # epoch of the three written and done: 30 rows, past the 25)
            for epoch in range(3):
                for x in leases:
                    assert c.post("/datasets/d1/ack", json={
                        "worker": "w", "fence": fence, "epoch": epoch, "shard": x["shard"],
                        "consumed": 1}).status_code == 200
                if epoch < 2:
                    r = c.post("/datasets/d1/lease", json={
                        "worker": "w", "fence": fence, "count": 10,
                        "request_id": f"e{epoch + 1}"})
                    assert r.status_code == 200, r.text
                    leases = r.json()["leases"]
                    assert [x["epoch"] for x in leases] == [epoch + 1] * 10, r.text
                    if epoch == 0:   # (epoch 0 done, epoch 1 leased)
                        snapshot = c.get("/datasets/d1/snapshot").content
            # a restore replaces its data set's rows (epoch 0 done: epoch 1's 10 counted)
            r = c.post("/datasets/d1/restore", content=snapshot, headers=JSON)
            assert r.status_code == 200, r.text
            # another token has rows of its own; the rows of a deleted data set count no more
            o = {"Authorization": f"Bearer {OTHER}"}
            assert c.post("/datasets", headers=o, json={"name": "o", "num_samples": 20,
                                                        "shard_size": 1}).status_code == 200
            assert c.post("/datasets", json={"name": "d3", "num_samples": 10,
                                             "shard_size": 1}).status_code == 429
            assert c.request("DELETE", "/datasets/d2", json={}).status_code == 200
            assert c.post("/datasets", json={"name": "d3", "num_samples": 10,
                                             "shard_size": 1}).status_code == 200
            assert c.get("/health").status_code == 200
    finally:
        server.stop()


def _history(db, token_digest: str | None = None) -> dict[str, int]:
    """Remembered lease requests per worker."""
    with contextlib.closing(sqlite3.connect(db)) as c:
        return dict(c.execute("SELECT worker, COUNT(*) FROM lease_requests GROUP BY worker"
                              ).fetchall())


def test_workers_joining_one_after_another_share_one_history_bound(tmp_path):
    # (fails before: a worker trimmed its history only at its own lease, so each worker that
    # stopped leasing kept the share of its time: 8 workers of 40 requests each, joined one
    # after another, kept 40 + 32 + 21 + 16 + 12 + 10 + 9 + 8 = 148 rows of a bound of 64)
    db = tmp_path / "s.db"
    server = _server(db)
    server.app.state.store.history_rows = 64   # (HISTORY_ROWS, scaled: 16,384 over 1,024)
    try:
        with httpx.Client(base_url=server.url, timeout=60, headers=H) as c:
            for name in ("d1", "d2"):   # (two data sets of one token: one bound)
                assert c.post("/datasets", json={"name": name, "num_samples": 400,
                                                 "shard_size": 1}).status_code == 200
            last = {}
            for i in range(8):
                name, worker = f"d{1 + i % 2}", f"w{i}"
                fence = c.post(f"/datasets/{name}/join", json={"worker": worker}
                               ).json()["fence"]
                for k in range(40):
                    r = c.post(f"/datasets/{name}/lease", json={
                        "worker": worker, "fence": fence, "request_id": f"r{k}"})
                    assert r.status_code == 200, r.text
                    last[worker] = (name, fence, r.json()["leases"])
                kept = _history(db)
                assert sum(kept.values()) <= 64, f"after {worker} joined: {kept}"
            assert all(n >= HISTORY_MIN for n in kept.values()), kept
            # each worker's newest id still replays: the same shards, none new
            for worker, (name, fence, leases) in last.items():
                r = c.post(f"/datasets/{name}/lease", json={"worker": worker, "fence": fence,
                                                            "request_id": "r39"})
                assert r.status_code == 200 and [x["shard"] for x in r.json()["leases"]] == \
                    [x["shard"] for x in leases], (worker, r.text)
    finally:
        server.stop()


def test_over_256_workers_each_keep_their_share_not_the_request_count_it_was_checked_past(
        tmp_path):
    # (fails before: a worker's share was counted only past history_rows // 256 requests,
    # so each of a token's 300 workers kept its first 10 requests: 3,000 rows of a bound of
    # max(2,560, 300 x HISTORY_MIN))
    db = tmp_path / "s.db"
    s = ShardStore(db, durable=False)
    s.history_rows = 2560   # (scaled: its share, 8, is under 2,560 // 256 = 10)
    try:
        s.create_dataset(DatasetConfig("d", 4000, 1), "a" * 64)
        fences = [s.join("d", f"w{i}", "a" * 64).fence for i in range(300)]
        for k in range(10):
            for i, fence in enumerate(fences):
                s.lease("d", f"w{i}", fence, request_id=f"r{k}", token_sha256="a" * 64)
        kept = sum(_history(db).values())
        assert kept <= max(2560, 300 * HISTORY_MIN), kept
    finally:
        s.close()
