"""The shard store's transactions: one per call, or savepoints of a group commit."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

from stragglers.adapt.space import corrupt_file
from stragglers.adapt.store_state import StoreState

T = TypeVar("T")

log = logging.getLogger(__name__)


class Generation(NamedTuple):
    """A data set's generation: `incarnation` (the other process's writes seen, the commit
    that created it) and `commit`, the last commit that touched it."""

    incarnation: tuple[int, int]
    commit: int


class Transactions(StoreState):
    """ShardStore's transaction machinery: BEGIN IMMEDIATE per call, group commit (run_batch),
    generations per data set and the in-memory state undone on rollback."""

    def generation(self, name: str) -> Generation:
        """Changes after every commit that touched data set `name` (or after another process
        wrote); its `incarnation` changes when the data set is deleted or created again."""
        born, last = self._gen.get(name) or (-1 - self._deletes, 0)
        return Generation((self._ext_gen, born), last)

    def _committed(self) -> None:
        """After COMMIT (or ROLLBACK): every data set the transaction touched has a new generation.

        Generations are numbers of the store's commits (one counter), kept only for data sets
        that exist: one entry per name ever created grew without bound under a create/delete
        loop. A name deleted has none (its incarnation is then the count of deletes, below
        every commit number: it changes with each delete), and one created again is born at a
        later commit than any generation its deleted incarnation had."""
        self._commits += 1
        gone = self._gone & self._touched
        if gone:
            self._deletes += 1
        for name in self._touched:
            if name in gone:
                self._gen.pop(name, None)
            else:
                born = self._gen.get(name, (self._commits, 0))[0]
                self._gen[name] = (born, self._commits)
        self._touched = set()
        self._gone = set()
        if self.on_commit is not None:
            self.on_commit()


    def _tx(self) -> "_Tx":
        """One transaction, or a savepoint when running inside run_batch (group commit)."""
        return _Tx(self)

    def _sync(self) -> None:
        """At the start of a transaction: forget derived state if another connection wrote."""
        version = self._conn.execute("PRAGMA data_version").fetchone()[0]
        if version != self._data_version:
            self._forget()
            if self._data_version is not None:
                self._ext_gen += 1
                self._verified.clear()   # another process wrote: check its rows again
                self._quarantined.clear()
            self._data_version = version

    def _forget(self) -> None:
        """Drop the in-memory derived state (it is recomputed from the database)."""
        self._next_expiry.clear()
        self._failed_cache.clear()
        self._closed_epochs.clear()

    def _rolled_back(self, mark: int = 0) -> None:
        """Undo the in-memory changes made since `mark` (a rolled-back savepoint or transaction)."""
        undo, self._undo = self._undo[mark:], self._undo[:mark]
        for fn in reversed(undo):
            fn()
        self._forget()

    def fold_wal(self, wait_s: float = 0.1) -> bool:
        """Copy the WAL into the database file and truncate it; False when a reader kept it
        (retried later) or the copy failed. After a write refused for space: at a file-size
        limit the WAL filled before SQLite's auto-checkpoint (1,000 pages) and stayed full,
        every write refused, until a restart folded it."""
        with self._lock:
            conn = self._conn
            try:
                # (a short wait: this runs on the commit thread, other jobs' calls queue)
                conn.execute(f"PRAGMA busy_timeout={int(wait_s * 1000)}")
                busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            except sqlite3.Error as exc:
                log.warning("folding the shard store's WAL failed: %s", exc)
                busy = 1
            finally:
                conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
        return busy == 0

    def fold_elsewhere(self, limit: int) -> None:
        """The writer checkpoints at commit only past twice `limit` bytes of log (folding.
        WalFolder folds from `limit`, on its own thread) and cuts its WAL file back to `limit`
        whenever it starts the log again. (A writer that never checkpointed outran the
        folding thread: its checkpoint, beside the writes, never reached the log's end, the
        log was never started again, 117 MB in 20 s of restore chunks; here the writer's own
        checkpoint finds the log folded but for its last frames.)"""
        with self._lock:
            page = self._conn.execute("PRAGMA page_size").fetchone()[0]
            self._conn.execute(f"PRAGMA wal_autocheckpoint={max(1, 2 * int(limit) // page)}")
            self._conn.execute(f"PRAGMA journal_size_limit={int(limit)}")

    def run_batch(self, calls: Sequence[Callable[[], T]]) -> list[tuple[bool, T | Exception]]:
        """Group commit: run several store calls in one transaction, one fsync for all.

        Each call is isolated by a savepoint, so one that fails is rolled back alone; the
        results are (ok, value-or-exception), and none is durable before the single COMMIT.
        A failure of the transaction itself (BEGIN or COMMIT, e.g. "database is locked")
        is raised: nothing of the batch was committed.
        """
        results: list[tuple[bool, T | Exception]] = []
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            self._undo = []
            try:
                self._sync()
                self._local.in_batch = True
                try:
                    for call in calls:
                        try:
                            results.append((True, call()))
                        except Exception as exc:  # noqa: BLE001 - handed back to its caller
                            if not self._conn.in_transaction or corrupt_file(exc):
                                # SQLite rolled the batch back for this call's error (a write
                                # refused for space): the calls after it ran in autocommit,
                                # each stored while every one was answered as failed. A
                                # damaged page read: its COMMIT failed too, after the call's
                                # savepoint was rolled back. Which call it was goes with it
                                # (the service runs the others again: GroupCommitter._run_batch)
                                exc.batch_call = len(results)  # type: ignore[attr-defined]
                                raise
                            results.append((False, exc))
                        if not self._conn.in_transaction:
                            raise sqlite3.OperationalError("the batch's transaction ended"
                                                           " inside one of its calls")
                finally:
                    self._local.in_batch = False
                self._conn.execute("COMMIT")
                self._undo = []
            except BaseException:
                # Never leave the connection inside a transaction: the next batch must start.
                if self._conn.in_transaction:
                    self._conn.execute("ROLLBACK")
                self._rolled_back()
                raise
            finally:
                self._committed()
        return results



class _Tx:
    """ShardStore._tx: BEGIN IMMEDIATE ... COMMIT, or SAVEPOINT ... RELEASE inside run_batch."""

    __slots__ = ("store", "nested", "mark")

    def __init__(self, store: Transactions):
        self.store = store
        self.nested = getattr(store._local, "in_batch", False)
        self.mark = 0

    def __enter__(self) -> sqlite3.Connection:
        store = self.store
        if self.nested:
            store._conn.execute("SAVEPOINT op")
            self.mark = len(store._undo)  # the batch's earlier calls keep theirs
            return store._conn
        store._lock.acquire()
        try:
            store._conn.execute("BEGIN IMMEDIATE")
            store._sync()
        except BaseException:
            if store._conn.in_transaction:
                store._conn.execute("ROLLBACK")
            store._lock.release()
            raise
        store._undo = []
        return store._conn

    def __exit__(self, typ, exc, tb) -> None:
        store = self.store
        if self.nested:
            if typ is not None:
                if not store._conn.in_transaction:
                    # SQLite rolled the whole transaction back (an I/O error, a full disk):
                    # no savepoint is left, and the call's own error is what run_batch needs
                    store._rolled_back(self.mark)
                    return
                store._conn.execute("ROLLBACK TO op")
                store._rolled_back(self.mark)
            store._conn.execute("RELEASE op")
            return
        try:
            store._conn.execute("COMMIT" if typ is None else "ROLLBACK")
            if typ is None:
                store._undo = []
            else:
                store._rolled_back()
        except BaseException:
            if store._conn.in_transaction:
                store._conn.execute("ROLLBACK")
            store._rolled_back()
            raise
        finally:
            store._committed()
            store._lock.release()

