"""Red team round seven (issue 34): the monitor's alerts, analysis and reads shared between jobs,
and the CLI on hostile profiler files.

Each test is one defect class, marked xfail(strict=True) until its fix lands (then the mark goes):
a pass before the fix fails the suite, so each flips exactly when its defect is gone. Real
servers, a real webhook receiver and real CLI processes in subprocesses.
"""

from __future__ import annotations

import gzip
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from conftest import REPO, eventually, listening_url, up
from test_hostile_services_round6 import HANG_S, clean_refusal, cli, small_run

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import parts_of, slow_job  # noqa: E402

from stragglers.trace.runformat import table_bytes  # noqa: E402

TOKEN = "hostile-round7-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SETTINGS = {"window_steps": 5, "stall_after_s": 600, "tick_s": 0.05}


def serve_monitor(tmp: Path, config: dict) -> tuple[subprocess.Popen, str]:
    """`stragglers monitor serve` with `config` as its YAML file (JSON is YAML)."""
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    cfg = tmp / "monitor.yaml"
    cfg.write_text(json.dumps(config))
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.cli", "monitor", "serve", "--db",
                             str(tmp / "mon.db"), "--port", "0", "--config", str(cfg),
                             "--token-file", str(token)], cwd=tmp,
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    return proc, listening_url(proc)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.communicate(timeout=60)


