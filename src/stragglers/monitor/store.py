"""The monitor's store: one interface (store_base.SQLStore), two backends.

SQLite (store_sqlite.py) is the embedded default: one file, one instance. PostgreSQL
(store_postgres.py, `--db postgresql://…`) is shared by several instances, which divide the jobs
between them by leases (leases.py). Both keep the same tables and the same guarantees: a part
is stored once ((job, rank, part) is the key), a window once ((job, idx), written only by the
job's lease holder), an alert change once with its outbox message in the same transaction.
"""

from __future__ import annotations

from pathlib import Path

from stragglers.monitor.store_base import WINDOW_SUMMARY, JobConflict, LeaseLost, SQLStore
from stragglers.monitor.store_postgres import PostgresStore, is_postgres_url
from stragglers.monitor.store_sqlite import SQLiteStore

Store = SQLiteStore   # the name code and tests have always used for the SQLite store

__all__ = ["JobConflict", "LeaseLost", "PostgresStore", "SQLStore", "SQLiteStore", "Store",
           "WINDOW_SUMMARY", "is_postgres_url", "open_store"]


def open_store(db: str | Path, durable: bool = True) -> SQLStore:
    """The store `--db` names: a postgresql:// URL, or a SQLite file."""
    if is_postgres_url(db):
        return PostgresStore(str(db))
    return SQLiteStore(db, durable=durable)
