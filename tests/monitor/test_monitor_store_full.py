"""A store that cannot grow (a full disk; a file-size limit stands in for one, with no
privileges needed): writes answer 507 in the API's JSON shape, not 503, and a restart says the
store cannot be written and how to recover, not that it is "not a usable SQLite database"."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from conftest import eventually
from monitor_jobs import slow_job

TOKEN = "store-full-test-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

LIMITED = """
import resource, signal, sys
from pathlib import Path
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])   # taken by sigwait below
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails (EFBIG), no kill
limit = int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
if sys.argv[3] == "open":   # a restart: only the store's opening
    from stragglers.errors import InputError
    from stragglers.monitor.store import open_store
    try:
        open_store(sys.argv[1])
        print("opened")
    except InputError as exc:
        print(exc)
    sys.exit(0)
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)
s = MonitorServer(Path(sys.argv[1]), port=0, token=sys.argv[4], config=cfg).start()
print(s.port, flush=True)
signal.sigwait([signal.SIGTERM])
s.stop()
"""


def limited(db, limit: int, what: str = "serve") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", LIMITED, str(db), str(limit), what, TOKEN],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_a_store_that_cannot_grow_answers_507_and_a_restart_says_why(tmp_path):
    db = tmp_path / "mon.db"
    trace = slow_job(steps=5)
    meta = trace.meta.to_dict()
    limit = 1 << 20   # the WAL reaches it after ~40 metadata writes of 24 KiB
    proc = limited(db, limit)
    answers = []
    try:
        line = proc.stdout.readline()
        assert line.strip().isdigit(), proc.stderr.read()[-3000:]
        with httpx.Client(base_url=f"http://127.0.0.1:{int(line)}", timeout=60) as c:
            eventually(lambda: c.get("/health").status_code == 200, what="monitor up")
            for i in range(200):
                meta["extra"]["note"] = f"{i}" + "x" * 24_000   # each write grows the WAL
                r = c.put("/api/jobs/full/meta", json=meta, headers=AUTH)
                answers.append(r.status_code)
                if r.status_code != 200:
                    break
            # the store's write refused for room: 507 (was 503, "cannot reach its storage")
            assert r.status_code == 507, (answers, r.text)
            assert r.headers["content-type"] == "application/json"
            assert "disk" in r.json()["error"] and "Traceback" not in r.text
            assert c.get("/health").status_code == 200
    finally:
        proc.send_signal(signal.SIGKILL)   # as a crash leaves it: the WAL stays
        proc.communicate(timeout=60)
    assert set(answers[:-1]) == {200}
    assert os.path.getsize(str(db) + "-wal") > 0
    # a restart under a limit its store's files are past: what is wrong and what to do
    out, err = limited(db, 16 << 10, "open").communicate(timeout=120)
    assert "not a usable SQLite database" not in out, out
    assert "cannot be written" in out and "file-size limit" in out, (out, err[-2000:])
    assert "nothing is lost" in out
    # and with room again it opens, every write acknowledged before still there
    out, err = limited(db, 1 << 40, "open").communicate(timeout=120)
    assert out.strip() == "opened", (out, err[-2000:])
