"""What a tick decides while the store's disk is full stays pending until its write commits,
and is written once space returns (issue 34): a window closed by a stall (its rows already
taken out of the tracker), the job's state and its alert, a finished job's state, a silent
rank's alert. Before, the tick's first refused write raised, and what it had taken out was
lost: the window was never analysed, the state never stored.

A monitor not started (no thread runs: the driver calls what the threads call, at given
times) in a subprocess, on a real SQLite store. The disk is made full two ways: the process's
file-size limit at one byte (no privilege needed: every write of a store file is refused,
deterministically), and a real 4 MiB tmpfs filled to its last byte (where mount is allowed).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

DRIVER = r"""
import json, logging, os, resource, signal, sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from monitor_jobs import slow_job
from stragglers.monitor.service import Monitor, PartIn
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store import open_store
from stragglers.trace.runformat import rank_file_name, write_rank

db, how, scenario = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
logging.basicConfig(level=logging.WARNING)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)   # a write past the limit fails (EFBIG), no kill
limits = resource.getrlimit(resource.RLIMIT_FSIZE)
STALL = 10.0
work = db.parent.parent if how == "tmpfs" else db.parent


def full():
    if how == "fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, (1, limits[1]))
        return
    fd = os.open(db.parent / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    for size in (65536, 1):
        try:
            while True:
                os.write(fd, b"\0" * size)
        except OSError:
            pass
    os.close(fd)


def room():
    if how == "fsize":
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    else:
        (db.parent / "filler").unlink()


store = open_store(str(db))
fast = scenario == "fast"   # the change detector's alert: a rank 1.5x slower from step 30
mon = Monitor(store, MonitorConfig(window_steps=5, stall_after_s=STALL, finish_after_s=4 * STALL,
                                   tick_s=1.0, change_detector=fast, change_warmup_steps=10,
                                   change_baseline_steps=30, empty_job_expiry_s=0.05),
              data_dir=work / "up")
if fast:
    import numpy as np
    from stragglers.trace.model import Trace
    clean = slow_job(steps=50, dp=4, pp=2, slow=None, seed=5)
    slowed = slow_job(steps=50, dp=4, pp=2, slow=(2, 1, 1.5), seed=5)
    before, after = clean.ops["step"] < 30, slowed.ops["step"] >= 30
    trace = Trace({k: np.concatenate([clean.ops[k][before], slowed.ops[k][after]])
                   for k in clean.ops}, clean.meta)
else:
    trace = slow_job(steps=8, dp=2, pp=2, slow=(1, 1, 3.0))
world, steps = trace.meta.world_size, int(trace.ops["step"].max()) + 1
run = work / "runs" / "j"
if scenario != "restarted":
    for rank in range(world):
        for step in range(steps):
            sel = (trace.ops["rank"] == rank) & (trace.ops["step"] == step)
            write_rank(run, rank, {k: v[sel] for k, v in trace.ops.items()}, part=step)
mon.leases.beat()   # (a restart's first heartbeat rebuilds its jobs from the store)
if scenario != "restarted":
    mon.register_job("j", run, "files", trace.meta.to_dict())


def feed(step, ranks, queued_ago=0.0):
    at = time.monotonic() - queued_ago
    mon._ingest_batch([PartIn("j", r, step, "files", path=run / rank_file_name(r, step),
                              queued_at=at) for r in ranks])


def drain():
    out = []
    while not mon._analysis.empty():
        out.append(mon._analysis.get_nowait())
        mon._count(-1)
    return out


def analyse(items):
    # as the analysis thread does (_analysis_loop): windows, then the states queued after them
    for item in items:
        try:
            if isinstance(item, tuple):
                mon._state_changed(*item, current=True)
            else:
                mon._analyse(item)
        except Exception as exc:
            logging.getLogger("driver").error("analysis step failed: %r", exc)


def tick(now):
    try:
        mon.tick(now)
        return None
    except Exception as exc:
        return repr(exc)


out = {}
if scenario == "restarted":   # after a kill -9 on the full disk, started again with room
    out["raised"] = tick(time.time() + STALL + 1)   # (its parts' arrivals: as stored)
    analyse(drain())
    tick(time.time() + STALL + 2)
    out["windows"] = [[w.first_step, w.last_step] for w in store.windows("j")]
    out["stored_state"] = store.job("j").state
    print(json.dumps(out), flush=True)
    sys.exit(0)
if fast:
    for step in range(steps):
        feed(step, range(world))
    drain()   # (its windows: not this scenario's)
    full()
    try:   # the detector's thread: what it decides it stores
        mon.watchdog.detect()
        out["raised"] = None
    except Exception as exc:
        out["raised"] = repr(exc)
    room()
    for k in range(2):   # its next passes (each tick_s), no new part
        mon.watchdog.detect()
    out["firing"] = sorted(a.rule for a in store.alerts(job="j", status="firing"))
    out["log_rules"] = sorted(e.rule for e in store.alert_log_page(None, 1000)[0])
    print(json.dumps(out), flush=True)
    sys.exit(0)
if scenario == "silence":   # rank 3 stops after step 4, the others go on to step 7
    for step in range(5):   # (the others' gaps below STALL: no resume, rank 3 quiet 1.5 STALL)
        feed(step, range(4), queued_ago=1.5 * STALL)
    for step, ago in zip(range(5, 8), (0.6 * STALL, 0.3 * STALL, 0.0)):
        feed(step, range(3), queued_ago=ago)
else:
    for step in range(5 if scenario == "ingest" else steps):
        feed(step, range(world))
analyse(drain())   # window 0 (steps 0..4) stored; steps 5..7 held
out["before"] = len(store.windows("j"))
last = mon.trackers["j"].last_arrival
class Polls:   # a thread's sleep between its rounds: none; it stops after its n-th round
    def __init__(self, n, stop, before=lambda: None):
        self.n, self.stop, self.before = n, stop, before

    def wait(self, timeout):
        self.n -= 1
        if self.n < 0:
            self.stop.set()
        self.before()

    def clear(self):
        pass


if scenario == "ingest":   # watched parts of steps 5..7 come while the disk is full
    def batches():   # the ingest thread, one batch a step
        for step in range(5, 8):
            for r in range(world):
                mon.submit(PartIn("j", r, step, "files", path=run / rank_file_name(r, step)))
            mon._ingest.put(None)   # (ends the batch; the loop, once the queue is empty)
        mon._ingest_loop()
        while not mon._ingest.empty():   # (the ends it put back)
            mon._ingest.get_nowait()

    full()
    batches()
    room()
    batches()   # (the rescans queue them again)
    out["parts"] = store._rows("SELECT COUNT(*) AS n FROM parts WHERE job = 'j'")[0]["n"]
    print(json.dumps(out), flush=True)
    sys.exit(0)
if scenario == "sweep":   # an uploaded job with no part expires while the disk is full
    (work / "up" / "e").mkdir(parents=True)
    mon.register_job("e", work / "up" / "e", "http", trace.meta.to_dict())
    time.sleep(0.1)   # (past its empty_job_expiry_s)

    def sweeps(n):   # n rounds of the tick thread, each sweeping empty jobs
        mon._stop.clear()
        mon._tick_wake = Polls(n, mon._stop, lambda: setattr(mon, "_swept_at", -1e12))
        mon._tick_loop()

    full()
    sweeps(5)
    room()
    sweeps(1)
    out["jobs"] = sorted(store.job_names())
    print(json.dumps(out), flush=True)
    sys.exit(0)
if scenario == "outbox":   # window 0's alert messages are due; the sender polls a full disk
    def polls(n):
        mon.outbox._stop.clear()
        mon.outbox._wake = Polls(n, mon.outbox._stop)
        mon.outbox._run()

    full()
    polls(5)
    room()
    polls(1)
    out["undelivered"] = store._rows("SELECT COUNT(*) AS n FROM alert_outbox WHERE "
                                     "delivered_at IS NULL")[0]["n"]
    print(json.dumps(out), flush=True)
    sys.exit(0)
full()
if scenario in ("stall", "killed"):
    at = last + STALL
elif scenario == "finished":
    at = last + 4 * STALL
else:
    at = time.time()
out["raised"] = tick(at)
out["state_while_full"] = mon.states.get("j")
if scenario == "killed":   # kill -9 with the stall and its window not stored
    os.kill(os.getpid(), signal.SIGKILL)
queued = drain()
out["queued"] = [list(i.steps) if hasattr(i, "steps") else list(i) for i in queued]
# the analysis thread's writes while the disk is full: a state's (refused), a window's (it
# waits for room: analysed, then its write tried again until it commits)
analyse([i for i in queued if isinstance(i, tuple)])
import threading
refused = mon.metrics.store_errors.labels("window")
windows = threading.Thread(target=analyse, args=([i for i in queued if not isinstance(i, tuple)],))
windows.start()
while windows.is_alive() and refused._value.get() == 0:
    time.sleep(0.01)   # (until its first write was refused)
out["window_refused"] = refused._value.get()
room()
windows.join(120)
for k in range(3):   # later ticks (a tick a second), what they queue analysed
    out.setdefault("raised_after", tick(at + 1 + k))
    analyse(drain())
out["windows"] = [[w.first_step, w.last_step] for w in store.windows("j")]
out["stored_state"] = store.job("j").state
out["firing"] = sorted(a.rule for a in store.alerts(job="j", status="firing"))
out["log_rules"] = sorted(e.rule for e in store.alert_log_page(None, 1000)[0] if e.job == "j")
print(json.dumps(out), flush=True)
mon.stop()
store.close()
"""


def drive(db: Path, how: str, scenario: str, rc: int = 0) -> tuple[dict, str]:
    """Run the driver; (what it found, its log)."""
    done = subprocess.run([sys.executable, "-c", DRIVER, str(db), how, scenario,
                           str(REPO / "tests" / "monitor")], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert done.returncode == rc, done.stderr[-3000:]
    if rc:
        return {}, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def check_stall(found: dict, log: str) -> None:
    assert found["before"] == 1
    # once space returned: window 1 (steps 5..7, closed by the stall) stored, analysed; the
    # stall and its alert too
    assert found["windows"] == [[0, 4], [5, 7]], found
    assert found["stored_state"] == "stalled" and "stalled" in found["firing"], found
    # the stall's partial window was queued though its state's write was refused
    assert found["queued"] == [[5, 6, 7]], found
    assert found["raised"] is None, found   # the refused write is the tick's to keep, not raise
    assert found["state_while_full"] == "stalled"
    assert found["window_refused"] >= 1   # (its write waited for room)
    assert found["log_rules"].count("stalled") == 1, found   # written once, not per retry
    # one line while it is refused, not a traceback per tick
    assert log.count("not stored") == 1 and "Traceback" not in log, log[-3000:]
    assert "job j's state stored now" in log and "window 1 stored now" in log


def test_a_window_closed_by_a_stall_on_a_full_disk_is_stored_once_space_returns(tmp_path):
    found, log = drive(tmp_path / "mon.db", "fsize", "stall")
    check_stall(found, log)


def test_the_same_on_a_real_full_tmpfs(small_disk):
    found, log = drive(small_disk / "mon.db", "tmpfs", "stall")
    check_stall(found, log)


def test_a_finished_state_refused_on_a_full_disk_is_stored_once_space_returns(tmp_path):
    found, log = drive(tmp_path / "mon.db", "fsize", "finished")
    # the analysis thread's write of `finished` was refused: written again by a later tick
    assert found["stored_state"] == "finished", (found, log[-3000:])
    assert found["windows"] == [[0, 4], [5, 7]], found
    assert found["raised"] is None and found["state_while_full"] == "finished"
    assert found["queued"] == [[5, 6, 7], ["j", "finished"]], found
    assert "Traceback" not in log, log[-3000:]


def test_a_silent_rank_decided_on_a_full_disk_is_alerted_once_space_returns(tmp_path):
    found, log = drive(tmp_path / "mon.db", "fsize", "silence")
    assert "rank_silent" in found["firing"], (found, log[-3000:])
    assert found["raised"] is None, found
    assert found["state_while_full"] == "running" and found["stored_state"] == "running"
    assert found["log_rules"].count("rank_silent") == 1, found   # once, not per retry
    assert log.count("not stored") == 1 and "Traceback" not in log, log[-3000:]


def test_a_fast_alert_decided_on_a_full_disk_is_stored_once_space_returns(tmp_path):
    # the change detector's rank_slowdown: decided while the disk is full, written at its
    # next pass, though no new part came
    found, log = drive(tmp_path / "mon.db", "fsize", "fast")
    assert found["firing"] == ["rank_slowdown"], (found, log[-3000:])
    assert found["log_rules"] == ["rank_slowdown"], found
    assert found["raised"] is None
    assert log.count("not stored") == 1 and "Traceback" not in log, log[-3000:]


def test_the_alert_sender_polling_a_full_disk_says_so_once(tmp_path):
    found, log = drive(tmp_path / "mon.db", "fsize", "outbox")
    assert found["before"] == 1
    # five polls refused: one line (it was one a poll, 4 a second), one once it works again
    assert log.count("outbox unavailable") == 1, log[-3000:]
    assert found["undelivered"] == 0, (found, log[-3000:])   # sent once there was room


def test_a_tick_failing_on_a_full_disk_says_so_once_not_a_traceback_a_tick(tmp_path):
    # (the sweep of empty uploaded jobs: a write; its job is forgotten once there is room)
    found, log = drive(tmp_path / "mon.db", "fsize", "sweep")
    assert log.count("monitor tick failed") == 1 and "Traceback" not in log, log[-3000:]
    assert "monitor ticks again" in log
    assert found["jobs"] == ["j"], found


def test_an_ingest_failing_on_a_full_disk_says_so_once_not_a_traceback_a_batch(tmp_path):
    found, log = drive(tmp_path / "mon.db", "fsize", "ingest")
    assert log.count("ingest batch failed") == 1 and "Traceback" not in log, log[-3000:]
    assert "ingest stores again" in log
    assert found["parts"] == 4 * 8, found   # the three refused batches stored once queued again


def test_a_monitor_killed_on_a_full_disk_analyses_the_stalls_window_once_started_again(
        tmp_path):
    # kill -9 while the stall (and its window) could not be stored: the restart rebuilds the
    # job from its stored parts, decides the stall again and analyses steps 5..7
    drive(tmp_path / "mon.db", "fsize", "killed", rc=-9)
    found, log = drive(tmp_path / "mon.db", "fsize", "restarted")
    assert found["raised"] is None, (found, log[-3000:])
    assert found["windows"] == [[0, 4], [5, 7]], (found, log[-3000:])
    assert found["stored_state"] == "stalled", found
