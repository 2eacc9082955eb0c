"""Red team round five (issue 34): defects found attacking fresh `serve` processes on loopback.

Each test is one defect class, marked xfail(strict=True) until its fix lands (then the mark goes):
a pass before the fix fails the suite, so each flips exactly when its defect is gone. Real
servers in subprocesses (some defects kill the process: in-process servers would take pytest
with them).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import REPO, eventually, fill, listening_url, up

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import parts_of, slow_job, start_run, write_parts  # noqa: E402

from stragglers.trace.runformat import table_bytes  # noqa: E402

TOKEN = "hostile-round5-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SETTINGS = "settings: {window_steps: 5, stall_after_s: 600, tick_s: 0.05}\n"
LOGS: dict[int, Path] = {}   # a served process's stderr file, by its pid


def token_file(tmp: Path) -> Path:
    path = tmp / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path


def serve_monitor(tmp: Path, *args: str) -> tuple[subprocess.Popen, str]:
    """`stragglers monitor serve` as an operator starts it, on a port of its own choosing (no
    race for a free one); the process (its stderr kept in a file for the verdict) and its URL, or ""
    when it exited before saying where it listens."""
    cfg = tmp / "monitor.yaml"
    cfg.write_text(SETTINGS)
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                             str(tmp / "mon.db"), "--port", "0", "--config", str(cfg),
                             "--token-file", str(token_file(tmp)), *args], cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=(tmp / "stderr.log").open("wb"))
    LOGS[proc.pid] = tmp / "stderr.log"        # where stop() finds what it said
    return proc, listening_url(proc)


def stop(proc: subprocess.Popen) -> str:
    """Stop the service; all its stderr said."""
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)
    return LOGS.pop(proc.pid).read_text(errors="replace")


def footer_type_flipped(body: bytes, column: bytes = b"dp_rank") -> bytes:
    """The part with one byte of its Thrift footer changed: `column`'s ColumnMetaData type,
    INT32 (zigzag 2) to BOOLEAN (0) — what a flipped bit on disk or a hostile writer gives."""
    footer_len = int.from_bytes(body[-8:-4], "little")
    start = len(body) - 8 - footer_len
    footer = body[start:-8]
    at = 0
    while True:
        at = footer.index(b"\x15\x02\x19", at)        # field 1 (type, i32) = INT32, then encodings
        if column in footer[at:at + 24]:
            break
        at += 1
    out = bytearray(body)
    out[start + at + 1] = 0x00
    return bytes(out)


def footer_made_required(body: bytes, column: bytes = b"gmc") -> bytes:
    """The part with `column`'s schema element turned from OPTIONAL to REQUIRED in its footer
    (one byte): its chunks' level histograms no longer fit the schema."""
    footer_len = int.from_bytes(body[-8:-4], "little")
    start = len(body) - 8 - footer_len
    # field 3 (repetition_type, i32) = OPTIONAL (zigzag 2), then field 4 (name)
    at = body.index(b"%\x02\x18" + bytes([len(column)]) + column, start)
    out = bytearray(body)
    out[at + 1] = 0x00
    return bytes(out)


def page_header_with_endless_map(body: bytes, column: str = "seq_id") -> bytes:
    """The part with its `column` data page's statistics turned, in place, into a Thrift map
    of 2**63 - 1 (bool, bool) entries: booleans in a map take a byte each, but a reader that
    skips them as no bytes loops 2**63 times without moving."""
    import io

    import pyarrow.parquet as pq
    meta = pq.ParquetFile(io.BytesIO(body)).metadata
    rg = meta.row_group(0)
    chunk = next(rg.column(j) for j in range(rg.num_columns)
                 if rg.column(j).path_in_schema == column)
    at = body.index(b"\x1c\x18\x04", chunk.data_page_offset) + 1   # statistics' min/max
    endless = b"\x1b" + b"\xff" * 8 + b"\x7f" + b"\x11" + b"\x00"   # map, 2**63-1, bool/bool
    return body[:at] + endless + body[at + len(endless):]


def a_part(rank: int = 1, part: int = 0):
    trace = slow_job(steps=10, slow=(0, 1, 3.0))
    cols = next(c for r, p, c in parts_of(trace, 5) if (r, p) == (rank, part))
    return trace, table_bytes(cols)


@pytest.mark.slow
@pytest.mark.parametrize("corrupt", [footer_type_flipped, footer_made_required],
                         ids=["chunk-type", "level-histogram"])
