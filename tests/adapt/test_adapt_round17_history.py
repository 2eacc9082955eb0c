"""Round 17: the lease request history is shared among the workers of every data set of one
token, not kept per data set (one token's 64 data sets each kept HISTORY_ROWS). Real SQLite."""

from __future__ import annotations

import sqlite3

from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.history import HISTORY_MIN
from stragglers.adapt.shards import ShardStore

TOKEN = "a" * 64   # (a token's digest)
OTHER = "b" * 64


def _rows(db, where: str = "") -> int:
    with sqlite3.connect(db) as c:
        return c.execute("SELECT COUNT(*) FROM lease_requests l JOIN datasets d ON d.name ="
                         f" l.dataset {where}").fetchone()[0]


def test_one_tokens_data_sets_share_one_history_bound(tmp_path):
    # (fails before: each of the 4 data sets kept history_rows (64) of its one worker's
    # requests, 4 x 40 = 160 rows; now the token's 4 workers share 64: 16 each)
    db = tmp_path / "s.db"
    s = ShardStore(db)
    s.history_rows = 64   # (HISTORY_ROWS, scaled down: 16,384 over 1,024 workers)
    try:
        fences = {}
        for token, names in ((TOKEN, ("d0", "d1", "d2", "d3")), (OTHER, ("o",))):
            for name in names:
                s.create_dataset(DatasetConfig(name, 1000, 1), token)
                fences[name] = (token, s.join(name, "w", token).fence)
        for i in range(40):   # (the workers lease in turns: each trims its own past its share)
            for name, (token, fence) in fences.items():
                s.lease(name, "w", fence, request_id=f"r{i}", token_sha256=token)
        mine = _rows(db, f"WHERE d.token_sha256='{TOKEN}'")
        assert mine <= 64, f"one token's data sets keep {mine} remembered requests"
        assert mine >= 4 * HISTORY_MIN
        # another token's one worker keeps its own share, all 40 of its requests
        assert _rows(db, f"WHERE d.token_sha256='{OTHER}'") == 40
        # the newest ids of each worker still replay: the same shards, none new
        for name in ("d0", "d3"):
            fence = s.join(name, "w2", TOKEN).fence   # (another worker: its own ids)
            first = s.lease(name, "w2", fence, request_id="x", token_sha256=TOKEN)
            again = s.lease(name, "w2", fence, request_id="x", token_sha256=TOKEN)
            assert [(x.epoch, x.shard) for x in again.leases] == \
                [(x.epoch, x.shard) for x in first.leases]
    finally:
        s.close()
