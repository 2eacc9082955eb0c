"""A real PostgreSQL cluster for tests and benchmarks: initdb + pg_ctl in a temporary directory.

initdb refuses to run as root, so as root the cluster is made and run by the `postgres` system
user (the Debian package's) with `runuser`; as anyone else, by that user. The server listens on
loopback TCP on a free port; `stop()` stops it (immediate mode) and removes the directory.
"""

from __future__ import annotations

import atexit
import glob
import itertools
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest


def postgres_bin() -> Path | None:
    """The directory of initdb and pg_ctl (Debian's /usr/lib/postgresql/N/bin), or None."""
    for name in ("initdb",):
        found = shutil.which(name)
        if found and shutil.which("pg_ctl"):
            return Path(found).resolve().parent
    versions = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                      key=lambda p: int(Path(p).parts[-3]) if Path(p).parts[-3].isdigit() else 0)
    return Path(versions[-1]).parent if versions else None


def why_not() -> str | None:
    """Why no cluster can be started here (None: it can)."""
    if postgres_bin() is None:
        return "PostgreSQL's initdb/pg_ctl are not installed (make postgres installs them)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run initdb as"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresCluster:
    """One throwaway PostgreSQL server; `url(db)` names a database in it."""

    def __init__(self):
        self.bin = postgres_bin()
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="stragglers-pg-"))
        self.data = self.dir / "data"
        self._as = []
        self._options = ""
        if os.geteuid() == 0:
            user = pwd.getpwnam("postgres")
            os.chown(self.dir, user.pw_uid, user.pw_gid)
            self._as = ["runuser", "-u", "postgres", "--"]

    def _run(self, *cmd: str, timeout: float = 120) -> None:
        proc = subprocess.run([*self._as, *cmd], capture_output=True, text=True,
                              timeout=timeout, cwd=self.dir)
        if proc.returncode != 0:
            raise RuntimeError(f"{Path(cmd[0]).name} failed ({proc.returncode}): "
                               f"{proc.stderr.strip()[-2000:]}")

    def start(self, durable: bool = False) -> "PostgresCluster":
        """initdb (trust on loopback) and start; returns self. Not `durable` (tests): no fsync,
        as the tests kill monitor instances, never this server; `durable` (benchmarks, against
        SQLite's fsync per commit): PostgreSQL's defaults, every commit flushed."""
        self._run(str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U",
                  "postgres", "-E", "UTF8", "--no-sync")
        options = f"-p {self.port} -h 127.0.0.1 -k {self.dir} -c max_connections=200"
        if not durable:
            options += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
        self._options = options
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", options, "-l",
                  str(self.dir / "server.log"), "-w", "-t", "60", "start")
        return self

    def halt(self) -> None:
        """Stop the server, keeping its data (`resume` starts it again on the same port)."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop",
                  timeout=60)

    def resume(self) -> None:
        """Start a server `halt` stopped again, on the same port and data."""
        self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-o", self._options, "-l",
                  str(self.dir / "server.log"), "-w", "-t", "60", "start")

    def url(self, database: str = "postgres") -> str:
        """A connection URL for `database` on this server."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_schema(self, name: str) -> str:
        """A new empty schema (a database of its own costs ~1 s to create); a URL whose
        connections put their tables there."""
        import psycopg

        with psycopg.connect(self.url(), autocommit=True) as db:
            db.execute(f'CREATE SCHEMA "{name}"')
        return f"{self.url()}?options=-csearch_path%3D{name}"

    def stop(self) -> None:
        """Stop the server and remove its directory."""
        try:
            if (self.data / "postmaster.pid").exists():   # (not when `halt` stopped it)
                self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "immediate",
                          "-w", "stop", timeout=60)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


_CLUSTER: list[PostgresCluster] = []
_names = itertools.count()


def shared_cluster() -> PostgresCluster:
    """The session's one server (started at first use, stopped when the process exits)."""
    if not _CLUSTER:
        _CLUSTER.append(PostgresCluster().start())
        atexit.register(_CLUSTER[0].stop)
    return _CLUSTER[0]


@pytest.fixture(scope="session")
def postgres_cluster() -> PostgresCluster:
    """A PostgreSQL server (initdb + pg_ctl in a temporary directory) for the whole session;
    the tests that need it skip, saying why, where the binaries are absent. (A fixture of this
    module, imported by the test modules that use it: a tests/monitor/conftest.py would shadow
    the `conftest` the tests import helpers from.)"""
    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    pytest.importorskip("psycopg", reason="the [postgres] extra (psycopg) is not installed")
    return shared_cluster()


@pytest.fixture
def postgres_url(postgres_cluster) -> str:
    """A fresh, empty schema on the session's server (as good as a database of its own)."""
    return postgres_cluster.create_schema(f"t{next(_names)}")
