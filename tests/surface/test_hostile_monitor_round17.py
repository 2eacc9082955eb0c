"""Red team round 17: the monitor's analysis process when it cannot be started, dies, or its
service dies (real spawned processes, real resource limits, no mocks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import psutil
import pytest

from conftest import REPO, eventually
from stragglers.monitor.analyser import ProcessDied, WindowAnalyser
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import closed_windows, parts_of, slow_job  # noqa: E402

TOKEN = "hostile-round17-token-0123456789"

_SPAWN_FAILS = textwrap.dedent("""
    import os, resource, sys
    sys.path.insert(0, sys.argv[1])
    from monitor_jobs import closed_windows
    from stragglers.monitor.analyser import WindowAnalyser

    def main():
        first, second = closed_windows(2)
        analyser = WindowAnalyser()
        def open_fds():
            return len(os.listdir("/proc/self/fd")) - 1   # (less listdir's own)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        before = open_fds()
        # room for the two pipes (4 handles) and no more: the spawn itself runs out of handles
        resource.setrlimit(resource.RLIMIT_NOFILE, (before + 4, hard))
        analyser.warm()   # (was: OSError out of the job's tracker creation)
        row, refused = analyser.analyse(first)   # (was: OSError, the window dropped)
        assert open_fds() == before, (open_fds(), before)   # no pipe end left open
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        print("ROW1", row.idx, row.slowdown, row.error, flush=True)
        row2, _ = analyser.analyse(second)
        print("ROW2", row2.idx, row2.slowdown, row2.error, flush=True)
        analyser.close()


    if __name__ == "__main__":   # (the spawned process imports this file too)
        main()
""")


def test_a_window_whose_analysis_process_cannot_be_spawned_keeps_an_error_row(tmp_path):
    """Out of file handles (RLIMIT_NOFILE lowered in a real process): the window gets an error
    row (before: OSError raised out of analyse, the window never stored) and its pipes are
    closed; the next window is analysed in a new process."""
    script = tmp_path / "spawn_fails.py"
    script.write_text(_SPAWN_FAILS)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    out = subprocess.run([sys.executable, str(script), str(REPO / "tests" / "monitor")],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines())
    idx, slowdown, error = lines["ROW1"].split(" ", 2)
    assert (idx, slowdown) == ("0", "None"), lines
    assert "analysis failed: the analysis process could not be started" in error
    assert "Too many open files" in error and "the next window tries a new process" in error
    idx, slowdown, error = lines["ROW2"].split(" ", 2)
    assert idx == "1" and error == "None" and float(slowdown) > 1.3, lines


def _gone(pid: int) -> bool:
    """Whether `pid` ended (a zombie not yet reaped counts as ended)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _hold_once(flag: str) -> None:
    """In the analysis process: the first process here writes its id to `flag` and hangs
    (a window held mid-analysis); any later one goes on."""
    tmp = f"{flag}.{os.getpid()}"
    Path(tmp).write_text(str(os.getpid()))
    try:
        os.link(tmp, flag)   # (atomic: the flag is never seen half written)
    except FileExistsError:
        return
    time.sleep(600)


class _HoldOnce:
    def __init__(self, flag: str):
        self.flag = flag

    def __reduce__(self):
        return _hold_once, (self.flag,)


def _holding(window, flag: Path):
    meta = window.trace.meta
    window.trace = replace(window.trace, meta=replace(meta, extra={
        **meta.extra, "hold": _HoldOnce(str(flag))}))
    return window


def test_an_analysis_process_killed_mid_window_is_replaced(tmp_path):
    """kill -9 of the analysis process while it holds a window: the window is analysed in a
    new process (one restart, not a process per task)."""
    (first,) = closed_windows(1)
    flag = tmp_path / "held"
    _holding(first, flag)
    analyser = WindowAnalyser(timeout_s=120)
    try:
        out: list = []
        t = threading.Thread(target=lambda: out.append(analyser.analyse(first)[0]))
        t.start()
        eventually(flag.exists, timeout=60, what="the window held in the process")
        held = int(flag.read_text())
        os.kill(held, signal.SIGKILL)
        t.join(120)
        assert out and out[0].error is None and out[0].slowdown > 1.3, out
        assert analyser.restarts == 1 and analyser.stopped == 0
        assert _gone(held) and analyser.pids() != [held]
    finally:
        analyser.close()


def test_close_while_the_task_writer_waits_on_a_full_pipe(tmp_path):
    """The process busy on a task, the writer thread blocked sending 8 MiB into its full
    pipe: close() still ends (the process is killed, the writer gets EPIPE), every task
    fails with ProcessDied, and no thread of it is left."""
    def writers() -> int:
        return sum(t.name == "stragglers-analysis-tasks" and t.is_alive()
                   for t in threading.enumerate())

    before = writers()
    analyser = WindowAnalyser()
    process = analyser._executor()
    busy = process.submit(time.sleep, 600)
    big = process.submit(len, b"x" * (8 << 20))
    assert process.wait_started(busy, 60)
    closed = threading.Thread(target=analyser.close)
    closed.start()
    closed.join(60)
    assert not closed.is_alive()
    assert process.process.exitcode is not None
    for future in (busy, big):
        assert isinstance(future.exception(60), ProcessDied)
    eventually(lambda: writers() == before, timeout=60, what="the writer thread to end")