def upload(c: httpx.Client, job: str, trace, steps_per_part: int) -> None:
    """`job`'s metadata and every part of `trace`, each acknowledged."""
    assert c.put(f"/api/jobs/{job}/meta", json=trace.meta.to_dict(),
                 headers=AUTH).status_code == 200
    for rank, n, cols in parts_of(trace, steps_per_part):
        r = c.put(f"/api/jobs/{job}/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                  headers=AUTH)
        assert r.status_code == 200, r.text


def windows(c: httpx.Client, job: str) -> int:
    return c.get(f"/api/jobs/{job}?history=1").json()["windows_total"]


class Receiver:
    """A webhook receiver on loopback that keeps every JSON body it is sent."""

    def __init__(self) -> None:
        got: list[dict] = []
        self.got = got

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                got.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Trickle:
    """A 'receiver' (a stuck proxy, a receiver paging to disk) that reads the request, then
    sends its status line and a header byte a second, and never ends its head."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/"
        self.done = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                while not self.done.wait(1.0):
                    conn.sendall(b"X")
            except OSError:
                pass

    def close(self) -> None:
        self.done.set()
        self.sock.close()


class StallingProxy(Trickle):
    """A proxy in front of `target` whose first connection stalls as Trickle's do (a reply
    announcing 100,000 bytes, sent a byte a second); later connections reach the target."""

    def __init__(self, target: str) -> None:
        self.target = target.removeprefix("http://").split(":")
        self.first = True
        super().__init__()

    def _trickle(self, conn: socket.socket) -> None:
        if self.first:
            self.first = False
            with conn:
                try:
                    conn.recv(65536)
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n")
                    while not self.done.wait(1.0):
                        conn.sendall(b" ")
                except OSError:
                    pass
            return
        try:
            up_conn = socket.create_connection((self.target[0], int(self.target[1])))
        except OSError:
            conn.close()
            return

        def pipe(a: socket.socket, b: socket.socket) -> None:
            try:
                while data := a.recv(65536):
                    b.sendall(data)
            except OSError:
                pass
            for k in (a, b):
                try:
                    k.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        threading.Thread(target=pipe, args=(up_conn, conn), daemon=True).start()
        pipe(conn, up_conn)


@pytest.mark.slow
def test_an_alert_reaches_a_receiver_listed_after_one_that_trickles_its_answer(tmp_path):
    """Two receivers; the first answers a header byte a second, for ever. The second still gets
    the firing alert: a post has a deadline as a whole (timeout_s), not per read."""
    trickle, receiver = Trickle(), Receiver()
    proc, url = serve_monitor(tmp_path, {
        "settings": SETTINGS, "webhooks": [trickle.url, receiver.url],
        "rules": [{"name": "straggling", "when": "slowdown >= 1.1", "for_windows": 1}]})
    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60) as c:
            upload(c, "j", slow_job(steps=10, slow=(0, 1, 3.0)), 5)
            eventually(lambda: c.get("/api/alerts").json()["firing"], what="the alert fired")
        # (the monitor's post timeout is 5 s: a post that ends by it reaches the second
        # receiver long before this; one that never ends never does)
        eventually(lambda: receiver.got, timeout=40, what="the second receiver got the alert")
    finally:
        stop(proc)
        trickle.close()
        receiver.close()
    assert receiver.got[0]["alerts"][0]["labels"]["alertname"] == "straggling"


@pytest.mark.slow
def test_a_jobs_window_is_not_analysed_behind_another_jobs_whole_backlog(tmp_path):
    """Job a sends 60 windows at once (a recorder catching up after an outage, or a job of many
    ranks); job b then completes one window. b's window is analysed in its turn, not after
    all of a's: when it is stored, some of a's backlog is still to come."""
    backlog = 60
    a = slow_job(steps=5 * backlog, dp=4, pp=2, slow=(0, 1, 3.0))
    b = slow_job(steps=5, slow=(0, 1, 3.0), seed=3)
    proc, url = serve_monitor(tmp_path, {"settings": SETTINGS})
    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60) as c:
            upload(c, "a", a, 5 * backlog)    # a part a rank: every window complete at once
            upload(c, "b", b, 5)
            eventually(lambda: windows(c, "b") == 1, interval=0.02, what="b's window analysed")
            a_done = windows(c, "a")
            eventually(lambda: windows(c, "a") == backlog, what="a's windows analysed")
    finally:
        stop(proc)
    assert a_done < backlog, "b's window waited for every window of a's backlog"


@pytest.mark.slow
def test_a_jobs_page_is_answered_at_the_read_pace_of_its_client(tmp_path):
    """A job's JSON holds up to 100,000 window summaries (the dashboard asks 2,000): 0.23 s and
    566 KB at 2,000 windows. Like /api/jobs, /api/stats and /metrics it is answered to one
    client address once per read_interval_s (here 60 s): a second read at once waits its turn
    (the 5 s client timeout ends it), where a loop of them took the CPUs from every upload."""
    proc, url = serve_monitor(tmp_path, {"settings": {**SETTINGS, "read_interval_s": 60}})
    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60) as c:
            upload(c, "j", slow_job(steps=10, slow=(0, 1, 3.0)), 5)
            # (window 1's own route says when both windows are done; then the address's
            # first read of the job is answered at once, and takes its turn)
            eventually(lambda: c.get("/api/jobs/j/windows/1").status_code == 200,
                       what="both windows analysed")
            assert c.get("/api/jobs/j").json()["windows_total"] == 2
        with httpx.Client(base_url=url, timeout=5) as c:
            with pytest.raises(httpx.ReadTimeout):
                c.get("/api/jobs/j")
    finally:
        stop(proc)


def gzip_bomb(path: Path, gib: int = 1) -> None:
    """Profiler JSON whose trace events are `gib` GiB of blanks, gzipped to ~4.7 MB: gzip
    members, each 64 MiB of spaces (a .json.gz may hold several)."""
    blank = gzip.compress(b" " * (64 << 20), compresslevel=1)
    with path.open("wb") as f:
        f.write(gzip.compress(b'{"traceEvents": ['))
        for _ in range(16 * gib):
            f.write(blank)
        f.write(gzip.compress(b"]}"))


def peak_rss(*args: str, cwd: Path) -> tuple[int | None, str, int]:
    """(exit status or None past HANG_S, stderr, peak resident set in bytes) of one CLI
    command, measured by a process of its own whose only child it is."""
    probe = ("import json, resource, subprocess, sys\n"
             "try:\n"
             "    p = subprocess.run(sys.argv[1:], capture_output=True, timeout=%d,\n"
             "                       stdin=subprocess.DEVNULL)\n"
             "    rc, err = p.returncode, p.stderr.decode(errors='replace')\n"
             "except subprocess.TimeoutExpired:\n"
             "    rc, err = None, 'no end'\n"
             "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024\n"
             "print(json.dumps([rc, err, rss]))\n") % (3 * HANG_S)
    done = subprocess.run([sys.executable, "-c", probe, sys.executable, "-m",
                           "stragglers.cli", *args], cwd=cwd, capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    rc, err, rss = json.loads(done.stdout)
    return rc, err, rss


@pytest.mark.slow
def test_analyze_reads_a_gzip_bomb_in_bounded_memory(tmp_path):
    """A 4.7 MB profiler .json.gz that unpacks to 1 GiB: refused in one line (no steps, or too
    large unpacked) holding no more than a few hundred MB — not unpacked whole in memory
    (a 47 MB one would take 22 GB, or end in 'internal error: MemoryError')."""
    bomb = tmp_path / "rank-0.json.gz"
    gzip_bomb(bomb)
    status, err, rss = peak_rss("analyze", str(bomb), "-q", cwd=tmp_path)
    clean_refusal(status, err, "rank-0.json.gz")
    size = bomb.stat().st_size
    assert rss < 600 << 20, f"{rss / 2**20:.0f} MiB held reading a {size:,}-byte file"


def test_analyze_refuses_a_timestamp_too_large_for_a_float_in_one_line(tmp_path):
    """An event's `ts` given as an integer of 400 digits: one line naming the file, exit 2."""
    folder = tmp_path / "traces"
    status, err = cli("synth-gpu", str(folder), "--ranks", "2", "--steps", "3", cwd=tmp_path)
    assert status == 0, err
    doc = json.loads(gzip.decompress((folder / "rank-0.json.gz").read_bytes()))
    kernel = next(e for e in doc["traceEvents"] if e.get("cat") == "kernel")
    kernel["ts"] = 10 ** 400
    (folder / "rank-0.json.gz").write_bytes(gzip.compress(json.dumps(doc).encode()))
    status, err = cli("analyze", str(folder), "-q", cwd=tmp_path)
    clean_refusal(status, err, "rank-0.json.gz")


