"""A watched part whose reads never return (a hard-mounted NFS file whose server went away, a
hung sshfs/s3fs/gcsfuse file) stalls neither another job's uploads, nor the watched run's good
parts, nor the monitor's stop: its read is given up on after part_files.READ_TIMEOUT_S, the
file left for a later scan, its thread left behind. Before, the ingest thread waited on the read
for good (an upload was never answered, the run's other parts never stored, stop() and SIGTERM
waited on it).

The stuck file is real: a FUSE file (raw /dev/fuse, mounted over the part's name) whose server
answers everything but reads, which it holds (_serve_fuse, in a process of its own).
Needs root and /dev/fuse: skipped where either is absent. The timeouts below only stop a hang."""

from __future__ import annotations

import ctypes
import inspect
import os
import signal
import stat
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import REPO, eventually, free_port
from monitor_jobs import parts_of, slow_job, start_run, write_parts
from stragglers.monitor import ingest_files
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import rank_file_name
from stragglers.trace.synth import generate
from stragglers.trace.runformat import write_rank

HANG = 120   # seconds: only a hang waits this long
STUCK = (0, 1)   # the rank and part whose file hangs
CFG = MonitorConfig(window_steps=4, stall_after_s=600, tick_s=0.05, rescan_s=0.3)


def _serve_fuse(target: str, answered: int, stat_hangs: bool) -> None:
    """Mount a FUSE file over `target` (a regular file: its size is kept) and answer every
    request but READ, which is held for good past the first `answered` reads (those get the
    file's bytes, each read asked of the server: direct I/O), and with `stat_hangs` every
    GETATTR (a stat) too; prints 'mounted', then 'read held' per read or stat held."""
    with open(target, "rb") as f:
        content = f.read()
    size = len(content)
    fd = os.open("/dev/fuse", os.O_RDWR)
    libc = ctypes.CDLL(None, use_errno=True)
    opts = f"fd={fd},rootmode={stat.S_IFREG:o},user_id=0,group_id=0,allow_other".encode()
    if libc.mount(b"stuckfuse", target.encode(), b"fuse", 0, opts) != 0:
        print("mount failed:", os.strerror(ctypes.get_errno()), flush=True)
        sys.exit(1)
    print("mounted", flush=True)
    now = int(time.time())
    attr = struct.pack("<QQQQQQIIIIIIIIII", 1, size, (size + 511) // 512, now, now, now, 0, 0,
                       0, stat.S_IFREG | 0o644, 1, 0, 0, 0, 4096, 0)

    def reply(unique: int, payload: bytes = b"", error: int = 0) -> None:
        os.write(fd, struct.pack("<IiQ", 16 + len(payload), error, unique) + payload)

    while True:
        try:
            buf = os.read(fd, (1 << 20) + 4096)
        except OSError:
            return
        _, op, unique = struct.unpack_from("<IIQ", buf)
        if op == 26:   # INIT (protocol 7.31, max_write 1 MiB)
            ra = struct.unpack_from("<IIII", buf, 40)[2]
            reply(unique, struct.pack("<IIIIHHIIHHII", 7, 31, ra, 0, 16, 12, 1 << 20, 1, 32,
                                      0, 0, 0).ljust(64, b"\0"))
        elif op == 3 and stat_hangs:   # GETATTR: never answered
            print("read held", flush=True)
        elif op == 3:   # GETATTR
            reply(unique, struct.pack("<QII", 1, 0, 0) + attr)
        elif op == 14:   # OPEN (FOPEN_DIRECT_IO: no page cache answers a read)
            reply(unique, struct.pack("<QIi", 1, 1, 0))
        elif op == 15 and answered > 0:   # READ, while it still answers
            answered -= 1
            offset, length = struct.unpack_from("<QI", buf, 48)
            reply(unique, content[offset:offset + length])
        elif op == 15:   # READ: never answered (a server gone away)
            print("read held", flush=True)
        elif op in (18, 25):   # RELEASE, FLUSH
            reply(unique)
        elif op in (2, 36, 42):   # FORGET, INTERRUPT (ignored: hung), BATCH_FORGET
            pass
        elif op == 38:   # DESTROY
            reply(unique)
            return
        else:
            reply(unique, error=-38)   # ENOSYS