def test_monitor_survives_a_part_whose_footer_disagrees_with_its_schema(tmp_path, corrupt):
    """Was: a part whose footer's column chunks disagree with its schema (a chunk's type, a
    column's level histograms) aborts the monitor (pyarrow's ColumnChunkMetaData throws through
    noexcept: std::terminate, SIGABRT), no 422 (fixed; round five)."""
    trace, good = a_part()
    status, text, alive, err = upload_to_a_fresh_monitor(tmp_path, trace, corrupt(good))
    assert alive, f"monitor gone after one upload ({text}); stderr: {err[-2000:]}"
    assert status == 422 and "error" in text, (status, text)


@pytest.mark.slow
def test_monitor_restarts_beside_a_watched_part_with_a_corrupt_footer(tmp_path):
    """Was: a watched part whose footer's column type disagrees with its schema aborts the monitor
    at every start (crash loop) (fixed; round five)."""
    trace = slow_job(steps=10, slow=(0, 1, 3.0))
    run = tmp_path / "runs" / "run"
    run.mkdir(parents=True)
    start_run(run, trace)
    parts = parts_of(trace, 5)
    write_parts(run, [p for p in parts if (p[0], p[1]) != (1, 1)])
    cols = next(c for r, p, c in parts if (r, p) == (1, 1))
    (run / "rank-00001.part-000001.parquet").write_bytes(footer_type_flipped(table_bytes(cols)))
    proc, url = serve_monitor(tmp_path, "--watch", str(tmp_path / "runs"))
    try:
        # the part is refused once and the run's other windows analysed, the service up
        eventually(lambda: not up(proc, url) or httpx.get(
            f"{url}/api/jobs/run", timeout=10).json().get("windows_total", 0) >= 1,
            timeout=60, what="a window of the run")
        alive = up(proc, url)
    finally:
        err = stop(proc)
    assert alive, f"monitor aborted on a watched part; stderr: {err[-2000:]}"


@pytest.mark.slow
def test_monitor_refuses_a_page_header_with_an_endless_map(tmp_path):
    """Was: a page header holding a Thrift map of booleans spins pages._skip 2**63 times (a
    boolean in a map skipped as no bytes): the ingest thread is stuck for good, every job's
    uploads time out, SIGTERM does not stop the service (fixed; round five)."""
    trace, good = a_part()
    # a liveness bound, not a timing verdict: the check takes milliseconds, the loop forever
    status, text, _, _ = upload_to_a_fresh_monitor(tmp_path, trace,
                                                   page_header_with_endless_map(good), 30)
    assert status == 422 and "error" in text, (status, text)


def upload_to_a_fresh_monitor(tmp_path: Path, trace, body: bytes, timeout: float = 60):
    """(status or None, text, whether the monitor still answers, its stderr) of one part
    uploaded to a fresh monitor that holds the job's metadata (None: no answer, the process
    died under the request or took longer than `timeout`)."""
    proc, url = serve_monitor(tmp_path)
    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            try:
                r = c.put("/api/jobs/j/ranks/1/parts/0", content=body, headers=AUTH,
                          timeout=timeout)
                status, text = r.status_code, r.text
            except httpx.TransportError as exc:   # died under the request, or no answer
                status, text = None, repr(exc)
        alive = up(proc, url)
    finally:
        err = stop(proc)
    return status, text, alive, err


def nested_yaml(tmp: Path) -> Path:
    path = tmp / "deep.yaml"
    path.write_text("webhooks: " + "[" * 20000 + "]" * 20000 + "\n")
    return path