def test_analyze_prints_no_terminal_escapes_a_run_file_holds(tmp_path):
    """A run whose meta.json names it with escapes (clear the screen, set the window title):
    the report shows them as text, writes no ESC byte (the report itself uses none on a
    pipe)."""
    run = small_run(tmp_path / "run")
    meta = json.loads((run / "meta.json").read_text())
    meta["name"] = "\x1b[2J\x1b]0;pwned\x07run"
    (run / "meta.json").write_text(json.dumps(meta))
    done = subprocess.run([sys.executable, "-m", "stragglers.cli", "analyze", str(run)],
                          cwd=tmp_path, capture_output=True, timeout=HANG_S,
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert done.returncode == 0, done.stderr[-1500:]
    at = done.stdout.find(b"\x1b")
    assert at < 0, f"ESC written: {done.stdout[max(0, at - 20):at + 40]!r}"


@pytest.mark.slow
def test_an_alert_of_a_rule_taken_out_of_the_config_does_not_fire_for_ever(tmp_path):
    """A rule fires; the operator takes it out of the rules file (too noisy, renamed) and
    restarts. Its alert is resolved — at the start, or at the job's next window — not left
    firing in /api/alerts and the metrics for ever, with no resolve sent."""
    trace = slow_job(steps=20, slow=(0, 1, 3.0))
    parts = parts_of(trace, 5)
    rule = {"name": "straggling", "when": "slowdown >= 1.1", "for_windows": 1}
    proc, url = serve_monitor(tmp_path, {"settings": SETTINGS, "rules": [rule]})
    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            for rank, n, cols in parts[:8]:
                assert c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                             headers=AUTH).status_code == 200
            eventually(lambda: c.get("/api/alerts").json()["firing"], what="the alert fired")
    finally:
        stop(proc)
    proc, url = serve_monitor(tmp_path, {"settings": SETTINGS, "rules": []})
    try:
        assert up(proc, url), "the monitor did not start again"
        with httpx.Client(base_url=url, timeout=60) as c:
            for rank, n, cols in parts[8:]:
                assert c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                             headers=AUTH).status_code == 200
            eventually(lambda: windows(c, "j") == 4, what="the job's next windows analysed")
            eventually(lambda: not c.get("/api/alerts").json()["firing"], timeout=20,
                       what="the removed rule's alert resolved")
    finally:
        stop(proc)