class StuckFile:
    """A FUSE server holding every read of the file it is mounted over."""

    def __init__(self, target: Path, answered: int = 0, stat_hangs: bool = False):
        self.target = target
        self.held = threading.Event()   # a read reached the server (and is held)
        # (its own process: the server's source run as a script)
        source = "import ctypes, os, stat, struct, sys, time\n" + \
            inspect.getsource(_serve_fuse) + f"\n_serve_fuse({str(target)!r}, {answered}, {stat_hangs})\n"
        self.proc = subprocess.Popen([sys.executable, "-c", source],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = self.proc.stdout.readline().strip()   # type: ignore[union-attr]
        if first != "mounted":
            self.proc.wait(timeout=HANG)
            pytest.skip(f"a FUSE file cannot be mounted here ({first or 'no answer'})")
        threading.Thread(target=self._follow, daemon=True).start()

    def _follow(self) -> None:
        for line in self.proc.stdout:   # type: ignore[union-attr]
            if line.startswith("read held"):
                self.held.set()

    def close(self) -> None:
        """The server gone: held reads fail (ENOTCONN), the mount is taken away."""
        self.proc.kill()
        self.proc.wait(timeout=HANG)
        ctypes.CDLL(None, use_errno=True).umount2(str(self.target).encode(), 2)  # MNT_DETACH


@pytest.fixture
def stuck_run(tmp_path):
    """runs/run1: a job's meta.json and parts, rank 0's part 1 a file whose reads hang; yields
    (run folder, its parts' (rank, part), the FUSE server)."""
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse to mount a FUSE file whose reads hang")
    run = tmp_path / "runs" / "run1"
    trace = slow_job(steps=8)
    start_run(run, trace)
    parts = parts_of(trace, steps_per_part=4)
    write_parts(run, parts)
    stuck = StuckFile(run / rank_file_name(*STUCK))
    try:
        yield run, [(rank, part) for rank, part, _ in parts], stuck
    finally:
        stuck.close()


def upload(tmp_path: Path, seed: int) -> tuple[dict, bytes]:
    """A one-rank job's meta and its part 0 as the recorder uploads them."""
    trace = generate(dp=1, pp=1, microbatches=2, steps=4, seed=seed)
    path = write_rank(tmp_path / f"up{seed}", 0, dict(trace.ops), part=0)
    return trace.meta.to_dict(), Path(path).read_bytes()


@pytest.mark.slow
def test_a_hanging_watched_file_stalls_no_upload_nor_the_run_nor_the_stop(stuck_run, tmp_path):
    run, parts, fuse = stuck_run
    server = MonitorServer(tmp_path / "mon.db", watch=[run.parent], port=0,
                           config=CFG).start()
    stopped = False
    try:
        assert fuse.held.wait(HANG), "the monitor never read the hanging file"
        with httpx.Client(base_url=server.url, timeout=HANG) as c:
            # another job's upload is answered (it waited for the ingest thread for good)
            meta, body = upload(tmp_path, 1)
            assert c.put("/api/jobs/up1/meta", json=meta).status_code == 200
            r = c.put("/api/jobs/up1/ranks/0/parts/0", content=body)
            assert r.status_code == 200, r.text
            # the run's good parts are stored, the hanging one left for later (not refused)
            tracker = server.monitor.tracker("run1")
            eventually(lambda: all(tracker.knows(*p) for p in parts if p != STUCK), HANG,
                       what="run1's readable parts stored")
            assert not tracker.knows(*STUCK)
            stuck = server.monitor.stuck_reads()
            assert list(stuck) == [f"run1/{rank_file_name(*STUCK)}"], stuck
            assert 'stragglers_queue_depth{queue="stuck_reads"} 1.0' in c.get("/metrics").text
            refused = [r for r in c.get("/api/stats").json()["rejects"]
                       if rank_file_name(*STUCK) in r["source"]]
            assert not refused, refused
            # the rescans that queue it again do not wait on it again, nor leave another
            # thread behind: a later upload is answered while the read is still held
            meta, body = upload(tmp_path, 2)
            assert c.put("/api/jobs/up2/meta", json=meta).status_code == 200
            r = c.put("/api/jobs/up2/ranks/0/parts/0", content=body)
            assert r.status_code == 200, r.text
            assert server.monitor.file_readers.given_up == 1
        # stop() returns with the read still held (it waited on the reader pool for good)
        ended = threading.Thread(target=server.stop, daemon=True)
        ended.start()
        ended.join(HANG)
        stopped = not ended.is_alive()
        assert stopped, "stop() waited on the hanging read"
    finally:
        if not stopped:
            threading.Thread(target=server.stop, daemon=True).start()



@pytest.mark.slow
def test_sigterm_does_not_wait_on_a_hanging_watched_file(stuck_run, tmp_path):
    # `stragglers monitor serve` (SIGTERM: what kill, systemd and Kubernetes send) stops its
    # threads and closes its store while the read is still held; it waited on the read
    run, _, fuse = stuck_run
    port = free_port()
    cfg = tmp_path / "monitor.yaml"
    cfg.write_text("settings: {window_steps: 4, stall_after_s: 600, tick_s: 0.1, "
                   "rescan_s: 0.3}\n")
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                             str(tmp_path / "mon.db"), "--port", str(port), "--config", str(cfg),
                             "--watch", str(run.parent)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert fuse.held.wait(HANG), "the monitor never read the hanging file"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=HANG) as c:
            eventually(lambda: c.get("/health").status_code == 200, HANG, what="monitor up")
        assert (tmp_path / "mon.db-wal").exists()   # (open, in write-ahead-log mode)
        proc.send_signal(signal.SIGTERM)
        # the store closed (SQLite folds its write-ahead log back when its last connection
        # closes: the last thing the stop does) with the read still held
        eventually(lambda: not (tmp_path / "mon.db-wal").exists(), HANG,
                   what="the store closed after SIGTERM")
        assert fuse.proc.poll() is None   # (the read was still held)
        fuse.close()   # (a FUSE read sent to its server is waited out even by a killed process)
        out, _ = proc.communicate(timeout=HANG)
        assert proc.returncode == 128 + signal.SIGTERM, out
        assert "Traceback" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=HANG)


