"""Shared test fixtures: paths to ../shared/data, a real torchrun launcher, polling."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
NDTIMELINE = SHARED_DATA / "ndtimeline-samples"
KINETO = SHARED_DATA / "kineto-samples"


def pytest_configure(config) -> None:
    """The `slow` marker (`distributed` and `browser` are in pyproject.toml): registered here so
    a change to it does not touch pyproject.toml, which the Makefile's venv stamp depends on."""
    config.addinivalue_line(
        "markers", "slow: half a second or more on the 2-core development machine (services, "
        "subprocesses, exhaustive searches); left out of `make test-fast`")


# The files that hold a worker longest (torchrun jobs, services waited on), longest first
# (seconds of one worker, setup to teardown: in CI, or "loaded": a per-directory run on the
# 2-core machine beside other work, ~2.5-3x CI; session 47). `--dist loadfile` gives each file to one worker; xdist's default
# hands the files out by their number of tests, most first, and the long files here hold few
# (the README walk, ~160 s, 3 tests: file 190 of 276; test_kineto_train_gpt.py, 1 test: file
# 271), so they began near the end and ran on while the other worker idled. make test turns
# that order off (--no-loadscope-reorder): the collection's order, these files first, the short
# ones filling in behind. A file not listed keeps its place; an entry whose file is gone
# moves nothing.
LONG_FIRST = (
    "record/test_record_modelparallel.py",         # 525 s loaded with 17 jobs; 13 since s48
    "surface/test_readme_walk.py",                 # ~160 s in CI, 424 s loaded
    "surface/test_hostile_services_round7.py",     # 453 s loaded
    "record/test_record_diagnosis.py",             # 216 s loaded (5 torchrun jobs)
    "surface/test_public_api.py",                  # 342 s loaded
    "surface/test_hostile_services_round6.py",     # 331 s loaded
    "adapt/test_adapt_service.py",                 # 266 s loaded
    "record/test_record_distributed.py",           # 5 torchrun jobs
    "adapt/test_adapt_distributed.py",             # 193 s loaded
    "whatif/test_modelparallel_diagnosis.py",      # 4 torchrun jobs
    "surface/test_hostile_services_round5.py",     # 202 s loaded
    "monitor/test_monitor_http.py",                # 181 s loaded
    "advice/test_act_distributed.py",              # 3 torchrun jobs
    "adapt/test_adapt_hardening.py",               # 143 s loaded
    "surface/test_examples_outside_torchrun.py",   # 136 s loaded
    "collectives/test_stragglar_schedule.py",      # ~45 s of CPU in CI
    "monitor/test_stuck_watched_file.py",
    "trace/test_kineto_train_gpt.py",              # 1 torchrun job, ~35 s in CI
)


def pytest_collection_modifyitems(config, items) -> None:
    """Under xdist (a worker's collection), LONG_FIRST's files first, in its order; the rest,
    and every file's own tests, keep their order (a stable sort, whole files moved)."""
    if not hasattr(config, "workerinput"):
        return
    tests = Path(__file__).resolve().parent
    rank = {name: i for i, name in enumerate(LONG_FIRST)}

    def first(item) -> int:
        try:
            return rank.get(item.path.relative_to(tests).as_posix(), len(rank))
        except ValueError:   # (a test outside tests/)
            return len(rank)

    items.sort(key=first)


def readable(socks: list[socket.socket], timeout: float) -> list[socket.socket]:
    """The sockets with bytes to read within `timeout` (a bound against a hang, not a pace)."""
    # epoll, not select.select: a long pytest worker holds descriptors past FD_SETSIZE (1,024),
    # and select.select refuses them (three tests failed so in CI)
    if not socks:
        return []
    with selectors.DefaultSelector() as sel:
        for k in socks:
            sel.register(k, selectors.EVENT_READ)
        return [key.fileobj for key, _ in sel.select(timeout)]


