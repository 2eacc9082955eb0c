"""Closing the SQLite store while another thread reads through it: the process crashed
(SIGSEGV: close() closed every thread's reading connection from the stopping thread, and the
app's reader threads and the ingest's worker threads are not joined at a stop). A read in
progress now ends with its result, its connection closed by its own thread after; any use
after close() is one clear error. Each case runs in a subprocess, so a crash is an exit
status, not a dead pytest worker; the read is held open by a SQL function that waits on an
event until close() has returned (no timing). The PostgreSQL store had the same race (psycopg's
close() frees the libpq connection without its lock): a read waiting on an advisory lock got
'connection socket closed'."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from pg_cluster import postgres_cluster, postgres_url  # noqa: F401 - fixtures

SCRIPT = textwrap.dedent('''
    import os, sqlite3, sys, tempfile, threading
    from pathlib import Path
    from stragglers.monitor.store_base import StoreClosed
    from stragglers.monitor.store_sqlite import SQLiteStore

    def open_files(folder):
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                continue
            if target.startswith(str(folder) + os.sep):
                found.append(target)
        return found

    folder = Path(tempfile.mkdtemp())
    store = SQLiteStore(folder / "mon.db")
    store.register_job("j", str(folder), "upload", None)
    in_query, closed, idle_read, idle_may_end = (threading.Event() for _ in range(4))
    out = {}

    def hold():
        in_query.set()
        assert closed.wait(30), "close() never returned"
        return 7

    def busy():   # a read in progress when the store is closed
        store.job_names()   # (this thread's reading connection, made by the store)
        db = store._local.db
        db.create_function("hold", 0, hold)
        try:
            out["busy"] = store._rows("SELECT hold() AS x")
        except Exception as exc:
            out["busy"] = repr(exc)
        try:
            store.job_names()
            out["busy after"] = "read a closed store"
        except StoreClosed as exc:
            out["busy after"] = str(exc)
        try:
            db.execute("SELECT 1")
            out["busy conn"] = "open"
        except sqlite3.ProgrammingError:
            out["busy conn"] = "closed"

    def idle():   # a thread that read once and lives on, idle, through the close
        out["idle"] = sorted(store.job_names())
        idle_read.set()
        idle_may_end.wait(30)

    threads = [threading.Thread(target=busy), threading.Thread(target=idle)]
    for t in threads:
        t.start()
    assert in_query.wait(30) and idle_read.wait(30)
    store.close()
    closed.set()
    threads[0].join(30)
    held = open_files(folder)   # the idle thread is still alive: its connection is closed too
    idle_may_end.set()
    threads[1].join(30)
    for name, call in (("read", lambda: store.job_bytes("j")),
                       ("write", lambda: store.set_upload_dropped("j", 0, 1))):
        try:
            call()
            out[name] = "used a closed store"
        except StoreClosed as exc:
            out[name] = str(exc)
    print(repr((out, held)), flush=True)
''')


def test_closing_the_store_mid_read_ends_the_read_and_leaves_nothing_open():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, f"rc {run.returncode}: {run.stderr[-2000:]}"
    out, held = eval(run.stdout.strip().splitlines()[-1])   # (our own repr of plain values)
    assert out["busy"] == [{"x": 7}]   # the read in progress ended with its result
    assert out["idle"] == ["j"]
    assert held == [], "a connection of the store is still open after close()"
    assert out["busy conn"] == "closed"   # (by its own thread, once its read ended)
    for key in ("busy after", "read", "write"):
        assert out[key].endswith("the monitor's store is closed (its service stopped); "
                                 "nothing was read or written"), (key, out[key])
        assert "\n" not in out[key]


PG_SCRIPT = textwrap.dedent('''
    import sys, threading, time
    import psycopg
    from stragglers.monitor.store_base import StoreClosed
    from stragglers.monitor.store_postgres import PostgresStore

    url, server = sys.argv[1], sys.argv[2]
    store = PostgresStore(url)
    store.register_job("j", "/j", "upload", None)
    locker = psycopg.connect(server, autocommit=True)
    locker.execute("SELECT pg_advisory_lock(4747)")
    idle_read, idle_may_end = threading.Event(), threading.Event()
    out = {}

    def busy():   # a read in progress (waiting for the lock) when the store is closed
        store.job_names()
        db = out["busy db"] = store._local.db
        try:
            out["busy"] = store._rows("SELECT 1 AS x FROM (SELECT pg_advisory_lock(4747)) q")
        except Exception as exc:
            out["busy"] = repr(exc)
        try:
            store.job_names()
            out["busy after"] = "read a closed store"
        except StoreClosed as exc:
            out["busy after"] = str(exc)

    def idle():
        out["idle"] = sorted(store.job_names())
        out["idle db"] = store._local.db
        idle_read.set()
        idle_may_end.wait(30)

    threads = [threading.Thread(target=busy), threading.Thread(target=idle)]
    for t in threads:
        t.start()
    waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
    deadline = time.monotonic() + 30   # (the read is waiting for the lock: a state, no timing)
    while locker.execute(waiting).fetchone()[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert idle_read.wait(30)
    store.close()
    locker.execute("SELECT pg_advisory_unlock(4747)")
    threads[0].join(30)
    idle_may_end.set()
    threads[1].join(30)
    for name, call in (("read", lambda: store.job_bytes("j")),
                       ("write", lambda: store.set_upload_dropped("j", 0, 1))):
        try:
            call()
            out[name] = "used a closed store"
        except StoreClosed as exc:
            out[name] = str(exc)
    out["closed"] = [out.pop(k).closed for k in ("busy db", "idle db")]
    out["feed"] = store._listener.is_alive()
    print(repr(out), flush=True)
''')


@pytest.mark.slow
def test_closing_the_postgres_store_mid_read_ends_the_read_and_closes_everything(
        postgres_cluster, postgres_url):
    run = subprocess.run([sys.executable, "-c", PG_SCRIPT, postgres_url, postgres_cluster.url()],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, f"rc {run.returncode}: {run.stderr[-2000:]}"
    out = eval(run.stdout.strip().splitlines()[-1])   # (our own repr of plain values)
    assert out["busy"] == [{"x": 1}]   # the read in progress ended with its result
    assert out["idle"] == ["j"]
    assert out["closed"] == [True, True]   # the busy one by its own thread, after its read
    assert out["feed"] is False   # the change feed's connection ended with its thread
    for key in ("busy after", "read", "write"):
        assert out[key].endswith("the monitor's store is closed (its service stopped); "
                                 "nothing was read or written"), (key, out[key])