def fifo_yaml(tmp: Path) -> Path:
    path = tmp / "fifo.yaml"
    os.mkfifo(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("config", [nested_yaml, fifo_yaml], ids=["nested", "fifo"])
def test_monitor_refuses_a_config_file_it_cannot_read_in_one_line(tmp_path, config):
    """Was: the monitor's --config file is read as it comes: 20,000 nested lists end in 'internal
    error: RecursionError' (exit 4), a FIFO blocks the start for good (the token file and watched
    files are opened non-blocking, regular files only, bounded) (fixed; round five)."""
    path = config(tmp_path)
    try:
        done = subprocess.run([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                               str(tmp_path / "mon.db"), "--port", "0", "--config", str(path)],
                              cwd=REPO, capture_output=True, text=True, timeout=30)
        code, err = done.returncode, done.stderr
    except subprocess.TimeoutExpired:                 # (a liveness bound: it never starts)
        code, err = None, "still starting after 30 s"
    assert code == 2, (code, err[-500:])
    assert "internal error" not in err and str(path) in err and len(err.splitlines()) == 1, err


def monitor_store_with_a_job(tmp: Path) -> Path:
    """A monitor's store holding one watched job with an analysed window (the service stopped)."""
    from stragglers.monitor.server import MonitorServer
    from stragglers.monitor.settings import MonitorConfig

    trace = slow_job(steps=10, slow=(0, 1, 3.0))
    run = tmp / "runs" / "run"
    run.mkdir(parents=True)
    start_run(run, trace)
    write_parts(run, parts_of(trace, 5))
    db = tmp / "mon.db"
    server = MonitorServer(db, watch=[tmp / "runs"], port=0, config=MonitorConfig(
        window_steps=5, stall_after_s=600, tick_s=0.05)).start()
    try:
        eventually(lambda: httpx.get(f"{server.url}/api/jobs/run", timeout=10).json()
                   .get("windows_total", 0) >= 2, what="2 windows")
    finally:
        server.stop()
    return db


def damage_table(db: Path, table: str) -> None:
    """Overwrite the head of `table`'s root b-tree page (a torn write, a bad sector): the
    file opens, its header and schema read, and every read of that table fails as malformed."""
    import sqlite3
    con = sqlite3.connect(db)
    try:
        con.execute("PRAGMA wal_checkpoint(TRUNCATE)")   # every page in the file itself
        page_size = con.execute("PRAGMA page_size").fetchone()[0]
        root = con.execute("SELECT rootpage FROM sqlite_master WHERE type = 'table' AND "
                           "name = ?", (table,)).fetchone()[0]
    finally:
        con.close()
    assert not Path(f"{db}-wal").exists() or Path(f"{db}-wal").stat().st_size == 0
    with db.open("r+b") as f:
        f.seek((root - 1) * page_size)
        f.write(b"\xff" * 16)


@pytest.mark.slow
def test_monitor_start_on_a_damaged_store_is_one_clean_line(tmp_path):
    """Was: a store whose jobs table is damaged stops the monitor's start with 'internal error:
    DatabaseError ... this is a bug' (exit 4), where the shard service says 'not a usable SQLite
    database' (exit 2) (fixed; round five)."""
    db = monitor_store_with_a_job(tmp_path)
    damage_table(db, "jobs")
    done = subprocess.run([sys.executable, "-m", "stragglers.cli", "monitor", "serve", "--db",
                           str(db), "--port", "0"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr[-800:])
    assert "internal error" not in done.stderr and str(db) in done.stderr, done.stderr[-800:]


@pytest.mark.slow
def test_monitor_stats_over_a_damaged_table_is_a_storage_error(tmp_path):
    """Was: a damaged parts table makes /api/stats a 500 'internal error (DatabaseError)' with a
    traceback in the log; a storage failure is 503 (fixed; round five)."""
    db = monitor_store_with_a_job(tmp_path)
    damage_table(db, "parts")
    proc, url = serve_monitor(tmp_path)            # (its store: tmp_path / "mon.db")
    try:
        assert up(proc, url), "the monitor did not start"
        r = httpx.get(f"{url}/api/stats", timeout=60)
        alive = up(proc, url)
    finally:
        err = stop(proc)
    assert alive
    assert r.status_code == 503 and "error" in r.json(), (r.status_code, r.text)
    assert "Traceback" not in err, err[-3000:]


@pytest.mark.slow
def test_shard_status_is_answered_on_a_full_disk_with_an_expired_lease(small_disk, tmp_path):
    """Was: on a full disk a data set's status is 507 DiskFull while it holds an expired lease:
    the status read first asks the writer to requeue it, and that write is refused; reads are to
    be answered on a full disk (fixed; round five)."""
    token = token_file(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.cli", "adapt", "serve", "--db",
                             str(small_disk / "s.db"), "--port", "0", "--token-file", str(token)],
                            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=(tmp_path / "stderr.log").open("wb"))
    LOGS[proc.pid] = tmp_path / "stderr.log"
    url = listening_url(proc)
    try:
        assert up(proc, url), "the shard service did not start"
        with httpx.Client(base_url=url, timeout=60, headers={
                "Authorization": f"Bearer {TOKEN}", "X-Service-Token": TOKEN}) as c:
            assert c.post("/datasets", json={"name": "d0", "num_samples": 1000,
                                             "shard_size": 10, "lease_s": 0.05}).status_code == 200
            fence = c.post("/datasets/d0/join", json={"worker": "w"}).json()["fence"]
            assert c.post("/datasets/d0/lease", json={"worker": "w", "fence": fence}
                          ).status_code == 200            # held, never acked: it expires
            fill(small_disk)
            time.sleep(0.2)                               # (past the lease's 0.05 s)
            status = c.get("/datasets/d0/status")
            health = c.get("/health").status_code
    finally:
        err = stop(proc)
    assert health == 200, err[-2000:]
    assert status.status_code == 200, status.text
    counts = status.json()["epochs"]["0"]
    assert counts["DOING"] + counts["TODO"] == 100, counts


@pytest.mark.slow
def test_monitor_window_closed_on_a_full_disk_is_stored_once_space_returns(small_disk, tmp_path):
    trace = slow_job(steps=8, slow=(0, 1, 3.0))
    run = tmp_path / "runs" / "run"
    run.mkdir(parents=True)
    start_run(run, trace)
    parts = parts_of(trace, 5)   # part 0: steps 0..4 (a window), part 1: 5..7 (open)
    window_0 = [p for p in parts if p[1] == 0]
    open_steps = [p for p in parts if p[1] == 1]
    write_parts(run, window_0)
    cfg = tmp_path / "monitor.yaml"
    # (steps 5..7 are written once window 0 is stored, and close only at the stall, long
    # after: it comes once the disk is full however slow the machine; with 4 s and every part
    # written at once, a slow machine stalled with window 0 and never saw the disk fill)
    cfg.write_text("settings: {window_steps: 5, stall_after_s: 20, tick_s: 0.1, "
                   "max_upload_bytes_held: 1048576}\n")
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                             str(small_disk / "mon.db"), "--port", "0", "--config", str(cfg),
                             "--watch", str(tmp_path / "runs")], cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=(tmp_path / "stderr.log").open("wb"))
    LOGS[proc.pid] = tmp_path / "stderr.log"
    url = listening_url(proc)

    def job():
        return httpx.get(f"{url}/api/jobs/run", timeout=30).json()
    try:
        assert up(proc, url), "the monitor did not start"
        eventually(lambda: job().get("windows_total") == 1, timeout=60, what="window 0 stored")
        write_parts(run, open_steps)
        eventually(lambda: job()["pending_rows"] > 0 or job()["windows_total"] > 1,
                   timeout=60, what="steps 5..7 held")
        fill(small_disk)
        now = job()
        if now["state"] != "running" or now["windows_total"] != 1:
            pytest.skip("the job stalled before the disk was full (20 s to see one part)")
        eventually(lambda: job()["state"] == "stalled", timeout=60, what="the stall")
        (small_disk / "filler").unlink()                # space returns
        try:   # (a liveness bound: a retry takes a tick, 0.1 s; the defect: never)
            eventually(lambda: job()["windows_total"] == 2, timeout=30, what="window 1")
            stored = True
        except AssertionError:
            stored = False
        alive = up(proc, url)
    finally:
        err = stop(proc)
    assert alive, err[-2000:]
    assert stored, f"steps 5..7 never analysed; log: {err[-1500:]}"


