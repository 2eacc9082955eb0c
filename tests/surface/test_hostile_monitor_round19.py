"""Red team round 19 (found in round 18): control and bidirectional characters in a job's names,
and a start refused by its watcher leaving the store and the port held (real servers on
loopback, real SQLite; no mocks)."""

from __future__ import annotations

import json
import socket
import sqlite3
import sys

import httpx
import psutil
import pytest

from conftest import REPO, eventually
from stragglers.errors import InputError
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import get, slow_job  # noqa: E402

TOKEN = "hostile-round19-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=0.3)
# a NUL (older Prometheus parsers end the label there), another C0 and a C1 control, a
# right-to-left override ("host\u202e1tsoh" shows as "hosthost1") and an isolate
BAD = ["host\x00x", "host\x1b[2J", "host\x85", "evil\u202e1tsoh", "host\u2067b"]


def _meta_with(field: str, value: str) -> dict:
    meta = slow_job(steps=5).meta.to_dict()
    if field == "host":
        meta["extra"]["layout"][1]["host"] = value
    else:
        meta[field] = value
    return meta


def test_control_and_bidi_characters_in_names_are_refused_at_upload_naming_the_field(tmp_path):
    """A host name (or the meta's name, run_id) holding a control or bidirectional formatting
    character is 422 naming the field and the code point, nothing stored (before: 200, and the
    host reached /metrics' labels and the dashboard as it was)."""
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            for i, value in enumerate(BAD):
                r = c.put(f"/api/jobs/h{i}/meta", json=_meta_with("host", value), headers=AUTH)
                assert r.status_code == 422, r.text
                error = r.json()["error"]
                assert "extra.layout[1].host" in error and f"U+{ord(value[4]):04X}" in error, \
                    error
                assert value not in error and "\x00" not in r.text
            for field in ("name", "run_id"):
                r = c.put(f"/api/jobs/f-{field}/meta", json=_meta_with(field, "a\u202eb"),
                          headers=AUTH)
                assert r.status_code == 422 and field in r.json()["error"], r.text
            assert get(c, "/api/jobs")["jobs"] == []
            # names with other characters (non-ASCII letters, spaces) are taken as before
            ok = c.put("/api/jobs/fine/meta", json=_meta_with("host", "höst 1.example"),
                       headers=AUTH)
            assert ok.status_code == 200, ok.text
            assert "\x00" not in c.get("/metrics").text
    finally:
        s.stop()


