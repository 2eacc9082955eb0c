"""What every part of the shard store shares: its attributes and the methods parts call across.

`ShardStore` is assembled from parts (transactions.py, epochs.py, requeues.py, history.py,
restores.py), each a class of its methods; they all derive from `StoreState`, which declares
the state `ShardStore.__init__` sets and the methods one part calls on another, so that each
part is checked on its own.
"""

from __future__ import annotations

import sqlite3
import threading
from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:   # the parts' types, for the checker only (they import this module)
    from contextlib import AbstractContextManager

    from stragglers.adapt.dataset import DatasetConfig
    from stragglers.adapt.errors import Quarantined
    from stragglers.adapt.permutations import Permutations
    from stragglers.adapt.replies import FailedShard, Lease


class StoreState:
    """The shard store's state (set by ShardStore.__init__) and its cross-part methods."""

    db: str
    busy_timeout_s: float
    max_datasets: int
    max_datasets_per_token: int
    max_datasets_per_client: int
    max_workers_per_dataset: int
    max_kept_floors: int                 # fence floors kept by name (floors.keep_fence_floor)
    max_rows_ahead: int
    max_shard_rows_per_token: int        # see Restores._check_rows
    max_held_per_worker: int
    unused_dataset_s: float              # see Restores._unused
    _created_at: dict[str, float]        # data set -> when this process created it
    _started: float                      # (the creation time of those it did not)
    _reclaimed: list[str]                # data sets reclaimed, not yet told to the service
    permutations: Permutations
    defer_indices: bool
    _clock: Callable[[], float]
    _lock: threading.Lock
    _local: threading.local
    _conn: sqlite3.Connection
    _read_conns: list[sqlite3.Connection]
    _grace: set[str]                     # data sets whose leases get a full lease_s next call
    _grace_until: dict[str, float]       # data set -> no lease of it expires before this
    _keys: dict[str, str]                # data set -> the key its shard rows are stored under
    _gen: dict[str, tuple[int, int]]     # live data set -> (commit it was born at, last)
    _ext_gen: int
    _commits: int                        # the store's commits (a generation's numbers)
    _deletes: int                        # commits that deleted a data set
    _touched: set[str]
    _gone: set[str]                      # data sets the running transaction deleted
    _verified: set[str]
    _quarantined: dict[str, Quarantined]
    _owners: dict[str, str | None]
    _next_expiry: dict[str, float]
    _failed_cache: dict[str, tuple[list[FailedShard], int]]
    _closed_epochs: dict[str, int]
    _configs: dict[tuple[object, ...], DatasetConfig]
    _undo: list[Callable[[], None]]
    _data_version: int | None
    _cut_short: list[str]                # keys of restores a stopped process was writing
    on_commit: Callable[[], None] | None   # called after every COMMIT or ROLLBACK (folding.py)

    if TYPE_CHECKING:
        @abstractmethod
        def _tx(self) -> AbstractContextManager[sqlite3.Connection]:
            """One transaction (transactions.py)."""

        @abstractmethod
        def _forget(self) -> None:
            """Drop derived state (transactions.py)."""

        @abstractmethod
        def _config(self, c: sqlite3.Connection, name: str, token_sha256: str | None = None,
                    write: bool = True) -> tuple[DatasetConfig, int, int]:
            """The data set's config, epochs created and queue front (shards.py)."""

        @abstractmethod
        def _key(self, name: str) -> str:
            """The key of the data set's shard rows (shards.py)."""

        @abstractmethod
        def _read_conn(self) -> sqlite3.Connection:
            """This thread's read-only connection (shards.py)."""

        @abstractmethod
        def _lease_of(self, cfg: DatasetConfig, epoch: int, shard: int, start: int, stop: int,
                      consumed: int) -> Lease:
            """One shard handed out (shards.py)."""

        @abstractmethod
        def _leased_until(self, name: str, deadline: float) -> None:
            """Keep the next-expiry bound (requeues.py)."""

        @abstractmethod
        def _failed_report(self, c: sqlite3.Connection,
                           name: str) -> tuple[list[FailedShard], int]:
            """The FAILED report of lease replies (requeues.py)."""

        @abstractmethod
        def _fresh_key(self, c: sqlite3.Connection, name: str) -> str | None:
            """The rows key of a new data set (restores.py)."""

        @abstractmethod
        def _check_quota(self, c: sqlite3.Connection, token_sha256: str | None,
                         creator: str | None = None) -> None:
            """Refuse a data set past a quota (restores.py)."""
