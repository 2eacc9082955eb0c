"""The shard store's write-ahead log folded into the database file on a thread of its own, once
it passes a size: never on the commit thread, whose calls (every job's leases) would wait."""

from __future__ import annotations

import logging
import os
import sqlite3
import threading

from stragglers.adapt.transactions import Transactions

log = logging.getLogger(__name__)


class WalFolder:
    """Folds (a passive checkpoint: writers and readers go on) the WAL of `store` whenever a
    commit leaves it over `limit` bytes; the writer then cuts the file back to `limit` when it
    starts the log again (journal_size_limit), and checkpoints itself only past twice `limit`
    (writes faster than this thread folds: what is left to fold then is their last frames),
    after this thread's checkpoint under way if any (SQLite's own would find it and give up).

    Was: SQLite's auto-checkpoint ran inside the COMMIT of the batch that crossed 1,000 pages
    (on the commit thread), the WAL file was never cut back (a reader holding a long snapshot
    or one big transaction left it at tens of MB for good), and only a write refused for space
    folded and truncated it: on a small disk it filled again.
    """

    def __init__(self, store: Transactions, limit: int, pause_s: float = 0.05):
        self.store, self.limit, self.pause_s = store, limit, pause_s
        self.wal = store.db + "-wal"
        self.folds = 0   # checkpoints that copied the whole log
        self._failing = False
        # one checkpoint at a time through this connection, on this thread or the commit's
        self._fold_lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._wake, self._closed = threading.Event(), threading.Event()
        store.fold_elsewhere(limit)
        store.on_commit = self.committed
        self._thread = threading.Thread(target=self._loop, name="wal-fold", daemon=True)
        self._thread.start()

    def committed(self) -> None:
        """After a commit (on the thread that committed: a stat, and past twice the limit
        the writer's own fold)."""
        try:
            size = os.stat(self.wal).st_size
        except OSError:
            return
        if size > 2 * self.limit:
            # the writer's own share, done here: its checkpoint inside COMMIT found this
            # thread's under way (SQLITE_BUSY, nothing copied) and the log grew on; a starved
            # folding thread (a loaded host) held it so while the writer went on: 1.6 MB of
            # log against 2 x 256 KB. Waits for that checkpoint, then folds what it left.
            self._fold()
        elif size > self.limit:
            self._wake.set()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread (the store's writer folds the rest when it is closed)."""
        self.store.on_commit = None
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while True:
                self._wake.wait()
                if self._closed.is_set():
                    return
                self._wake.clear()
                self._fold()
                # (a reader holding an old snapshot keeps the log: commits ask again, answered
                # at most this often)
                self._closed.wait(self.pause_s)
        finally:
            with self._fold_lock:
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None

    def _fold(self) -> None:
        """One passive checkpoint (after the one under way, if any, is done)."""
        with self._fold_lock:
            if self._closed.is_set():   # (a commit's, after close: its connection is gone)
                return
            try:
                self._conn = self._conn or sqlite3.connect(self.store.db, isolation_level=None,
                                                           check_same_thread=False)
                busy, frames, copied = self._conn.execute(
                    "PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            except (sqlite3.Error, OSError) as exc:
                # (a full disk: the database file could not grow; no file descriptor
                # left: tried again at the next commit, the thread never ends)
                if not self._failing:
                    log.warning("folding the shard store's WAL failed (said once until a"
                                " fold succeeds): %s", exc)
                self._failing = True
            else:
                self._failing = False
                if not busy and frames == copied:
                    self.folds += 1
