"""Round 16's leftovers of the shard service: launchers' releases written by older code, and a
big shuffle's pause waited for before its lease's commit."""

from __future__ import annotations

import sqlite3

import pytest

from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.errors import Fenced
from stragglers.adapt.shards import FENCED_OFF, ShardStore


def test_a_launchers_release_written_by_older_code_is_fenced_off_at_the_upgrade(tmp_path):
    # (fails before: code before FENCED_OFF wrote a launcher's release as LEFT at the next
    # fence, which nobody held, and that file, opened by this code, served a lease at it)
    db = tmp_path / "s.db"
    s = ShardStore(db)
    s.create_dataset(DatasetConfig("d", 100, 10))
    f = s.join("d", "gone").fence
    s.lease("d", "gone", f, request_id="r1")
    s.release("d", "gone")   # its launcher saw it die
    mine = s.join("d", "self").fence
    s.lease("d", "self", mine, request_id="r1")
    s.release("d", "self", mine)   # its own release: its fence stays its own
    s.close()
    with sqlite3.connect(db) as c:   # as the older code wrote it (its version: 7)
        assert c.execute("SELECT fence, reply, seq FROM workers WHERE worker='gone'"
                         ).fetchone() == (f + 1, FENCED_OFF, 0)
        c.executescript("UPDATE workers SET reply='left' WHERE worker='gone';"
                        " PRAGMA user_version=7;")
    s = ShardStore(db)
    try:
        with pytest.raises(Fenced, match="without a fence"):
            s.lease("d", "gone", f + 1, request_id="r2")
        assert s.lease("d", "self", mine, request_id="r2").status == "ok"
        again = s.join("d", "gone").fence
        assert again > f + 1 and s.lease("d", "gone", again).status == "ok"
    finally:
        s.close()
