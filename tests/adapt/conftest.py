"""Fixtures of the adapt tests: no test may leave a thread of its own running.

Test modules import helpers with `from conftest import ...`; with a conftest here that name may
be this module, so the root conftest's helpers are re-exported (loaded from its file)."""

from __future__ import annotations

import importlib.util
import sqlite3
import threading
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "stragglers_tests_root_conftest", Path(__file__).resolve().parents[1] / "conftest.py")
assert _spec is not None and _spec.loader is not None
_root = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_root)
# helpers and constants only (every public one, so that a helper added there is found here):
# the root's hooks and fixtures are pytest's already
globals().update({k: v for k, v in vars(_root).items()
                  if not k.startswith(("_", "pytest_")) and not hasattr(v, "_pytestfixturefunction")
                  and type(v).__name__ != "FixtureFunctionDefinition" and k not in globals()})

# threads a finished test may leave: the interpreter's and libraries' own (started once and
# shared by every later test, or ending on their own), not a service's
_SHARED_PREFIXES = ("asyncio_", "ThreadPoolExecutor-", "QueueFeederThread", "Thread-")
# a service's pools start their threads at their first task: one may belong to a service of a
# module-scoped fixture, still serving (checked when the module ends)
_LAZY_PREFIXES = ("shard-reads", "shard-shuffles", "shard-control", "shard-restores",
                  "shard-restore-space")


def _left_running(before: set, ignore: tuple[str, ...]) -> list[str]:
    """Names of the threads started since `before` still running (after a bounded wait)."""
    left = [t for t in threading.enumerate() if t not in before and t.is_alive()
            and not t.name.startswith(ignore)]
    for t in left:
        t.join(timeout=10)   # a stop was asked for: the thread finishes its current step
    return [t.name for t in left if t.is_alive()]


@pytest.fixture(autouse=True)
def no_leaked_threads():
    """Fail a test that leaves a thread it started running (a service not stopped: its
    heartbeat went on waking up, and taking CPU from, every later test of the same worker)."""
    before = set(threading.enumerate())
    yield
    names = _left_running(before, _SHARED_PREFIXES + _LAZY_PREFIXES)
    assert not names, f"threads left running by this test: {names}"


@pytest.fixture(autouse=True, scope="module")
def no_leaked_threads_in_module():
    """The same for a module's own fixtures, their pools' threads included, once it ends."""
    before = set(threading.enumerate())
    yield
    names = _left_running(before, _SHARED_PREFIXES)
    assert not names, f"threads left running by this module's fixtures: {names}"


def store_tables(db, names=("datasets", "shards", "workers", "lease_requests")) -> dict:
    """Every row of these tables of a shard service's database, in a fixed order: what a
    refused request must leave as it was."""
    with sqlite3.connect(db) as c:
        return {t: c.execute(f"SELECT * FROM {t} ORDER BY 1, 2, 3").fetchall() for t in names}
