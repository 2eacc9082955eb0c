"""An epoch's shard rows, written a chunk at a time as the queue reaches them."""

from __future__ import annotations

import sqlite3

from stragglers.adapt.dataset import TODO, DatasetConfig
from stragglers.adapt.stored import check_materialized
from stragglers.adapt.store_state import StoreState

# Rows of an epoch written at once: creating a data set or an epoch of 65,536 shards in one
# transaction held the commit thread (every other job's calls) for seconds. The rest of the
# epoch's rows are written EPOCH_CHUNK at a time as its queue reaches them (all of them are TODO
# and queued after the written ones, so the order of the queue is the same).
EPOCH_CHUNK = 1024


class Epochs(StoreState):
    """ShardStore's epochs: created as TODO rows in queue order, EPOCH_CHUNK at a time."""

    def _create_epoch(self, c: sqlite3.Connection, cfg: DatasetConfig, epoch: int,
                      full: bool = False) -> None:
        """A new epoch: its first EPOCH_CHUNK shard rows (all of them with `full`)."""
        upto = cfg.num_shards if full else min(cfg.num_shards, EPOCH_CHUNK)
        self._write_rows(c, cfg, epoch, 0, upto)
        c.execute("UPDATE datasets SET epochs_created=?, materialized=? WHERE name=?",
                  (epoch + 1, upto, cfg.name))

    def _write_rows(self, c: sqlite3.Connection, cfg: DatasetConfig, epoch: int, lo: int, hi: int) -> None:
        base = epoch * (cfg.num_shards + 1) + 1  # queue positions after earlier epochs
        key = self._key(cfg.name)
        rows = [(key, epoch, s, s * cfg.shard_size,
                 min((s + 1) * cfg.shard_size, cfg.num_samples), TODO, None, None, None, 0, 0,
                 base + s, None) for s in range(lo, hi)]
        c.executemany("INSERT INTO shards VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)", rows)

    def _materialized(self, c: sqlite3.Connection, cfg: DatasetConfig) -> int:
        """Shard rows written of the last epoch (the others are TODO, queued after them)."""
        value = c.execute("SELECT materialized FROM datasets WHERE name=?",
                          (cfg.name,)).fetchone()[0]
        return check_materialized(cfg, value)

    def _extend_epoch(self, c: sqlite3.Connection, cfg: DatasetConfig, epoch: int, have: int) -> None:
        """Write the next EPOCH_CHUNK rows of the last epoch (its queue reached them)."""
        upto = min(cfg.num_shards, have + EPOCH_CHUNK)
        self._write_rows(c, cfg, epoch, have, upto)
        c.execute("UPDATE datasets SET materialized=? WHERE name=?", (upto, cfg.name))