def run_of(trace, start: float) -> dict:
    """`trace`'s metadata as a recorder's run started at `start` sends it (its start clock and
    its run token, which the recorder also sends with every part: X-Stragglers-Run)."""
    meta = trace.meta.to_dict()
    meta["extra"]["clock"] = {"start": [start] * meta["world_size"]}
    meta["extra"]["run"] = f"run-{start:.0f}"
    return meta


@pytest.mark.slow
def test_parts_of_a_replaced_run_are_never_analysed_as_the_new_runs(tmp_path):
    """Two trainings of one script upload under the recorder's default job name (the trace
    folder's name, `train`), each part with its run's token as the recorder sends it. Run b's
    metadata arrives while run a is uploading. Either b is refused while a is live, or b
    replaces a — and then a's later parts are not stored into b's run: every window of b holds
    b's data (clean), none a's (a slow worker, S ~1.7)."""
    a = slow_job(steps=20, slow=(0, 1, 3.0), seed=1)
    b = slow_job(steps=20, slow=(0, 1, 1.0), seed=2)
    pa, pb = parts_of(a, 5), parts_of(b, 5)
    run = {id(p): "run-1000" for p in pa} | {id(p): "run-2000" for p in pb}

    def put(c: httpx.Client, part) -> int:
        rank, n, cols = part
        return c.put(f"/api/jobs/train/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                     headers={**AUTH, "X-Stragglers-Run": run[id(part)]}).status_code

    def answered(r: httpx.Response) -> int | None:
        return r.status_code if r.status_code in (200, 409) else None

    proc, url = serve_monitor(tmp_path, {"settings": SETTINGS})
    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.put("/api/jobs/train/meta", json=run_of(a, 1000.0),
                         headers=AUTH).status_code == 200
            assert [put(c, p) for p in pa[:6]] == [200] * 6
            eventually(lambda: windows(c, "train") == 1, what="a's window 0 analysed")
            # (503 while a's parts are still being stored: the recorder tries again)
            answer = eventually(lambda: answered(c.put("/api/jobs/train/meta",
                                                       json=run_of(b, 2000.0), headers=AUTH)),
                                what="b's metadata answered")
            if answer == 409:   # refused while a is live: a goes on, all of it analysed
                for p in pa[6:]:
                    assert put(c, p) == 200
                eventually(lambda: windows(c, "train") == 4, what="a's windows analysed")
                return
            for p in pb[:4] + pa[8:12] + pb[4:8]:   # b's window 0, a's window 2, b's window 1
                assert put(c, p) == (409 if run[id(p)] == "run-1000" else 200), p[:2]
            # a's metadata again (its end clock, say): refused too, b's run kept
            assert c.put("/api/jobs/train/meta", json=run_of(a, 1000.0),
                         headers=AUTH).status_code == 409
            eventually(lambda: c.get("/health").json()["idle"] and windows(c, "train") >= 2,
                       what="b's windows analysed")
            got = c.get("/api/jobs/train").json()["windows"]
    finally:
        stop(proc)
    assert all(w["slowdown"] < 1.3 for w in got), \
        [(w["idx"], round(w["slowdown"], 3)) for w in got]


@pytest.mark.slow
def test_finished_jobs_do_not_hold_the_places_of_max_jobs(tmp_path):
    """max_jobs is the jobs tracked at once. Two jobs end (finished: silent past
    finish_after_s); a third job is then taken — not refused for good because two jobs once ran
    (10,000 by default: a busy cluster's month, or 83 minutes of a writer creating the 120 a
    minute allowed, each with one part so that none expires as empty)."""
    trace = slow_job(steps=5, slow=(0, 1, 3.0))
    proc, url = serve_monitor(tmp_path, {"settings": {
        **SETTINGS, "stall_after_s": 0.5, "finish_after_s": 1, "max_jobs": 2}})
    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60) as c:
            for job in ("a", "b"):
                upload(c, job, trace, 5)
            eventually(lambda: all(c.get(f"/api/jobs/{job}?history=1").json()["state"] ==
                                   "finished" for job in ("a", "b")), what="both finished")
            r = c.put("/api/jobs/c/meta", json=trace.meta.to_dict(), headers=AUTH)
    finally:
        stop(proc)
    assert r.status_code == 200, r.text


