"""Closing the SQLite store while another thread reads through it: the process crashed
(SIGSEGV: close() closed every thread's reading connection from the stopping thread, and the
app's reader threads and the ingest's worker threads are not joined at a stop). A read in
progress now ends with its result, its connection closed by its own thread after; any use
after close() is one clear error. Each case runs in a subprocess, so a crash is an exit
status, not a dead pytest worker; the read is held open by a SQL function that waits on an
event until close() has returned (no timing)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

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