def raw_request(port: int, method: str, target: str, extra: str = "",
                source: str = "127.0.0.1") -> socket.socket:
    """A connection to a loopback service with one request head sent (no body), from
    `source`; a Host header added unless `extra` starts with its own."""
    k = socket.create_connection(("127.0.0.1", port), timeout=60, source_address=(source, 0))
    host = "" if extra.startswith("Host:") else "Host: 127.0.0.1\r\n"
    k.sendall(f"{method} {target} HTTP/1.1\r\n{host}{extra}\r\n".encode())
    return k


def free_port() -> int:
    """A free TCP port on loopback for a rendezvous endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str | Path, nproc: int, *args: str, timeout: float = 300,
             env: dict | None = None, check: bool = True,
             one_cpu: bool = False, monitor_interval: float | None = None
             ) -> subprocess.CompletedProcess:
    """Launch `script` under real torchrun (standalone rendezvous on loopback) and wait.

    one_cpu: every rank on the same CPU. On a shared machine the OS can give one rank less
    CPU than another for a whole run (another process sits on its core): a real straggler
    that the analysis rightly names. A test that needs a job without stragglers (a clean
    run) makes that impossible by construction: ranks on one CPU share its slowdowns.
    monitor_interval: how often torchrun's agent looks at its workers (s); once one has
    failed it stops the others, so a test of what every rank prints as it fails gives them
    time to print first.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={nproc}", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
           *(["--monitor-interval", str(monitor_interval)] if monitor_interval else []),
           str(script), *args]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
                "PYTHONUNBUFFERED": "1", **(env or {})}
    cpus = {min(os.sched_getaffinity(0))} if one_cpu else None
    proc = run_tree(cmd, timeout=timeout, env=full_env, cwd=str(REPO), cpus=cpus)
    if check and proc.returncode != 0:
        raise AssertionError(f"torchrun {script} failed ({proc.returncode}):\n"
                             f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc


def run_tree(cmd: list[str], *, timeout: float, env: dict | None = None,
             cwd: str | None = None, cpus: set[int] | None = None) -> subprocess.CompletedProcess:
    """subprocess.run in its own session; on timeout the whole process tree is killed.

    torchrun's workers are its children: killing torchrun alone would leave them running
    (and loading the machine) after a test timed out. cpus: the CPUs the tree may run on.
    """
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=cwd, start_new_session=True, preexec_fn=pin)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, cmd[:6]))} ... timed out after {timeout:.0f} s:"
                             f"\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-4000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a process started with start_new_session=True and everything in its session."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="session")
def ndtimeline_dir() -> Path:
    """The NDTimeline sample traces (skips only if ../shared is absent)."""
    if not NDTIMELINE.exists():
        pytest.skip(f"{NDTIMELINE} not present")
    return NDTIMELINE


def persistent_findings(result, steps: int) -> list[tuple[str, list]]:
    """(cause, ranks) of the findings that name workers on at least half of the steps.

    What a clean run must not have: a finding limited to a few steps (a transfer the loaded
    machine stalled in steps 2 and 7, say) is a true statement about those steps, and
    `unexplained` names nobody.
    """
    out = []
    for f in result.diagnosis:
        if f.where.ranks and len(f.where.steps or range(steps)) * 2 > steps:
            out.append((f.cause, list(f.where.ranks)))
    return out


def eventually(fn, timeout: float = 120.0, interval: float = 0.1, what: str = "condition"):
    """Poll fn() until it returns a truthy value (generous deadline: the machine is loaded)."""
    import httpx

    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = fn()
        except (AssertionError, OSError, httpx.HTTPError) as exc:  # not up yet
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"{what} not reached in {timeout} s (last: {last!r})")


def head_only(port: int, method: str, path: str, auth: str | None, length: int = 1 << 20,
              headers: str = "") -> bytes:
    """What a server on loopback sends to a request head announcing `length` bytes of body
    behind `Expect: 100-continue`, none of which is sent, until it closes the connection (a
    server waiting for the body never closes it: the socket's timeout fails the test). It
    must never say 100 Continue: the head alone decides. `headers`: more header lines."""
    head = (f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}"
            f"Content-Length: {length}\r\nExpect: 100-continue\r\n")
    if auth is not None:
        head += f"Authorization: {auth}\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=60) as k:
        k.sendall(head.encode() + b"\r\n")
        got = b""
        while chunk := k.recv(65536):
            got += chunk
            assert not got.startswith(b"HTTP/1.1 100"), f"{method} {path}: 100 Continue to {auth!r}"
    return got