@pytest.mark.slow
def test_finished_data_sets_can_give_their_places_of_max_datasets_back(tmp_path):
    """Two data sets are consumed to the end ("finished"); a third is then created — either
    finished ones hold no place, or their owner can delete one (DELETE /datasets/{name}) — not
    refused for good because 4,096 data sets (the default) once ran on this service."""
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.cli", "adapt", "serve", "--db",
                             str(tmp_path / "s.db"), "--port", "0", "--set", "max_datasets=2"],
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    url = listening_url(proc)
    owner = {"Authorization": "Bearer owner-token-0123456789"}
    try:
        assert up(proc, url), "the shard service did not start"
        with httpx.Client(base_url=url, headers=owner, timeout=60) as c:
            for name in ("d1", "d2"):
                assert c.post("/datasets", json={"name": name, "num_samples": 4,
                                                 "shard_size": 4}).status_code == 200
                fence = c.post(f"/datasets/{name}/join", json={"worker": "w"}).json()["fence"]
                lease = c.post(f"/datasets/{name}/lease",
                               json={"worker": "w", "fence": fence}).json()["leases"][0]
                assert c.post(f"/datasets/{name}/ack", json={
                    "worker": "w", "fence": fence, "epoch": lease["epoch"],
                    "shard": lease["shard"], "consumed": lease["size"]}).status_code == 200
                assert c.post(f"/datasets/{name}/lease", json={
                    "worker": "w", "fence": fence}).json()["status"] == "finished"
            r = c.post("/datasets", json={"name": "d3", "num_samples": 4, "shard_size": 4})
            if r.status_code == 429:   # finished ones count: their owner may give one back
                assert c.delete("/datasets/d1").status_code in (200, 204)
                r = c.post("/datasets", json={"name": "d3", "num_samples": 4, "shard_size": 4})
            assert r.status_code == 200, r.text
    finally:
        stop(proc)


@pytest.mark.slow
def test_a_long_job_goes_on_being_analysed_past_max_job_bytes_of_analysed_parts(tmp_path):
    """Six windows uploaded one after the other, each analysed before the next is sent; their
    parts add up to ~135 KB, max_job_bytes is 60,000. The bound keeps one job from filling the
    disk with what is not analysed yet; parts whose windows are done are not held against it
    (or are let go), so every window is analysed. (16 GiB by default: a 1,024-rank job
    recording ~3 MB a step reaches it in about an hour and a half, and is monitored no more.)"""
    trace = slow_job(steps=30, slow=(0, 1, 3.0))
    proc, url = serve_monitor(tmp_path, {"settings": {**SETTINGS, "max_job_bytes": 60_000}})
    refused = []
    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict(),
                         headers=AUTH).status_code == 200
            parts = parts_of(trace, 5)
            for w in range(6):
                for rank, n, cols in parts[4 * w:4 * w + 4]:
                    r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                              headers=AUTH)
                    if r.status_code != 200:
                        refused.append((rank, n, r.status_code))
                if refused:
                    break
                eventually(lambda: windows(c, "j") == w + 1, what=f"window {w} analysed")
    finally:
        stop(proc)
    assert not refused, f"parts refused once analysed ones filled max_job_bytes: {refused}"