_SERVICE = textwrap.dedent("""
    import os, sys, time
    from stragglers.monitor.analyser import WindowAnalyser

    if __name__ == "__main__":   # (the spawned process imports this file too)
        analyser = WindowAnalyser()
        analyser.warm()
        pid = analyser.pids()[0]
        process = analyser._executor()
        # busy (as on a window): it reads no task, so only its check of its parent ends it
        assert process.wait_started(process.submit(time.sleep, 600), 60)
        print(pid, flush=True)
        sys.stdin.read()   # (until killed)
""")


def test_no_analysis_child_survives_a_kill_9_of_its_service(tmp_path):
    """The service (a process owning an analysis process busy on a task) killed with SIGKILL:
    every process it started (the analysis process, multiprocessing's resource tracker) ends."""
    script = tmp_path / "service.py"
    script.write_text(_SERVICE)
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    service = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True, env=env)
    try:
        child = int(service.stdout.readline())
        children = psutil.Process(service.pid).children(recursive=True)
        assert child in [c.pid for c in children]
    finally:
        service.kill()
        service.wait(60)
    eventually(lambda: all(_gone(c.pid) for c in children), timeout=60,
               what="the service's children to end")


def test_a_stop_with_a_window_in_flight_logs_no_traceback_and_the_window_is_redone(
        tmp_path, caplog):
    """A monitor (analysis process on) stopped (as on SIGTERM) while a window waits in the
    analysis process (a task ahead of it holds the process). The stop waited 10 s for the
    analysis thread before it closed the analyser, then the window's retry raised 'the window
    analyser is closed' out of the analysis step, logged with a traceback. Now the analyser
    is closed first, the window is left quietly (not stored), and a restart on the same store
    analyses it."""
    config = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05,
                           analysis_process=True)
    trace = slow_job(steps=10, slow=(1, 1, 3.0))
    meta = trace.meta.to_dict()
    meta["extra"]["clock"] = {"start": [1000.0] * meta["world_size"]}
    server = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=config).start()
    try:
        monitor = server.monitor
        process = monitor.analyser._executor()
        hold = process.submit(time.sleep, 600)   # (ahead of the window: it waits there)
        assert process.wait_started(hold, 60)
        with httpx.Client(base_url=server.url, timeout=60,
                          headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            assert c.put("/api/jobs/inflight/meta", json=meta).status_code == 200
            for rank, part, cols in parts_of(trace, 5):
                r = c.put(f"/api/jobs/inflight/ranks/{rank}/parts/{part}",
                          content=table_bytes(cols))
                assert r.status_code == 200, r.text
        eventually(lambda: monitor._analysing == "inflight", timeout=60,
                   what="the window handed to the analysis process")
    finally:
        server.stop()
    assert "monitor analysis step failed" not in caplog.text
    again = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN,
                          config=MonitorConfig(window_steps=5, stall_after_s=600,
                                               tick_s=0.05)).start()
    try:
        def analysed():
            return [w.idx for w in again.monitor.store.windows("inflight")
                    if w.error is None]
        eventually(lambda: 0 in analysed(), timeout=60, what="window 0 analysed after the restart")
    finally:
        again.stop()


def _die_once(flag: str) -> None:
    """In the analysis process: the first process here dies (as killed by the kernel's
    out-of-memory killer on a passing peak); any later one goes on."""
    try:
        os.close(os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    os._exit(137)


class _DieOnce:
    def __init__(self, flag: str):
        self.flag = flag

    def __reduce__(self):
        return _die_once, (self.flag,)


def test_a_process_that_died_between_windows_does_not_spend_the_next_windows_retry(tmp_path):
    """The analysis process killed while idle, then a window on which the new process dies
    once. The window's first try went to the dead process (a death it had no part in), its
    second to the new one, which died: the window was stored as 'died ... twice'. Now a
    process found dead before the window was handed to it costs the window no try: the window
    is analysed in the third process."""
    first, second = closed_windows(2)
    meta = second.trace.meta
    second.trace = replace(second.trace, meta=replace(meta, extra={
        **meta.extra, "die": _DieOnce(str(tmp_path / "died"))}))
    analyser = WindowAnalyser(timeout_s=120)
    try:
        assert analyser.analyse(first)[0].error is None
        process = analyser._executor()
        (pid,) = analyser.pids()
        os.kill(pid, signal.SIGKILL)
        eventually(lambda: process.dead, timeout=60, what="the death seen")
        row, _ = analyser.analyse(second)
        assert (tmp_path / "died").exists()
        assert row.error is None and row.idx == 1 and row.slowdown > 1.3, row.error
        assert analyser.restarts == 2
    finally:
        analyser.close()


def test_a_process_that_dies_as_it_starts_is_retried_a_bounded_number_of_times():
    """The analysis process's interpreter dies at once, every time (its executable is
    /bin/false: a broken install). The window gets an error row after at most 4 processes (no
    restart storm: read-ahead and warm-up start none while a dead one stands), and once the
    interpreter is sound again the next window is analysed."""
    import multiprocessing.resource_tracker as resource_tracker
    import multiprocessing.spawn as spawn

    first, second = closed_windows(2)
    resource_tracker.ensure_running()   # (started with the sound interpreter)
    analyser = WindowAnalyser(timeout_s=120)
    sound = spawn.get_executable()
    spawn.set_executable("/bin/false")
    try:
        row, _ = analyser.analyse(first)
        analyser.warm()   # (must not raise)
        assert row.slowdown is None and row.error.startswith(
            "analysis failed: the analysis process"), row.error
        assert analyser.restarts <= 4, analyser.restarts
        spawn.set_executable(sound)
        nxt, _ = analyser.analyse(second)
        assert nxt.error is None and nxt.idx == 1 and nxt.slowdown > 1.3, nxt.error
    finally:
        spawn.set_executable(sound)
        analyser.close()
