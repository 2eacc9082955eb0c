"""Fixtures of the monitor tests: one real PostgreSQL server for the session, a database each."""

from __future__ import annotations

import itertools

import pytest

from pg_cluster import PostgresCluster, why_not

_names = itertools.count()


@pytest.fixture(scope="session")
def postgres_cluster():
    """A PostgreSQL server (initdb + pg_ctl in a temporary directory) for the whole session;
    the tests that need it skip, saying why, where the binaries are absent."""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    pytest.importorskip("psycopg", reason="the [postgres] extra (psycopg) is not installed")
    cluster = PostgresCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture
def postgres_url(postgres_cluster) -> str:
    """A fresh, empty schema on the session's server (as good as a database of its own)."""
    return postgres_cluster.create_schema(f"t{next(_names)}")