def continued_write(port: int, method: str, path: str, token: str, body: bytes) -> bytes:
    """A JSON write behind `Expect: 100-continue` that must be told 100 Continue before its body
    is sent; the answer to the body (from its status line on)."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as k:
        k.sendall((f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                   f"application/json\r\nContent-Length: {len(body)}\r\nExpect: 100-continue"
                   f"\r\nAuthorization: Bearer {token}\r\n\r\n").encode())
        got = b""
        while b"\r\n\r\n" not in got:
            got += k.recv(65536)
        assert got.startswith(b"HTTP/1.1 100 Continue\r\n"), got
        k.sendall(body)
        got = got.partition(b"\r\n\r\n")[2]
        while b"}" not in got:
            got += k.recv(65536)
    return got


def chunk_extension_flood(host: str, port: int, head: bytes, chunks: int = 250) -> bytes:
    """Send `head` (a chunked request's) then `chunks` one-byte chunks each under 4 KB of
    chunk extensions (1 MB in all), and return the answer up to its JSON body's end."""
    with socket.create_connection((host, port), timeout=60) as k:
        k.sendall(head)
        try:   # (answered 413 before the end: the rest may be refused)
            for _ in range(chunks):
                k.sendall(b"1;" + b"e=" + b"x" * 4000 + b"\r\na\r\n")
            k.sendall(b"0\r\n\r\n")
        except OSError:
            pass
        got = b""
        while b"}" not in got and (chunk := k.recv(65536)):
            got += chunk
    return got


def request_line_status(port: int, version: str) -> tuple[int, bytes]:
    """(status, whole reply) of `GET /health HTTP/<version>` (with a Host) on loopback."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as k:
        k.sendall(f"GET /health HTTP/{version}\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
                  .encode())
        got = b""
        while chunk := k.recv(65536):
            got += chunk
    return int(got.split(b" ", 2)[1]), got


def listening_url(proc: subprocess.Popen) -> str:
    """The URL of a service's first stdout line ("... on http://127.0.0.1:PORT ..."), "" when
    it exited first."""
    import re

    assert proc.stdout is not None
    line = proc.stdout.readline().decode(errors="replace")     # "" once it exited
    found = re.search(r"http://127\.0\.0\.1:\d+", line)
    return found.group(0) if found else ""


def up(proc: subprocess.Popen, url: str) -> bool:
    """The service answers /health (False at once when it has exited: no waiting it out)."""
    import httpx

    for _ in range(100):                  # a refused connect while it is still starting
        if not url or proc.poll() is not None:
            return False
        try:
            return httpx.get(f"{url}/health", timeout=10).status_code == 200
        except httpx.TransportError:
            time.sleep(0.1)
    return False


def mounted_tmpfs(path: Path, size: str):
    """A real file system of `size` (tmpfs) at `path`, unmounted after — a full disk as it is,
    not a file-size limit: after a write refused at a limit SQLite's WAL is folded and small
    writes fit again, on a full disk none does. Needs the right to mount (root in a
    container); skipped without."""
    path.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """4 MiB of real disk (mounted_tmpfs)."""
    yield from mounted_tmpfs(tmp_path / "disk", "4m")


@pytest.fixture
def upload_disk(tmp_path):
    """80 MiB of real disk: the monitor keeps 64 MiB + its upload budget free for the store."""
    yield from mounted_tmpfs(tmp_path / "disk", "80m")


def fill(disk: Path) -> None:
    """Write a file (disk/filler) until the file system has no byte left."""
    fd = os.open(disk / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (65536, 1):
            try:
                while True:
                    os.write(fd, b"\0" * size)
            except OSError:
                pass
    finally:
        os.close(fd)
