"""Red team round six (issue 34) on the shard service: `stragglers adapt serve` as an operator
starts it, in a subprocess (a start that dies must not take pytest along).

Each test is one defect class, marked xfail(strict=True) until its fix lands (then the mark goes).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

TOKEN = "hostile-round6-token-0123456789"


def start(tmp: Path, db: str) -> tuple[int | None, str]:
    """(exit status, or None while it still serves; what it said) of `adapt serve --db DB`."""
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.cli", "adapt", "serve", "--db", db,
                             "--port", "0", "--token-file", str(token)], cwd=tmp,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        # a liveness bound: a refusal ends at once; a service that took the file keeps serving
        out, _ = proc.communicate(timeout=20)
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        return None, out.decode(errors="replace")


@pytest.mark.slow
def test_a_db_that_is_not_a_file_is_refused_in_one_line(tmp_path):
    """`--db :memory:` holds nothing across connections (and nothing durable): one line naming
    --db, exit 2, before it says it serves."""
    status, said = start(tmp_path, ":memory:")
    lines = [line for line in said.splitlines() if line.strip()]
    assert status == 2, (status, said[-1500:])
    assert len(lines) == 1 and ":memory:" in lines[0] and "internal error" not in said, said


class _Trickle(threading.Thread):
    """An HTTP 'service' on loopback answering every GET with a 200 head, then a byte of body
    a second, for ever (a stuck proxy, or a hostile service); or, given `answer`, with it."""

    def __init__(self, answer: bytes | None = None):
        super().__init__(daemon=True)
        self.answer = answer
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.done = threading.Event()

    def run(self):
        self.sock.settimeout(0.5)
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn):
        with conn:
            conn.recv(65536)
            if self.answer is not None:
                conn.sendall(self.answer)
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100000\r\n\r\n")
            while not self.done.is_set():
                try:
                    conn.sendall(b" ")
                except OSError:
                    return
                self.done.wait(1.0)


@pytest.mark.slow
def test_status_gives_up_on_a_reply_trickled_for_ever(tmp_path):
    """`stragglers adapt status D --url U` against a service whose reply never ends: gives up
    with one line and a non-zero exit (its retry budget is 2 s, each read 10 s; the bound here is 90 s)."""
    server = _Trickle()
    server.start()
    try:
        done = subprocess.run([sys.executable, "-m", "stragglers.cli", "adapt", "status", "d",
                               "--url", f"http://127.0.0.1:{server.port}"],
                              capture_output=True, timeout=90)
        status = done.returncode
    except subprocess.TimeoutExpired:
        status = None
    finally:
        server.done.set()
    assert status not in (None, 0), status


ESCAPES = b'{"error": "\x1b[2J\x1b]0;pwned\x07\x1b[31mall shards lost", "kind": "Internal"}'


def test_status_prints_no_terminal_escapes_a_service_sent(tmp_path):
    """`stragglers adapt status` shows a 5xx body it cannot parse: its control characters are
    escaped, never written raw."""
    server = _Trickle(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\n"
                      + f"Content-Length: {len(ESCAPES)}\r\nConnection: close\r\n\r\n".encode()
                      + ESCAPES)
    server.start()
    try:
        done = subprocess.run([sys.executable, "-m", "stragglers.cli", "adapt", "status", "d",
                               "--url", f"http://127.0.0.1:{server.port}"],
                              capture_output=True, timeout=120)
    finally:
        server.done.set()
    said = done.stdout + done.stderr
    assert done.returncode != 0 and b"pwned" in said, said    # the error is shown ...
    assert b"\x1b" not in said and b"\x07" not in said, said  # ... without its escapes


def serve(tmp: Path, db: str = "s.db") -> tuple[subprocess.Popen, str]:
    """`stragglers adapt serve --db tmp/<db>` (the process and its URL, "" when it exited)."""
    import re

    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.cli", "adapt", "serve", "--db",
                             str(tmp / db), "--port", "0", "--token-file", str(token)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    assert proc.stdout is not None
    found = re.search(r"http://127\.0\.0\.1:\d+", proc.stdout.readline().decode())
    return proc, found.group(0) if found else ""


@pytest.mark.slow
@pytest.mark.parametrize("second_db", ["s.db", "link.db"], ids=["same-path", "via-a-symlink"])
def test_a_second_service_on_the_same_store_is_refused_or_reads_what_is_stored(tmp_path,
                                                                             second_db):
    """Two `adapt serve` on one SQLite file (a restart that overlapped, a second unit by
    mistake; or the same file by a symlink, which a lock named after the path as typed
    missed): the second is refused with one line, or both answer what the file holds."""
    import httpx

    (tmp_path / "link.db").symlink_to(tmp_path / "s.db")
    first, url1 = serve(tmp_path)
    second, url2 = serve(tmp_path, second_db)
    try:
        if not url2:                                  # refused: what the fix may choose
            second.wait(timeout=60)
            assert second.returncode == 2
            return
        auth = {"Authorization": f"Bearer {TOKEN}", "X-Service-Token": TOKEN}
        a = httpx.Client(base_url=url1, headers=auth, timeout=60)
        b = httpx.Client(base_url=url2, headers=auth, timeout=60)
        assert a.post("/datasets", json={"name": "d", "num_samples": 100, "shard_size": 10,
                                         "seed": 0, "num_epochs": 2, "lease_s": 30,
                                         "max_retries": 1}).status_code == 200
        fence = a.post("/datasets/d/join", json={"worker": "w"}).json()["fence"]
        start = a.get("/datasets/d/snapshot").content
        for lease in a.post("/datasets/d/lease", json={"worker": "w", "fence": fence,
                                                       "count": 4}).json()["leases"]:
            assert a.post("/datasets/d/ack", json={"worker": "w", "fence": fence,
                                                   "epoch": lease["epoch"], "shard": lease["shard"],
                                                   "consumed": lease["size"]}).status_code == 200
        assert a.get("/datasets/d/status").json()["epochs"]["0"]["DONE"] == 4
        assert b.post("/datasets/d/restore", content=start,
                      headers={"Content-Type": "application/json"}).status_code == 200
        assert b.get("/datasets/d/status").json()["epochs"]["0"]["DONE"] == 0
        assert a.get("/datasets/d/status").json()["epochs"]["0"]["DONE"] == 0
        assert a.get("/datasets/d/snapshot").json() == b.get("/datasets/d/snapshot").json()
    finally:
        for proc in (first, second):
            proc.terminate()
            proc.communicate(timeout=60)