@pytest.mark.slow
def test_the_recorders_uploads_go_on_after_a_reply_trickled_for_ever(tmp_path):
    """A rank's PartUploader behind a proxy whose first answer stalls (100,000 bytes announced,
    a byte a second): the request is given up at its timeout (2 s here) and sent again on a
    new connection, and the parts reach the monitor — not held behind it for the whole run
    (the buffer then drops every part: the job goes unmonitored, silently)."""
    from stragglers.record.upload import PartUploader

    trace = slow_job(steps=10, slow=(0, 1, 3.0))
    proc, url = serve_monitor(tmp_path, {"settings": SETTINGS})
    proxy = StallingProxy(url)
    uploader = None
    try:
        assert up(proc, url), "the monitor did not start"
        uploader = PartUploader(proxy.url, TOKEN, "j", 0, timeout_s=2.0)
        uploader.submit_meta(trace.meta.to_dict())
        for rank, n, cols in parts_of(trace, 5):
            if rank == 0:
                uploader.submit(n, table_bytes(cols))
        eventually(lambda: uploader.stats().sent == 2, timeout=40,
                   what="rank 0's two parts stored")
    finally:
        if uploader is not None:
            uploader.close(timeout=1)
        proxy.close()
        stop(proc)


@pytest.mark.slow
def test_a_long_trainings_own_snapshot_can_be_restored(tmp_path):
    """A data set of 64 shards an epoch trained for three epochs. Its snapshot (what a
    checkpoint keeps) holds every shard row of every epoch, ~30 bytes each: 65,536 shards an
    epoch add ~1.9 MB an epoch, so past ~34 epochs the service's own snapshot is over the
    64 MiB restore bound and the job cannot resume from its checkpoint. Here the bound is
    4,096 bytes: the live state (the epoch under way; the ones done are a count) fits, and the
    snapshot is restored."""
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.cli", "adapt", "serve", "--db",
                             str(tmp_path / "s.db"), "--port", "0", "--set",
                             "max_restore_bytes=4096"],
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")},
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    url = listening_url(proc)
    owner = {"Authorization": "Bearer owner-token-0123456789"}
    try:
        assert up(proc, url), "the shard service did not start"
        with httpx.Client(base_url=url, headers=owner, timeout=60) as c:
            assert c.post("/datasets", json={"name": "d", "num_samples": 64, "shard_size": 1,
                                             "num_epochs": 4}).status_code == 200
            fence = c.post("/datasets/d/join", json={"worker": "w"}).json()["fence"]
            epoch = 0
            while epoch < 3:    # three epochs done, the fourth begun
                got = c.post("/datasets/d/lease", json={"worker": "w", "fence": fence,
                                                        "count": 64}).json()
                assert got["status"] == "ok", got
                for lease in got["leases"]:
                    assert c.post("/datasets/d/ack", json={
                        "worker": "w", "fence": fence, "epoch": lease["epoch"],
                        "shard": lease["shard"], "consumed": lease["size"]}).status_code == 200
                    epoch = max(epoch, lease["epoch"])
            snapshot = c.get("/datasets/d/snapshot").content
            r = c.post("/datasets/d/restore", content=snapshot,
                       headers={"Content-Type": "application/json"})
            assert r.status_code == 200, (len(snapshot), r.text)
    finally:
        stop(proc)


class Redirecting(Receiver):
    """A receiver behind an ingress that answers its old address with 301 to the new one
    (http to https, a moved path); the new one is Alertmanager's API, where a GET lists the
    alerts (200) and a POST adds them."""

    def __init__(self) -> None:
        super().__init__()
        got, handler = self.got, self.server.RequestHandlerClass

        class Moved(handler):   # type: ignore[misc, valid-type]
            def do_POST(self) -> None:
                if self.path != "/old":
                    return super().do_POST()
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self.send_response(301)
                self.send_header("Location", "/api/v2/alerts")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"[]")

        self.server.RequestHandlerClass = Moved
        self.got = got
        self.url += "old"


