"""Faults: kill -9 of the service during ingest (history intact, nothing counted twice), and a
real training run whose monitor is down at the start and killed midway."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import REPO, eventually, free_port
from monitor_jobs import get, parts_of, slow_job, start_run, write_parts
from stragglers.trace.runformat import read_run

SETTINGS = "settings: {window_steps: 4, stall_after_s: 600, tick_s: 0.1, rescan_s: 0.5}\n"


def monitor(tmp: Path, port: int, *args: str) -> subprocess.Popen:
    cfg = tmp / "monitor.yaml"
    cfg.write_text(SETTINGS)
    return subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                             str(tmp / "mon.db"), "--port", str(port), "--config", str(cfg),
                             "--data-dir", str(tmp / "uploads"), *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def kill9(proc: subprocess.Popen) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()


def children(pid: int) -> set[int]:
    """The live child processes of `pid` (Linux /proc)."""
    kids = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids |= {int(k) for k in (task / "children").read_text().split()}
        except OSError:
            pass
    return {k for k in kids if alive(k)}


def alive(pid: int) -> bool:
    """The process exists and is not a zombie (an orphan's zombie waits for a reaper)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.slow
def test_kill_9_during_ingest_keeps_history_and_counts_no_part_twice(tmp_path):
    runs = tmp_path / "runs"
    run = runs / "job-k"
    trace = slow_job(steps=48)
    parts = parts_of(trace, steps_per_part=2)                 # 24 parts per rank, 96 in all
    start_run(run, trace)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = monitor(tmp_path, port, "--watch", str(runs))
    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            eventually(lambda: c.get("/health").status_code == 200, 120, what="monitor up")
            write_parts(run, parts[:40])
            eventually(lambda: get(c, "/api/stats")["by_way"].get("files", {}).get("parts", 0)
                       >= 20, 120, what="some parts in")
            before = get(c, "/api/jobs/job-k")["windows"]
            write_parts(run, parts[40:60])                    # the service is busy with these...
            helpers = children(proc.pid)                      # (its analysis process among them)
            assert helpers, "the monitor had no analysis process"
            kill9(proc)                                       # ...when it is killed
            write_parts(run, parts[60:])                      # the job goes on meanwhile
            proc = monitor(tmp_path, port, "--watch", str(runs))
            # the killed service's helper processes end by themselves (no orphans left)
            eventually(lambda: not any(map(alive, helpers)), 120, what="helpers gone")
            eventually(lambda: c.get("/health").status_code == 200, 120, what="restarted")
            stats = eventually(lambda: (s := get(c, "/api/stats"))["by_way"].get("files", {})
                               .get("parts") == len(parts) and s, 180, what="all parts")
            assert stats["by_way"]["files"]["records"] == len(trace)    # each row once
            wins = eventually(lambda: len(w := get(c, "/api/jobs/job-k")["windows"]) == 12
                              and w, 180, what="12 windows")
            assert [(w["idx"], w["first_step"], w["last_step"]) for w in wins] == \
                [(i, 4 * i, 4 * i + 3) for i in range(12)]
            # the windows analysed before the kill are still there, unchanged
            for old in before:
                assert wins[old["idx"]]["analysed_at"] == old["analysed_at"]
                assert wins[old["idx"]]["slowdown"] == old["slowdown"]
    finally:
        if proc.poll() is None:
            kill9(proc)


@pytest.mark.distributed
def test_training_keeps_going_while_the_monitor_is_down_and_delivers_after(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
           "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "examples/train_gpt.py", "--pp", "2",
           "--steps", "150", "--layers", "2", "--d-model", "32", "--max-seq-len", "64",
           "--flush-interval", "0.3", "--trace-dir", str(tmp_path / "gpt-down"),
           "--monitor-url", url, "--monitor-close-timeout", "300"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONUNBUFFERED": "1"}
    train = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    proc = None
    try:
        # The monitor is not there while training starts: steps go on regardless.
        first = ""
        while "step    5" not in first and train.poll() is None:
            first += train.stdout.readline()
        assert train.poll() is None, first
        proc = monitor(tmp_path, port)
        with httpx.Client(base_url=url, timeout=30) as c:
            eventually(lambda: get(c, "/api/stats")["by_way"].get("http", {}).get("parts", 0)
                       >= 8, 180, what="buffered parts delivered")
            kill9(proc)                                       # and down again, mid-run
            proc = monitor(tmp_path, port)
            eventually(lambda: c.get("/health").status_code == 200, 120, what="restarted")
            # A monitor back within the uploaders' close timeout gets everything: the timeout
            # (300 s) is far beyond a restart, so training that ends while the monitor is still
            # down (a loaded machine) waits for it instead of the verdict resting on a race.
            out, _ = train.communicate(timeout=400)
            assert train.returncode == 0, (first + out)[-4000:]
            local = read_run(tmp_path / "gpt-down")
            stats = eventually(lambda: (s := get(c, "/api/stats"))["by_way"].get("http", {})
                               .get("records") == len(local) and s, 180,
                               what="every recorded row delivered")
            n_files = len(list((tmp_path / "gpt-down").glob("rank-*.part-*.parquet")))
            assert stats["by_way"]["http"]["parts"] == n_files
            assert len(read_run(tmp_path / "uploads" / "gpt-down")) == len(local)
    finally:
        for p in (train, proc):
            if p is not None and p.poll() is None:
                kill9(p)


@pytest.mark.slow
def test_sigterm_stops_the_service_cleanly(tmp_path):
    # SIGTERM (what `kill`, systemd and Kubernetes send): the service stops its threads and
    # its analysis process and closes the store, then exits 143. uvicorn re-raises the signal
    # after its graceful shutdown; with the default handler that killed the process before the
    # cleanup (the analysis process's semaphores were reported leaked, the store left open).
    runs = tmp_path / "runs"
    run = runs / "job-t"
    trace = slow_job(steps=8)
    start_run(run, trace)
    write_parts(run, parts_of(trace, steps_per_part=4))
    port = free_port()
    cfg = tmp_path / "monitor.yaml"
    cfg.write_text(SETTINGS)
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                             str(tmp_path / "mon.db"), "--port", str(port), "--config", str(cfg),
                             "--watch", str(runs)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            eventually(lambda: c.get("/health").status_code == 200, 120, what="monitor up")
            eventually(lambda: len(get(c, "/api/jobs/job-t")["windows"]) == 2, 120,
                       what="2 windows")
        helpers = children(proc.pid)
        assert helpers, "the monitor had no analysis process"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM, out
        assert "leaked" not in out and "Traceback" not in out, out
        eventually(lambda: not any(map(alive, helpers)), 60, what="helpers gone")
        # the store was closed: SQLite folds its write-ahead log back when the last
        # connection closes
        assert not (tmp_path / "mon.db-wal").exists()
    finally:
        if proc.poll() is None:
            kill9(proc)
        if proc.stdout:
            proc.stdout.close()