@pytest.mark.slow
def test_a_hanging_file_is_read_again_once_its_read_returns(stuck_run, tmp_path):
    # left for later, not refused: its server gone and the mount taken away, the part's own
    # file is there again, and a scan reads and stores it
    run, parts, fuse = stuck_run
    server = MonitorServer(tmp_path / "mon.db", watch=[run.parent], port=0,
                           config=CFG).start()
    try:
        assert fuse.held.wait(HANG), "the monitor never read the hanging file"
        eventually(server.monitor.stuck_reads, HANG, what="the hanging read given up on")
        tracker = server.monitor.tracker("run1")
        eventually(lambda: all(tracker.knows(*p) for p in parts if p != STUCK), HANG,
                   what="run1's readable parts stored")
        fuse.close()
        eventually(lambda: tracker.knows(*STUCK), HANG, what="the part read again and stored")
        assert server.monitor.stuck_reads() == {}
        assert server.monitor.file_readers.given_up == 1
    finally:
        server.stop()


@pytest.mark.slow
def test_a_hanging_meta_json_holds_neither_the_first_scan_nor_other_runs(tmp_path):
    # the watcher reads meta.json on the same bounded readers: a hanging one held the first
    # scan for good (/health `scanning` ever after, no silence decided, not idle)
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse to mount a FUSE file whose reads hang")
    runs = tmp_path / "runs"
    trace = slow_job(steps=8)
    for name in ("a-hangs", "b-good"):
        start_run(runs / name, trace)
    parts = parts_of(trace, steps_per_part=4)
    write_parts(runs / "b-good", parts)
    fuse = StuckFile(runs / "a-hangs" / "meta.json")
    server = None
    try:
        server = MonitorServer(tmp_path / "mon.db", watch=[runs], port=0, config=CFG).start()
        assert fuse.held.wait(HANG), "the monitor never read the hanging meta.json"
        monitor = server.monitor
        eventually(lambda: not monitor.scanning(), HANG, what="the first scan done")
        eventually(lambda: monitor.tracker("b-good") is not None and all(
            monitor.tracker("b-good").knows(r, p) for r, p, _ in parts), HANG,
            what="the other run's parts stored")
        assert monitor.tracker("a-hangs") is None   # (left for a later scan, not refused)
        assert list(monitor.stuck_reads()) == ["a-hangs/meta.json"]
    finally:
        if server is not None:
            server.stop()
        fuse.close()



@pytest.mark.slow
def test_a_part_that_hangs_once_stored_holds_no_window(tmp_path):
    # its footer read at the ingest, then every read held (an NFS server gone mid-run): the
    # window goes without its rows (the part named refused), not the analysis waiting on it
    # for good (that window and every later one, of every job, and the stop)
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse to mount a FUSE file whose reads hang")
    run = tmp_path / "runs" / "run1"
    trace = slow_job(steps=8)
    start_run(run, trace)
    parts = parts_of(trace, steps_per_part=4)
    write_parts(run, parts)
    fuse = StuckFile(run / rank_file_name(0, 0), answered=1)
    server = None
    try:
        server = MonitorServer(tmp_path / "mon.db", watch=[run.parent], port=0,
                               config=CFG).start()
        tracker = server.monitor.tracker
        eventually(lambda: tracker("run1") is not None and all(
            tracker("run1").knows(r, p) for r, p, _ in parts), HANG, what="every part stored")
        assert fuse.held.wait(HANG), "no read of the stored part reached its server"
        with httpx.Client(base_url=server.url, timeout=HANG) as c:
            eventually(lambda: c.get("/api/jobs/run1").json()["windows"], HANG,
                       what="run1's first window analysed")
            refused = [r for r in c.get("/api/stats").json()["rejects"]
                       if rank_file_name(0, 0) in r["source"]]
            assert refused and "has not returned" in refused[0]["problem"], refused
        ended = threading.Thread(target=server.stop, daemon=True)
        ended.start()
        ended.join(HANG)
        assert not ended.is_alive(), "stop() waited on the hanging read"
        server = None
    finally:
        if server is not None:
            threading.Thread(target=server.stop, daemon=True).start()
        fuse.close()