@pytest.mark.slow
def test_monitor_upload_on_a_full_disk_is_one_line_in_the_log(upload_disk, tmp_path):
    trace, _ = a_part()
    parts = parts_of(trace, 5)
    cfg = tmp_path / "monitor.yaml"
    cfg.write_text("settings: {stall_after_s: 600, max_upload_bytes_held: 1048576}\n")
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                             str(upload_disk / "mon.db"), "--port", "0", "--config", str(cfg),
                             "--token-file", str(token_file(tmp_path))], cwd=REPO,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"},
                            stdout=subprocess.PIPE, stderr=(tmp_path / "stderr.log").open("wb"))
    LOGS[proc.pid] = tmp_path / "stderr.log"
    url = listening_url(proc)
    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60, headers=AUTH) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict()).status_code == 200
            rank, part, cols = parts[0]
            fill(upload_disk)
            refused = c.put(f"/api/jobs/j/ranks/{rank}/parts/{part}", content=table_bytes(cols))
            (upload_disk / "filler").unlink()
            again = c.put(f"/api/jobs/j/ranks/{rank}/parts/{part}", content=table_bytes(cols))
    finally:
        stop(proc)
    assert refused.status_code == 507 and "error" in refused.json(), refused.text
    assert again.status_code == 200 and again.json()["status"] == "stored", again.text
    log = (tmp_path / "stderr.log").read_text(errors="replace")     # all of it
    assert "Traceback" not in log, log[-3000:]


@pytest.mark.slow
def test_monitor_starts_again_on_a_full_disk(small_disk, tmp_path):
    def serve():
        proc = subprocess.Popen([sys.executable, "-m", "stragglers.cli", "monitor", "serve",
                                 "--db", str(small_disk / "mon.db"), "--port", "0"], cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                stdout=subprocess.PIPE,
                                stderr=(tmp_path / "stderr.log").open("wb"))
        LOGS[proc.pid] = tmp_path / "stderr.log"
        return proc, listening_url(proc)

    proc, url = serve()
    try:
        assert up(proc, url), "the monitor did not start"
    finally:
        stop(proc)
    fill(small_disk)
    proc, url = serve()
    try:
        alive = up(proc, url)
        jobs = httpx.get(f"{url}/api/jobs", timeout=60).status_code if alive else None
    finally:
        err = stop(proc)
    assert alive and jobs == 200, err[-1500:]
