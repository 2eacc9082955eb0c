"""The shard store's write-ahead log stays bounded on disk: folded on a thread of its own once
it passes `wal_fold_bytes`, and its file cut back to that (a real SQLite file, sizes read)."""

from __future__ import annotations

import os
import sqlite3
import time

import httpx
import pytest

from stragglers.adapt.service import EmbeddedServer, ServiceConfig

OWNER = "owner-token-0123456789"


@pytest.mark.slow
def test_the_wal_is_cut_back_after_a_reader_held_it_without_a_full_disk(tmp_path):
    # (fails before: SQLite's auto-checkpoint reused the log but never shortened its file, and
    # only a write refused for space folded and truncated it: a reader holding an old snapshot
    # (a long snapshot read) while 60 data sets were written left 6 MB of WAL for good, and on
    # a small disk it filled again)
    db = tmp_path / "s.db"
    limit = ServiceConfig().wal_fold_bytes
    srv = EmbeddedServer(db).start()
    wal = f"{db}-wal"
    try:
        h = {"Authorization": f"Bearer {OWNER}"}
        with httpx.Client(base_url=srv.url, headers=h, timeout=60) as c:
            assert c.post("/datasets", json={"name": "d", "num_samples": 1000,
                                             "shard_size": 10}).status_code == 200
            reader = sqlite3.connect(db, isolation_level=None)
            reader.execute("BEGIN")
            reader.execute("SELECT count(*) FROM datasets").fetchone()   # holds its snapshot
            for i in range(60):   # ~100 KB of shard rows each
                r = c.post("/datasets", json={"name": f"big{i}", "num_samples": 1 << 20,
                                              "shard_size": 16})
                assert r.status_code == 200, r.text
            grown = os.path.getsize(wal)
            assert grown > limit, grown   # (what the reader held)
            reader.execute("COMMIT")
            reader.close()
            sizes = []
            for k in range(100):   # small writes: each commit may fold; the next one cuts
                r = c.post("/datasets/d/join", json={"worker": f"w{k}"})
                assert r.status_code == 200, r.text
                sizes.append(os.path.getsize(wal))
                if sizes[-1] <= limit:
                    break
                time.sleep(0.05)   # (the fold runs on its own thread)
            assert sizes[-1] <= limit, (grown, sizes[-5:])
            assert c.get("/datasets/d/status").status_code == 200
    finally:
        srv.stop()