@pytest.mark.slow
def test_a_restart_with_a_hanging_stored_part_starts(tmp_path):
    # a restart reads back the footers of the stored parts not analysed yet: one that hangs
    # held start() for good (no service at all); now it is left out as an unreadable one is
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse to mount a FUSE file whose reads hang")
    run = tmp_path / "runs" / "run1"
    trace = slow_job(steps=10)   # (windows 0..3 and 4..7 analysed, 8..11 open)
    start_run(run, trace)
    parts = parts_of(trace, steps_per_part=4)
    write_parts(run, parts)
    server = MonitorServer(tmp_path / "mon.db", watch=[run.parent], port=0, config=CFG).start()
    try:
        eventually(lambda: server.monitor.tracker("run1") is not None and all(
            server.monitor.tracker("run1").knows(r, p) for r, p, _ in parts), HANG,
            what="every part stored")
    finally:
        server.stop()
    fuse = StuckFile(run / rank_file_name(0, 2))   # (steps 8..9: no window analysed them)
    started: list[MonitorServer] = []
    try:
        again = MonitorServer(tmp_path / "mon.db", watch=[run.parent], port=0, config=CFG)
        begun = threading.Thread(target=lambda: started.append(again.start()), daemon=True)
        begun.start()
        begun.join(HANG)
        assert started, "start() waited on the hanging stored part"
        assert fuse.held.is_set()   # (its footer was asked for)
        with httpx.Client(base_url=again.url, timeout=HANG) as c:
            meta, body = upload(tmp_path, 3)
            assert c.put("/api/jobs/up3/meta", json=meta).status_code == 200
            assert c.put("/api/jobs/up3/ranks/0/parts/0", content=body).status_code == 200
    finally:
        if started:
            threading.Thread(target=again.stop, daemon=True).start()
        fuse.close()



@pytest.mark.slow
def test_a_part_whose_stat_hangs_holds_neither_the_first_scan_nor_other_runs(tmp_path,
                                                                             monkeypatch):
    # a hard-mounted NFS file whose server went away hangs its stat too: the scan of its run
    # is given up on after RUN_SCAN_TIMEOUT_S (it held the first scan for good: `scanning`
    # ever after, no rescan of any root)
    if os.geteuid() != 0 or not os.path.exists("/dev/fuse"):
        pytest.skip("needs root and /dev/fuse to mount a FUSE file whose reads hang")
    # 5 s, not the service's 30, for the scan of a run and for the watch's first batch (the
    # watch child's own stat of the file hangs: it never sends one): the test waited out
    # both, 60 s; a good run's scan given up on under load is only left for the next rescan,
    # which the waits below cover
    monkeypatch.setattr(ingest_files, "RUN_SCAN_TIMEOUT_S", 5.0)
    monkeypatch.setattr(ingest_files, "FIRST_BATCH_WAIT_S", 5.0)
    runs = tmp_path / "runs"
    trace = slow_job(steps=8)
    parts = parts_of(trace, steps_per_part=4)
    for name in ("a-hangs", "b-good"):
        start_run(runs / name, trace)
        write_parts(runs / name, parts)
    fuse = StuckFile(runs / "a-hangs" / rank_file_name(*STUCK), stat_hangs=True)
    server = None
    try:
        server = MonitorServer(tmp_path / "mon.db", watch=[runs], port=0, config=CFG).start()
        monitor = server.monitor
        assert fuse.held.wait(HANG), "the monitor never looked at the hanging file"
        eventually(lambda: not monitor.scanning(), HANG, what="the first scan done")
        eventually(lambda: monitor.tracker("b-good") is not None and all(
            monitor.tracker("b-good").knows(r, p) for r, p, _ in parts), HANG,
            what="the other run's parts stored")
        # (the hanging run's parts after the hanging one wait for its stat: its scan is
        # left for a later one, which skips it while that stat is stuck)
        assert not monitor.tracker("a-hangs").knows(*STUCK)
    finally:
        if server is not None:
            ended = threading.Thread(target=server.stop, daemon=True)
            ended.start()
            ended.join(HANG)
        fuse.close()
