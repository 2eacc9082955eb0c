"""Hostile cases of a ninth round (issue 34) on the shard service: the one-service claim, a
stopped service's file, restores refused for space."""

from __future__ import annotations

import contextlib
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.service import EmbeddedServer

OWNER = "owner-token-0123456789"


def serve(tmp: Path, db: Path) -> subprocess.Popen:
    """`stragglers adapt serve --db DB --port 0` in a subprocess (stdout and stderr together)."""
    return subprocess.Popen([sys.executable, "-m", "stragglers.cli", "adapt", "serve", "--db",
                             str(db), "--port", "0"], cwd=tmp, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)


@pytest.mark.slow
def test_a_second_service_through_a_hard_link_is_refused_in_one_line(tmp_path):
    # (fails before: the lock was a file named after the path's realpath, and a hard link to
    # the database reached another lock name: two services on one SQLite file)
    db, link = tmp_path / "s.db", tmp_path / "link.db"
    first, second = serve(tmp_path, db), None
    try:
        assert first.stdout is not None
        assert b"http://127.0.0.1:" in first.stdout.readline()   # serving: it holds the file
        os.link(db, link)
        second = serve(tmp_path, link)
        assert second.stdout is not None
        said = second.stdout.readline().decode()   # a start says its URL first and serves on
        assert "http://" not in said, f"a second service started: {said}"
        out, _ = second.communicate(timeout=120)
        lines = (said + out.decode()).strip().splitlines()
        assert second.returncode == 2, lines
        assert len(lines) == 1 and str(link) in lines[0], lines
        assert "another shard service serves this file" in lines[0]
        assert f"pid {first.pid}" in lines[0]
        assert first.poll() is None
    finally:
        if first.poll() is None:
            first.terminate()
        first.communicate(timeout=60)
        if second is not None and second.poll() is None:
            second.kill()
            second.communicate(timeout=60)
    third = serve(tmp_path, link)   # the first gone, the file is free again
    try:
        assert third.stdout is not None
        assert b"http://127.0.0.1:" in third.stdout.readline()
    finally:
        third.terminate()
        third.communicate(timeout=60)


@pytest.mark.slow
def test_a_stopped_service_leaves_its_file_whole_without_a_log(tmp_path):
    # (fails before: stop() never closed the store: every commit stayed in the -wal file beside
    # a 4 KiB database, and the file alone, copied or opened read-only, held none of them)
    db = tmp_path / "s.db"
    srv = EmbeddedServer(db).start()
    try:
        owner = ShardClient(srv.url, "d", "w", token=OWNER)
        owner.create_dataset(DatasetConfig("d", 1000, 10))
        owner.join()
        acked = []
        for _ in range(3):
            x = owner.lease().leases[0]
            owner.ack(x.epoch, x.shard, x.size)
            acked.append(x.shard)
    finally:
        srv.stop()
    wal = Path(f"{db}-wal")
    assert not wal.exists() or wal.stat().st_size == 0
    # immutable: the file alone is read, no log and no lock (as a copy of it, or a read-only
    # medium, would be)
    with contextlib.closing(sqlite3.connect(f"file:{db}?immutable=1", uri=True)) as c:
        done = [r[0] for r in c.execute("SELECT shard FROM shards WHERE state='DONE'"
                                        " ORDER BY shard")]
    assert done == sorted(acked)
    srv = EmbeddedServer(db).start()   # and it serves again from it
    try:
        assert ShardClient(srv.url, "d", "w", token=OWNER).status().epochs["0"]["DONE"] == 3
    finally:
        srv.stop()
