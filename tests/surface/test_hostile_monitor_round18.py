"""Red team round 18: the analysis process's answers, windows cut off by kill -9 and stops, and
hostile requests against the live monitor (real spawned processes, real servers on loopback,
real SQLite; no mocks)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import REPO, eventually, free_port
from stragglers.errors import InputError
from stragglers.monitor.analyser import AnalysisProcess, AnswerTooLarge, ProcessDied, \
    WindowAnalyser
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import closed_windows, get, parts_of, slow_job, start_run, \
    write_parts  # noqa: E402

TOKEN = "hostile-round18-token-0123456789"


def test_a_window_answer_past_the_cap_is_an_error_row_naming_it():
    """Leftover 1: the analysis process's answer (a window's row and refusals, pickled) was
    read whole into the service, however large. With a cap (512 bytes here, an attribute the
    code before ignored: its windows came back analysed) the process answers AnswerTooLarge
    and the window keeps an error row naming the cap; the process is kept (no restart) and
    the next window goes the same way."""
    first, second = closed_windows(2)
    analyser = WindowAnalyser(timeout_s=120)
    analyser.answer_max_bytes = 512   # (a 4-worker window's answer is ~1 KB)
    try:
        for window in (first, second):
            row, refused = analyser.analyse(window)
            assert row.slowdown is None and refused == [] and row.idx == window.idx
            assert "AnswerTooLarge" in row.error, row.error
            assert "over analysis_answer_max_bytes (512 bytes)" in row.error, row.error
        assert analyser.restarts == 0
    finally:
        analyser.close()


def test_the_reader_refuses_an_answer_past_the_cap_without_reading_it():
    """The reader's own bound (the process's cap 1 MiB, the reader's 8 KiB): a 200 KB answer
    is refused by its length, not read; its task fails with AnswerTooLarge (not ProcessDied,
    which a window retries in a new process), the process is killed and the task queued after
    it fails ProcessDied. Before, the reader read any answer whole (no bound)."""
    process = AnalysisProcess(os.getpid(), 1 << 20)
    process.answer_max_bytes = 4096   # (the reader's; the process keeps its own, 1 MiB)
    try:
        big = process.submit(bytes, 200_000)
        after = process.submit(os.getpid)
        exc = big.exception(60)
        assert isinstance(exc, AnswerTooLarge), exc
        assert "longer than that, over analysis_answer_max_bytes (4,096 bytes)" in str(exc)
        assert isinstance(after.exception(60), ProcessDied)
        process.process.join(30)
        # (killed, or gone first by itself: refusing the message closed the answers' pipe, and
        # the process exits on the EPIPE of its write; which comes first is the scheduler's)
        assert process.process.exitcode in (0, -signal.SIGKILL) and process.dead
    finally:
        process.kill()


def test_a_monitor_with_a_small_answer_cap_stores_error_rows_and_goes_on(tmp_path):
    """The setting (analysis_answer_max_bytes) through a served monitor with its analysis
    process: every window of the job is stored, each an error row naming the cap, and the
    service answers /health and /metrics."""
    config = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05,
                           analysis_process=True, analysis_answer_max_bytes=512)
    trace = slow_job(steps=10)
    server = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=config).start()
    try:
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            assert c.put("/api/jobs/capped/meta", json=trace.meta.to_dict()).status_code == 200
            for rank, part, cols in parts_of(trace, 5):
                r = c.put(f"/api/jobs/capped/ranks/{rank}/parts/{part}",
                          content=table_bytes(cols))
                assert r.status_code == 200, r.text
            wins = eventually(lambda: len(w := server.monitor.store.windows("capped")) == 2
                              and w, timeout=120, what="both windows stored")
            for w in wins:
                assert w.slowdown is None
                assert "over analysis_answer_max_bytes (512 bytes)" in w.error, w.error
            assert c.get("/health").status_code == 200
            assert c.get("/metrics").status_code == 200
    finally:
        server.stop()


# ---- windows of many jobs cut off by kill -9 ------------------------------------------------

_SETTINGS = ("settings: {window_steps: 5, stall_after_s: 2, tick_s: 0.1, rescan_s: 0.3, "
             "analysis_start_timeout_s: 600, read_interval_s: 0}\n")


def _serve(tmp: Path, port: int) -> subprocess.Popen:
    cfg = tmp / "monitor.yaml"
    cfg.write_text(_SETTINGS)
    return subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                             str(tmp / "mon.db"), "--port", str(port), "--config", str(cfg),
                             "--data-dir", str(tmp / "uploads"), "--watch",
                             str(tmp / "runs")], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=open(tmp / "serve.log", "ab"))


def _analysis_child(pid: int) -> psutil.Process | None:
    """The service's analysis process (spawned; not multiprocessing's resource tracker)."""
    for child in psutil.Process(pid).children():
        cmd = " ".join(child.cmdline())
        if "spawn_main" in cmd and "resource_tracker" not in cmd:
            return child
    return None


def test_every_stored_window_of_every_job_is_analysed_after_a_kill_9(tmp_path):
    """Leftover 2: four watched jobs, their analysis process held (SIGSTOP) before any part
    came, every part stored, one job stalled with a partial window queued (steps 5-6): then
    kill -9 of the service. After the restart every job's every window is analysed — the
    stalled job's partial one too: its state was stored `stalled` at once (the dead-man) while
    its window waited, and a restarted job already stalled never had its pending steps cut
    (they waited for finish_after_s, an hour)."""
    runs = tmp_path / "runs"
    runs.mkdir()
    jobs = {"a": 15, "b": 15, "c": 15, "tail": 7}
    traces = {name: slow_job(steps=steps, seed=i) for i, (name, steps) in enumerate(jobs.items())}
    port = free_port()
    proc = _serve(tmp_path, port)
    child = None
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as c:
            eventually(lambda: c.get("/health").status_code == 200, 120, what="monitor up")
            for name, trace in traces.items():
                start_run(runs / name, trace)
            eventually(lambda: len(get(c, "/api/jobs")["jobs"]) == 4, 120, what="4 jobs")
            child = eventually(lambda: _analysis_child(proc.pid), 60, what="analysis child")
            child.send_signal(signal.SIGSTOP)   # (no window is analysed from here on)
            parts = 0
            for name, trace in traces.items():
                ps = parts_of(trace, 5)
                write_parts(runs / name, ps)
                parts += len(ps)
            eventually(lambda: get(c, "/api/stats")["by_way"].get("files", {}).get("parts")
                       == parts, 120, what="every part stored")
            eventually(lambda: get(c, "/api/jobs/tail")["state"] == "stalled", 60,
                       what="tail stalled")
            assert all(get(c, f"/api/jobs/{n}")["windows"] == [] for n in jobs)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(60)
            child.send_signal(signal.SIGCONT)   # (it ends by itself: its service is gone)
            eventually(lambda: not child.is_running() or child.status() == "zombie", 60,
                       what="the old analysis process gone")
            proc = _serve(tmp_path, port)
            eventually(lambda: c.get("/health").status_code == 200, 120, what="restarted")

            seen: list = []

            def analysed():
                got = {n: [(w["idx"], w["first_step"], w["last_step"], w["error"])
                           for w in get(c, f"/api/jobs/{n}")["windows"]] for n in jobs}
                seen[:] = [got]
                return got if all(len(got[n]) == (3 if n != "tail" else 2)
                                  for n in jobs) else None
            try:
                got = eventually(analysed, 90, what="every window analysed")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {seen}") from None
            for n in ("a", "b", "c"):
                assert got[n] == [(0, 0, 4, None), (1, 5, 9, None), (2, 10, 14, None)], got
            assert got["tail"] == [(0, 0, 4, None), (1, 5, 6, None)], got
            assert c.get("/health").status_code == 200
    finally:
        if child is not None and child.is_running():
            child.send_signal(signal.SIGCONT)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)



def test_a_restart_while_a_watched_folder_is_gone_serves_and_follows_it_once_back(tmp_path):
    """The watched folder removed (or a mount not up yet) while its runs are in the store: a
    running monitor goes on and follows it once it is back, but a restart refused to start
    ('not a directory'), its uploads and history down with it. Now the restart serves (the
    history of the run it followed there, /health) and follows the folder once it is back; a
    folder the store never followed anything in is still refused (a typo)."""
    runs = tmp_path / "runs"
    config = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=0.3,
                           read_interval_s=0)
    first, second = slow_job(steps=10), slow_job(steps=10, seed=3)
    start_run(runs / "a", first)
    write_parts(runs / "a", parts_of(first, 5))
    server = MonitorServer(tmp_path / "mon.db", watch=[runs], port=0, config=config).start()
    try:
        eventually(lambda: len(server.monitor.store.windows("a")) == 2, 60, what="a analysed")
    finally:
        server.stop()
    shutil.rmtree(runs)
    server = MonitorServer(tmp_path / "mon.db", watch=[runs], port=0, config=config).start()
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            assert len(get(c, "/api/jobs/a")["windows"]) == 2
            start_run(runs / "b", second)
            write_parts(runs / "b", parts_of(second, 5))
            eventually(lambda: len(server.monitor.store.windows("b")) == 2, 60,
                       what="the run in the folder back followed")
    finally:
        server.stop()
    with pytest.raises(InputError, match="typo: not a directory"):
        MonitorServer(tmp_path / "mon.db", watch=[tmp_path / "typo"], port=0, config=config)