@pytest.mark.slow
def test_an_alert_is_not_counted_delivered_when_a_redirect_dropped_it(tmp_path):
    """The receiver's address redirects (301). urllib turns the POST into a GET without a body,
    Alertmanager answers that GET 200 (its alert list), and the message was marked delivered:
    the alert never reached it. Right: posted to the new address with its body, or not
    counted delivered (a 3xx is a failure, retried and logged)."""
    receiver = Redirecting()
    proc, url = serve_monitor(tmp_path, {
        "settings": SETTINGS, "webhooks": [receiver.url],
        "rules": [{"name": "straggling", "when": "slowdown >= 1.1", "for_windows": 1}]})

    def sent(c: httpx.Client) -> float:
        for line in c.get("/metrics").text.splitlines():
            if line.startswith('stragglers_alert_notifications_total{outcome="sent"}'):
                return float(line.split()[-1])
        return 0.0

    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60) as c:
            upload(c, "j", slow_job(steps=10, slow=(0, 1, 3.0)), 5)
            eventually(lambda: c.get("/api/alerts").json()["firing"], what="the alert fired")
            try:
                eventually(lambda: receiver.got or sent(c) > 0, timeout=20,
                           what="the alert posted or counted delivered")
            except AssertionError:
                return   # neither: a 3xx taken as a failure (retried), not as delivered
            counted = sent(c)
    finally:
        stop(proc)
        receiver.close()
    assert receiver.got, f"counted delivered ({counted:.0f}) and never posted"
    assert receiver.got[0]["alerts"][0]["labels"]["alertname"] == "straggling"


def test_analyze_refuses_rows_of_a_rank_outside_the_world_in_one_line(tmp_path):
    """rank-00000.parquet whose rows say rank 9 in a world of 4: one line naming the file and
    field 'rank', exit 2 — as the monitor refuses 'rows of rank 1 in a part of rank 0' — not
    an analysis naming a rank that does not exist (its diagnosis would send the operator to
    restart it)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = small_run(tmp_path / "run")
    path = run / "rank-00000.parquet"
    table = pq.read_table(path)
    at = table.schema.get_field_index("rank")
    table = table.set_column(at, "rank", pa.array(np.full(table.num_rows, 9, np.int32)))
    pq.write_table(table, path)
    status, err = cli("analyze", str(run), "-q", cwd=tmp_path)
    clean_refusal(status, err, "rank")


@pytest.mark.slow
def test_a_new_run_gets_its_windows_not_those_its_predecessor_left_queued(tmp_path):
    """Run a sends a part per rank holding 60 windows (all queued at once); run b's metadata
    comes right after (a re-run under the same name) and b sends its two windows. The job ends
    with b's two windows analysed — not a's 60 analysed after the reset from files that are
    gone ('no readable rows in this window'), b's window 1 left under one of them, never
    analysed. (A new run may also wait, 503, until a's windows are done.)"""
    a = slow_job(steps=300, dp=4, pp=2, slow=(0, 1, 3.0), seed=1)
    b = slow_job(steps=10, dp=4, pp=2, slow=(0, 1, 1.0), seed=2)

    def answered(r: httpx.Response) -> int | None:
        return r.status_code if r.status_code in (200, 409) else None

    proc, url = serve_monitor(tmp_path, {"settings": SETTINGS})
    try:
        assert up(proc, url), "the monitor did not start"
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.put("/api/jobs/j/meta", json=run_of(a, 1000.0),
                         headers=AUTH).status_code == 200
            for rank, n, cols in parts_of(a, 300):
                assert c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                             headers=AUTH).status_code == 200
            answer = eventually(lambda: answered(c.put("/api/jobs/j/meta",
                                                       json=run_of(b, 2000.0), headers=AUTH)),
                                what="b's metadata answered")
            if answer == 409:   # refused while a is live (#8's other remedy): a goes on
                eventually(lambda: windows(c, "j") == 60, what="a's windows analysed")
                got = c.get("/api/jobs/j").json()["windows"]
                assert not [w["idx"] for w in got if w["error"]], got[:2]
                return
            for rank, n, cols in parts_of(b, 5):
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols),
                          headers=AUTH)
                assert r.status_code == 200, r.text
            eventually(lambda: c.get("/health").json()["idle"] and windows(c, "j") >= 2,
                       what="the job's windows analysed")
            got = c.get("/api/jobs/j").json()["windows"]
    finally:
        stop(proc)
    assert [(w["idx"], w["error"]) for w in got] == [(0, None), (1, None)], \
        [(w["idx"], (w["error"] or "")[:40]) for w in got[:4]]
