"""The monitor under a low RLIMIT_NOFILE: its soft limit is raised to the hard one at start (it
was raised only to max_connections + 128, so the service's files, databases and connections
ran out at the soft limit the hard one would have lifted), the connection caps are sized from
the limit it got, and a burst of connections larger than its descriptors leaves it serving.
Real `stragglers monitor serve` subprocesses on 127.0.0.1, raw sockets."""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import REPO, kill_tree, listening_url, up

pytestmark = pytest.mark.skipif(not Path("/proc/self/limits").exists(),
                                reason="Linux's /proc/PID/limits")


def serve(tmp_path: Path, soft: int, hard: int) -> tuple[subprocess.Popen, str]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                             str(tmp_path / "m.db"), "--port", "0"], cwd=str(REPO),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=limit,
                            start_new_session=True)
    url = listening_url(proc)
    assert up(proc, url), proc.communicate(timeout=60)
    return proc, url


def open_files_limit(pid: int) -> tuple[int, int]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            soft, hard = line.split()[3:5]
            return int(soft), int(hard)
    raise AssertionError("no open-files line")


def stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.communicate(timeout=60)[1].decode(errors="replace")
    finally:
        kill_tree(proc)


@pytest.mark.slow
def test_the_soft_open_files_limit_is_raised_to_the_hard_one(tmp_path):
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"this machine's hard limit is {hard}")
    proc, _ = serve(tmp_path, 256, 2048)
    try:
        assert open_files_limit(proc.pid) == (2048, 2048)
    finally:
        err = stop(proc)
    # the cap of 1,000 connections fits: nothing is lowered
    assert "may open" not in err, err[-2000:]


@pytest.mark.slow
def test_a_burst_past_the_descriptors_leaves_the_service_answering(tmp_path):
    proc, url = serve(tmp_path, 256, 256)
    port = int(url.rsplit(":", 1)[1])
    burst: list[socket.socket] = []
    try:
        os.kill(proc.pid, signal.SIGSTOP)   # the whole burst pending at once, as one accept pass
        try:
            for _ in range(1000):
                k = socket.socket()
                k.setblocking(False)
                try:
                    k.connect(("127.0.0.1", port))
                except BlockingIOError:
                    pass
                burst.append(k)
            for k in burst:
                try:
                    k.send(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                except OSError:
                    pass   # (not accepted by the kernel yet)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        # it answers while the burst is held open (idle ones evicted for room) ...
        assert httpx.get(f"{url}/health", timeout=60).status_code == 200
    finally:
        for k in burst:
            k.close()
    try:
        # ... and after
        for _ in range(3):
            assert httpx.get(f"{url}/health", timeout=60).status_code == 200
            time.sleep(0.1)
        assert proc.poll() is None
    finally:
        err = stop(proc)
    # the caps sized from the limit it has, said once; no error logged
    lines = [line for line in err.splitlines() if line.strip()]
    assert any("may open 256 files: serving at most 128 connections" in line
               for line in lines), err[-2000:]
    assert not [line for line in lines if "ERROR" in line or "Traceback" in line], err[-3000:]
