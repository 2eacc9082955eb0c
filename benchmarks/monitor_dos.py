"""A well-behaved recorder's upload latency on the monitor, quiet and under connection DoS.

    python benchmarks/monitor_dos.py [--rounds 10] [--blocks 4]

The monitor runs as deployed (`stragglers monitor serve`, its own process). For each case the
same client (one keep-alive httpx connection, as the PartUploader keeps) uploads the same parts
(4 ranks x `rounds`) into a job of its own, one after the other, in `blocks` pairs of a quiet
block and a block under the case, alternated; the figure is the median latency under the case
divided by the quiet median, with each pair's own ratio and the monitor's CPU while attacked
(issue 34: within 2x). Cases: 1,000 idle TCP connections; 200 connections sending half a
request head; 32 slow bodies declaring 64 MiB each (a byte a second); the same well-behaved
client opening a new connection per upload while 1,000 idle connections are held (what the
idle-eviction is for); 4 client processes of another loopback address (another writer only by
their job) uploading parts whose page headers declare 1 GB (refused 422 from the headers), or
16 MiB bodies in a loop (refused after their first MiB).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "monitor"))
from monitor_jobs import parts_of, slow_job  # noqa: E402

from test_monitor_pages import lying_part  # noqa: E402

from stragglers.trace.runformat import table_bytes  # noqa: E402

TOKEN = "benchmark-token-0123456"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def uploads(url: str, job: str, bodies, fresh: bool) -> list[float]:
    """Latency (s) of each upload, over one keep-alive connection or a new one each time."""
    out = []
    client = None if fresh else httpx.Client(base_url=url, timeout=60)
    for rank, part, body in bodies:
        c = httpx.Client(base_url=url, timeout=60) if fresh else client
        t0 = time.perf_counter()
        r = c.put(f"/api/jobs/{job}/ranks/{rank}/parts/{part}", content=body, headers=AUTH)
        out.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
        if fresh:
            c.close()
    if client is not None:
        client.close()
    return out


def idle(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]


def half_heads(port: int, n: int) -> list[socket.socket]:
    socks = idle(port, n)
    for k in socks:
        k.sendall(b"PUT /api/jobs/x/meta HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    return socks


def slow_bodies(port: int, n: int, stop: threading.Event) -> list[socket.socket]:
    socks = idle(port, n)
    for i, k in enumerate(socks):
        k.sendall(f"PUT /api/jobs/dos/ranks/0/parts/{500 + i} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                  f"Authorization: Bearer {TOKEN}\r\nContent-Length: {64 * 2**20}\r\n\r\n"
                  .encode())

    def trickle():
        while not stop.wait(1.0):
            for k in socks:
                try:
                    k.sendall(b"x")
                except OSError:
                    pass

    threading.Thread(target=trickle, daemon=True).start()
    return socks


def flood(url: str, body: bytes, n: int, stop: threading.Event) -> list:
    """`n` client processes of another address (127.0.0.2) PUTting `body` as parts in a loop
    (processes: threads here would take the measured client's interpreter lock)."""
    done = mp.Event()
    procs = [mp.Process(target=flood_loop, args=(url, body, i, done), daemon=True)
             for i in range(n)]
    for proc in procs:
        proc.start()

    def end():
        stop.wait()
        done.set()
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()

    threading.Thread(target=end, daemon=True).start()
    return []


def flood_loop(url: str, body: bytes, i: int, done) -> None:
    with httpx.Client(base_url=url, timeout=60,
                      transport=httpx.HTTPTransport(local_address="127.0.0.2")) as c:
        k = 0
        while not done.is_set():
            k += 1
            try:
                c.put(f"/api/jobs/dos/ranks/0/parts/{1000 + 1000 * i + k % 1000}",
                      content=body, headers=AUTH)
            except httpx.HTTPError:
                pass


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(tmp: Path) -> tuple[subprocess.Popen, str]:
    """`stragglers monitor serve` in its own process (as deployed: the analysis in a process
    of its own), on a free port; (process, URL) once it answers."""
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    (tmp / "rules.yaml").write_text("settings: {window_steps: 10, stall_after_s: 600, "
                                    "durable: false}\n")
    with socket.socket() as k:
        k.bind(("127.0.0.1", 0))
        port = k.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                             str(tmp / "mon.db"), "--port", str(port), "--token-file",
                             str(token), "--config", str(tmp / "rules.yaml")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise SystemExit("the monitor did not start")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=10, help="parts per rank per block")
    ap.add_argument("--blocks", type=int, default=4, help="quiet/attacked block pairs per case")
    args = ap.parse_args()
    trace = slow_job(steps=5 * args.rounds, dp=2, pp=2)
    parts = [(r, p, table_bytes(c)) for r, p, c in parts_of(trace, steps_per_part=5)]
    cases = [("1,000 idle connections", lambda p, st: idle(p, 1000), False),
             ("200 half request heads", lambda p, st: half_heads(p, 200), False),
             ("32 slow 64 MiB bodies", lambda p, st: slow_bodies(p, 32, st), False),
             ("1,000 idle, a new connection per upload", lambda p, st: idle(p, 1000), True),
             ("4 clients: parts whose pages declare 1 GB",
              lambda p, st: flood(url, lying_part("lz4", 2, 1 << 30), 4, st), False),
             ("4 clients: 16 MiB bodies in a loop",
              lambda p, st: flood(url, b"x" * (16 << 20), 4, st), False)]
    url = ""   # (the flood cases read it when they start)
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = serve(Path(tmp))
        port = int(url.rsplit(":", 1)[1])
        try:
            with httpx.Client(base_url=url, timeout=60) as c:
                c.put("/api/jobs/dos/meta", json=trace.meta.to_dict(), headers=AUTH)
                for i in range(len(cases)):   # a job per block, each sent the same parts
                    for b in range(args.blocks):
                        for kind in "ql":
                            r = c.put(f"/api/jobs/run{i}-{b}-{kind}/meta",
                                      json=trace.meta.to_dict(), headers=AUTH)
                            assert r.status_code == 200, r.text
                c.put("/api/jobs/warm/meta", json=trace.meta.to_dict(), headers=AUTH)
            # warm up: the analysis process starts and imports the engine at the first windows
            uploads(url, "warm", parts, False)
            time.sleep(5)
            for i, (name, attack, fresh) in enumerate(cases):
                # quiet and attacked blocks alternated: this machine's load drifts by the
                # minute, so one quiet run before the attack compared different minutes
                quiet, loaded, blocks, service = [], [], [], 0.0
                for b in range(args.blocks):
                    q = uploads(url, f"run{i}-{b}-q", parts, fresh)
                    time.sleep(1)   # its windows analysed before the attack
                    stop = threading.Event()
                    socks = attack(port, stop)
                    time.sleep(0.5)
                    cpu0, t0 = cpu_s(proc.pid), time.perf_counter()
                    try:
                        got = uploads(url, f"run{i}-{b}-l", parts, fresh)
                    finally:
                        service += (cpu_s(proc.pid) - cpu0) / (time.perf_counter() - t0)
                        stop.set()
                        for k in socks:
                            k.close()
                    quiet += q
                    loaded += got
                    blocks.append(statistics.median(got) / statistics.median(q))
                    time.sleep(1)
                mq, ml = statistics.median(quiet), statistics.median(loaded)
                print(f"{name}: median upload {ml * 1e3:.2f} ms against {mq * 1e3:.2f} ms quiet "
                      f"({len(quiet)} uploads each, {args.blocks} blocks alternated): "
                      f"{ml / mq:.2f}x (blocks {min(blocks):.2f}-{max(blocks):.2f}; monitor "
                      f"{service / args.blocks:.2f} cores attacked; load "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
