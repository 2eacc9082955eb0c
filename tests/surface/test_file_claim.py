"""One service per database file (stragglers.file_claim): a claim refused in the process that
serves the file must not drop the serving SQLite connections' locks. Closing the refused
claim's descriptor did (POSIX locks belong to the process): the next process to open and close
the file deleted the live write-ahead log, and what the service acknowledged afterwards was
gone at kill -9. Each case runs in a subprocess that is killed -9, then the file is read."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from stragglers.errors import InputError
from stragglers.file_claim import Held, claim_file

TESTS = Path(__file__).resolve().parents[1]


def _run_killed(script: str, *args: str) -> str:
    """Run `script` in a fresh interpreter that ends by SIGKILL; its stdout."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    return proc.stdout


# another process opens the file and closes it: a refused `serve`, or any reader
_OPEN_CLOSE = """
def open_close(db):
    import sqlite3, subprocess, sys
    subprocess.run([sys.executable, "-c",
                    "import sqlite3, sys; sqlite3.connect(sys.argv[1]).execute("
                    "'SELECT count(*) FROM sqlite_master').fetchall()", str(db)], check=True)
"""


def test_a_refused_claim_keeps_the_serving_connections_locks(tmp_path):
    db = tmp_path / "s.db"
    out = _run_killed(_OPEN_CLOSE + """
import os, signal, sqlite3, sys
from stragglers.file_claim import Held, claim_file
db = sys.argv[1]
c = sqlite3.connect(db, isolation_level=None)
c.execute("PRAGMA journal_mode=WAL"); c.execute("PRAGMA wal_autocheckpoint=0")
c.execute("CREATE TABLE t (x INTEGER)")
held = claim_file(db)
c.execute("INSERT INTO t VALUES (1)")
for _ in range(3):   # refused, in this very process, again and again
    try:
        claim_file(db); print("CLAIMED TWICE")
    except Held as exc:
        assert exc.pid == os.getpid()
open_close(db)
print("wal", os.path.exists(db + "-wal"))
c.execute("INSERT INTO t VALUES (2)")
sys.stdout.flush(); os.kill(os.getpid(), signal.SIGKILL)
""", str(db))
    assert "CLAIMED TWICE" not in out
    assert "wal True" in out, out
    rows = sqlite3.connect(db).execute("SELECT x FROM t ORDER BY x").fetchall()
    assert rows == [(1,), (2,)]


def test_a_hard_link_reaches_the_same_claim_and_a_released_one_is_taken_again(tmp_path):
    db = tmp_path / "s.db"
    sqlite3.connect(db).execute("CREATE TABLE t (x INTEGER)").connection.close()
    (tmp_path / "sub").mkdir()
    link = tmp_path / "sub" / "link.db"
    link.hardlink_to(db)
    held = claim_file(db)
    assert held is not None
    with pytest.raises(Held):
        claim_file(link)
    held.close()
    again = claim_file(link)   # the refused descriptor, kept, takes it now
    assert again is not None
    again.close()


def test_the_shard_service_refused_in_its_own_process_keeps_what_it_acknowledges(tmp_path):
    db = tmp_path / "s.db"
    out = _run_killed(_OPEN_CLOSE + """
import os, signal, sys
from stragglers.adapt.client import ShardClient
from stragglers.adapt.dataset import DatasetConfig
from stragglers.adapt.service import EmbeddedServer
from stragglers.errors import InputError
db = sys.argv[1]
a = EmbeddedServer(db).start()
c = ShardClient(a.url, "d", "w", token="owner-token-0123456789")
c.create_dataset(DatasetConfig("d", 1000, 10)); c.join()
def ack(n):
    done = []
    for _ in range(n):
        x = c.lease().leases[0]; c.ack(x.epoch, x.shard, x.size); done.append(x.shard)
    return done
acked = ack(2)
try:
    EmbeddedServer(db).start(); print("SECOND STARTED")
except InputError:
    pass
open_close(db)
acked += ack(3)
print("acked", " ".join(map(str, sorted(acked))))
sys.stdout.flush(); os.kill(os.getpid(), signal.SIGKILL)
""", str(db))
    assert "SECOND STARTED" not in out
    acked = [int(x) for x in out.split("acked", 1)[1].split()]
    done = sorted(r[0] for r in sqlite3.connect(db).execute(
        "SELECT shard FROM shards WHERE state='DONE'"))
    assert done == acked and len(acked) == 5


def test_the_monitor_refused_in_its_own_process_keeps_what_it_acknowledges(tmp_path):
    db = tmp_path / "mon.db"
    out = _run_killed(_OPEN_CLOSE + """
import os, signal, sys
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/monitor"]
import httpx
from monitor_jobs import parts_of, slow_job
from stragglers.errors import InputError
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes
token = "claim-test-token-0123456789"; auth = {"Authorization": f"Bearer {token}"}
cfg = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05, rescan_s=3600)
db = sys.argv[1]
trace = slow_job(steps=20); parts = parts_of(trace, 5)
a = MonitorServer(db, port=0, token=token, config=cfg).start()
c = httpx.Client(base_url=a.url, timeout=60)
assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(), headers=auth).status_code == 200
acked = 0
def put(ps):
    global acked
    for rank, n, cols in ps:
        r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols), headers=auth)
        assert r.status_code == 200, r.text
        acked += 1
put(parts[:2])
try:
    MonitorServer(db, port=0, token=token, config=cfg).start(); print("SECOND STARTED")
except InputError:
    pass
open_close(db)
put(parts[2:6])
print("acked", acked)
sys.stdout.flush(); os.kill(os.getpid(), signal.SIGKILL)
""", str(db), str(TESTS))
    assert "SECOND STARTED" not in out
    acked = int(out.split("acked", 1)[1].split()[0])
    stored = sqlite3.connect(db).execute("SELECT count(*) FROM parts").fetchone()[0]
    assert acked == 6 and stored == acked


def test_a_refusal_names_the_file_in_one_line(tmp_path):
    from stragglers.adapt.claim import claim
    db = tmp_path / "s.db"
    db.write_bytes(b"")
    held = claim(db)
    with pytest.raises(InputError, match="another shard service serves this file"):
        claim(db)
    held.close()