def test_a_watched_meta_with_such_a_host_is_refused_naming_the_field(tmp_path):
    """The same check for a watched run's meta.json: refused once (bad_meta naming the
    field), no job; the run beside it is taken."""
    runs = tmp_path / "runs"
    for name, host in (("bad", "evil\u202e1tsoh"), ("good", "host1")):
        (runs / name).mkdir(parents=True)
        (runs / name / "meta.json").write_text(json.dumps(_meta_with("host", host)))
    s = MonitorServer(tmp_path / "mon.db", watch=[runs], port=0, token=TOKEN,
                      config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            def refusal():
                return [r for r in get(c, "/api/stats")["rejects"]
                        if r["source"].startswith("bad")]
            eventually(lambda: "good" in {j["job"] for j in get(c, "/api/jobs")["jobs"]},
                       what="the good run taken")
            assert {j["job"] for j in get(c, "/api/jobs")["jobs"]} == {"good"}
            eventually(refusal, what="the bad run refused", timeout=10)
            rej = refusal()[0]
            assert rej["reason"] == "bad_meta", rej
            assert "extra.layout[1].host" in rej["problem"] and "U+202E" in rej["problem"], rej
            assert "\u202e" not in json.dumps(get(c, "/api/stats"), ensure_ascii=False)
    finally:
        s.stop()


def test_a_stored_row_holding_such_a_host_sets_its_job_aside(tmp_path):
    """Read back from the store (a row written before this check, or by another instance's
    older version): the job is quarantined naming the field, the service and the other jobs
    go on, and /metrics holds no NUL (before: the job was taken and its host shown)."""
    meta = slow_job(steps=5).meta.to_dict()
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    with httpx.Client(base_url=s.url, timeout=60) as c:
        for job in ("good", "bad"):
            assert c.put(f"/api/jobs/{job}/meta", json=meta, headers=AUTH).status_code == 200
    s.stop()
    meta["extra"]["layout"][2]["host"] = "host\x00x"
    with sqlite3.connect(tmp_path / "mon.db") as db:
        db.execute("UPDATE jobs SET meta = ? WHERE job = 'bad'",
                   (json.dumps(meta, sort_keys=True),))
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert get(c, "/api/jobs/good")["state"] == "running"
            bad = get(c, "/api/jobs/bad")
            assert bad["state"] == "quarantined", bad
            assert "extra.layout[2].host" in json.dumps(get(c, "/api/stats")), \
                get(c, "/api/stats")
            assert "\x00" not in c.get("/metrics").text
    finally:
        s.stop()


def _db_files_open(db) -> list[str]:
    return [f.path for f in psutil.Process().open_files() if f.path.startswith(str(db))]


def test_a_start_refused_by_its_watcher_leaves_no_socket_or_store_open(tmp_path):
    """A --watch path that is not a directory refuses the start (InputError): the listening
    socket and the store are closed first, so the port is free and the same store opens at
    once (before: both stayed open until the object was collected; the next start on that
    port failed EADDRINUSE and the store's claim was held)."""
    not_dir = tmp_path / "file"
    not_dir.write_text("x")
    db = tmp_path / "mon.db"
    MonitorServer(db, port=0, token=TOKEN, config=CFG).start().stop()   # the store exists
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(InputError, match="not a directory") as refused:
        MonitorServer(db, watch=[not_dir], port=port, token=TOKEN, config=CFG)
    # (the refusal's traceback, which holds the half-built server, is still alive here)
    assert refused.value is not None
    assert _db_files_open(db) == []
    s = MonitorServer(db, port=port, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.get("/health").status_code == 200
    finally:
        s.stop()


def test_a_start_refused_by_a_damaged_store_leaves_no_socket_or_store_open(tmp_path):
    """The same for a start that fails once begun (the store's jobs table torn: "the store is
    damaged"): the threads begun are stopped, the port and the store closed (before: both
    held by the server object the caller never got)."""
    db = tmp_path / "mon.db"
    s = MonitorServer(db, port=0, token=TOKEN, config=CFG).start()
    with httpx.Client(base_url=s.url, timeout=60) as c:
        for i in range(40):   # (the jobs table then fills a page of its own)
            assert c.put(f"/api/jobs/j{i}/meta", json=slow_job(steps=5).meta.to_dict(),
                         headers=AUTH).status_code == 200
    s.stop()
    with sqlite3.connect(db) as con:
        root = con.execute("SELECT rootpage FROM sqlite_master WHERE name = 'jobs'").fetchone()[0]
        size = con.execute("PRAGMA page_size").fetchone()[0]
    con.close()
    with open(db, "r+b") as f:   # (the page header kept, its cells torn)
        f.seek((root - 1) * size + 8)
        f.write(b"\xff" * (size - 8))
    server = MonitorServer(db, port=0, token=TOKEN, config=CFG)
    port = server.port
    with pytest.raises(InputError, match="the store is damaged"):
        server.start()
    assert _db_files_open(db) == []
    again = socket.socket()
    try:
        again.bind(("127.0.0.1", port))   # (EADDRINUSE while the refused server's is open)
    finally:
        again.close()


def test_the_postgres_store_stopped_and_started_again_under_a_running_monitor(tmp_path):
    """PostgreSQL stopped under a serving monitor: uploads meanwhile are answered 503 in the
    service's JSON shape (retryable, nothing acknowledged), reads do not hang; started again,
    the same monitor (no restart) takes the retried uploads and every acknowledged part is
    analysed into its windows."""
    import pg_cluster
    from monitor_jobs import parts_of
    from stragglers.trace.runformat import table_bytes

    reason = pg_cluster.why_not()
    if reason is not None:
        pytest.skip(reason)
    pytest.importorskip("psycopg")
    cluster = pg_cluster.PostgresCluster().start()   # (its own: this test stops it)
    try:
        trace = slow_job(steps=15)
        parts = parts_of(trace, 5)   # 3 parts per rank, 4 ranks
        s = MonitorServer(cluster.url(), port=0, token=TOKEN, data_dir=tmp_path / "up",
                          config=CFG).start()
        try:
            with httpx.Client(base_url=s.url, timeout=60) as c:
                assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                             headers=AUTH).status_code == 200
                acked = set()

                def put(rank, part, cols):
                    r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{part}",
                              content=table_bytes(cols), headers=AUTH)
                    if r.status_code == 200:
                        acked.add((rank, part))
                    return r
                for rank, part, cols in parts[:4]:
                    assert put(rank, part, cols).status_code == 200
                cluster.halt()
                for rank, part, cols in parts[4:8]:
                    r = put(rank, part, cols)
                    assert r.status_code == 503, r.text   # (500, "internal error" before)
                    assert "cannot reach its storage" in r.json()["error"], r.text
                assert c.get("/api/jobs/j").status_code == 503
                assert c.get("/health").status_code == 200
                assert acked == {(rank, part) for rank, part, _ in parts[:4]}
                cluster.resume()
                for rank, part, cols in parts[4:]:   # (the recorder's retries)
                    eventually(lambda: put(rank, part, cols).status_code == 200,
                               what=f"part {rank}/{part} taken", timeout=60)
                eventually(lambda: len(get(c, "/api/jobs/j")["windows"]) == 3, what="windows",
                           timeout=60)
                windows = get(c, "/api/jobs/j")["windows"]
                # (every rank's every step: what was acknowledged before, and the retries)
                assert [(w["first_step"], w["last_step"], w["error"], w["reason"])
                        for w in windows] == [(0, 4, None, "complete"), (5, 9, None, "complete"),
                                              (10, 14, None, "complete")], windows
        finally:
            s.stop()
    finally:
        cluster.stop()
