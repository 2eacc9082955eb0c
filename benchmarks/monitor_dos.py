"""A well-behaved recorder's upload latency on the monitor, quiet and under connection DoS.

    python benchmarks/monitor_dos.py [--rounds 5] [--blocks 8]

The monitor runs as deployed (`stragglers monitor serve`, its own process). For each case the
same client (one keep-alive httpx connection, as the PartUploader keeps) uploads the same parts
(4 ranks x `rounds`) into a job of its own, one after the other, in `blocks` pairs of a quiet
block and a block under the case, alternated (quiet first in even pairs, attacked first in odd
ones, so a drift of the machine's load weighs on both alike). Cases: 1,000 idle TCP
connections; 200 connections sending half a request head; 32 slow bodies declaring 64 MiB each
(a byte a second); the same well-behaved client opening a new connection per upload while 1,000
idle connections are held (what the idle-eviction is for); 4 client processes of another
loopback address (another writer only by their job) uploading parts whose page headers declare
1 GB (refused 422 from the headers), or 16 MiB bodies in a loop (refused after their first MiB);
8 client processes reading /metrics, or /api/jobs, in a loop (no token: reads need none); and
the anonymous routes that answer without a store read or a render: 8 client processes asking
/health, an unknown path (404), the dashboard page, plotly.min.js (3.6 MB), one analysed window
or a request the app refuses (422), in a loop, and one process asking /health in a loop; and 2
client processes (the token's, another address) each sending its own job's meta.json changed
(48 KB: 2,000 small objects in `extra`, each value walked by the check) before every part.

What a loaded machine cannot fake (see `measured` and `verdict`): besides the ratio of medians,
each pair's own ratio (their median, and how many pass 2x), and for every request the time the
measured client's thread and the service's event-loop thread spent runnable but waiting for a
CPU (/proc/.../schedstat): the latency less that run-queue wait leaves out most of what the
machine's other load adds (not all: the service's other threads are not counted), and its
ratio is judged beside the raw one. Attacker processes run at nice 19 (`--attacker-nice`):
deployed, they run on other machines, and their own CPU here is not work the service does for
them. The client processes of cases 5-16 are started once per case and paused between its
blocks (their requests under way answered before a quiet block starts); their CPU and the
requests answered to them per second say how hard they pressed. The service's CPU (cores) in
quiet and attacked blocks says what the attack costs it.
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

from results import Figure, Run, write  # noqa: E402
from stragglers.trace.runformat import table_bytes  # noqa: E402

TOKEN = "benchmark-token-0123456"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


# ---- measuring on a shared machine (adapt_dos.py uses these too) ------------------------------

class Probe:
    """Run-queue wait (s) of the calling thread and of a service's main thread (its event
    loop, on every request's path, there and back): time runnable but not running, the delay
    a loaded machine adds (/proc/.../schedstat). The service's other threads are left out:
    their waits overlap (summed, they passed the wall time) and most serve no one measured."""

    def __init__(self, pid: int):
        self.paths = ["/proc/thread-self/schedstat", f"/proc/{pid}/task/{pid}/schedstat"]

    def waited(self) -> float:
        total = 0
        for path in self.paths:
            try:
                with open(path) as f:
                    total += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):   # the service is gone
                pass
        return total / 1e9


def timed(probe: Probe, fn) -> tuple[float, float]:
    """(latency, run-queue wait during it) of one call of `fn`."""
    w0 = probe.waited()
    t0 = time.perf_counter()
    fn()
    t1 = time.perf_counter()
    return t1 - t0, max(probe.waited() - w0, 0.0)


class Block:
    """One block's requests: latencies and run-queue waits (s), the service's CPU (cores) and
    the bytes it had the disk read and write per second (MB/s, /proc/<pid>/io: what neither
    CPU nor run-queue wait shows, the fsync of every commit waiting behind them)."""

    def __init__(self):
        self.lat: list[float] = []
        self.rq: list[float] = []
        self.cores = 0.0
        self.disk_mb_s = 0.0

    def own(self) -> list[float]:
        """Latencies less their run-queue wait."""
        return [max(a - b, 0.0) for a, b in zip(self.lat, self.rq)]


def disk_bytes(pid: int) -> int:
    """Bytes a process had the block layer read and write so far (/proc/<pid>/io)."""
    try:
        fields = dict(line.split(": ") for line in Path(f"/proc/{pid}/io").read_text().splitlines())
    except (OSError, ValueError):
        return 0
    return int(fields.get("read_bytes", 0)) + int(fields.get("write_bytes", 0))


def measured(quiet: list[Block], attacked: list[Block]) -> dict:
    """The case's figures from its alternated block pairs (see the module's docstring)."""
    med = statistics.median
    ql = [x for b in quiet for x in b.lat]
    al = [x for b in attacked for x in b.lat]
    qo = [x for b in quiet for x in b.own()]
    ao = [x for b in attacked for x in b.own()]
    pairs = [med(a.lat) / med(q.lat) for q, a in zip(quiet, attacked)]
    own_pairs = [med(a.own()) / max(med(q.own()), 1e-9) for q, a in zip(quiet, attacked)]
    return {"quiet_ms": med(ql) * 1e3, "attacked_ms": med(al) * 1e3,
            "ratio": med(al) / med(ql), "pair_median": med(pairs),
            "pairs_within_2x": sum(r <= 2 for r in pairs), "pairs": len(pairs),
            "pair_range": (min(pairs), max(pairs)),
            "own_quiet_ms": med(qo) * 1e3, "own_attacked_ms": med(ao) * 1e3,
            "own_ratio": med(ao) / max(med(qo), 1e-9), "own_pair_median": med(own_pairs),
            "rq_share_quiet": sum(b for x in quiet for b in x.rq) / sum(ql),
            "rq_share_attacked": sum(b for x in attacked for b in x.rq) / sum(al),
            "cores_quiet": statistics.mean(b.cores for b in quiet),
            "cores_attacked": statistics.mean(b.cores for b in attacked),
            "disk_quiet": statistics.mean(b.disk_mb_s for b in quiet),
            "disk_attacked": statistics.mean(b.disk_mb_s for b in attacked)}


def verdict(m: dict) -> tuple[bool | None, str]:
    """Met (raw and pair ratios within 2x), missed (past 2x even less the run-queue wait, by
    the ratio of medians and the pairs' median both), or not judgeable here (they disagree)."""
    if m["ratio"] <= 2 and m["pair_median"] <= 2:
        return True, "within 2x, raw"
    if m["own_ratio"] > 2 and m["own_pair_median"] > 2:
        return False, "past 2x even with the machine's run-queue wait taken out"
    return None, ("not settled here: the ratio of medians, the pairs' median and the same "
                  "less the run-queue wait disagree about 2x")


def line(name: str, m: dict) -> str:
    """One printed row of a case."""
    lo, hi = m["pair_range"]
    return (f"{name}: {m['attacked_ms']:.2f} ms against {m['quiet_ms']:.2f} ms quiet: "
            f"{m['ratio']:.2f}x (pairs: median {m['pair_median']:.2f}x, {lo:.2f}-{hi:.2f}, "
            f"{m['pairs_within_2x']}/{m['pairs']} within 2x); less run-queue wait "
            f"{m['own_attacked_ms']:.2f} / {m['own_quiet_ms']:.2f} ms: {m['own_ratio']:.2f}x "
            f"(pairs {m['own_pair_median']:.2f}x); run-queue share {m['rq_share_quiet']:.0%} "
            f"quiet, {m['rq_share_attacked']:.0%} attacked; service {m['cores_quiet']:.2f} -> "
            f"{m['cores_attacked']:.2f} cores, disk {m['disk_quiet']:.1f} -> "
            f"{m['disk_attacked']:.1f} MB/s; load {os.getloadavg()[0]:.1f}")


def figures(rows: dict[str, dict], what: str) -> list[Figure]:
    """results.py figures, one per case."""
    out = []
    for name, m in rows.items():
        met, why = verdict(m)
        out.append(Figure(
            name=f"{name}: {what} attacked / quiet",
            value=f"{m['ratio']:.2f}x (pairs {m['pair_median']:.2f}x, "
                  f"{m['pairs_within_2x']}/{m['pairs']} within 2x; less run-queue wait "
                  f"{m['own_ratio']:.2f}x)",
            goal="<= 2x", met=met,
            anchor=f"quiet blocks alternated with attacked ones: {m['quiet_ms']:.2f} ms quiet",
            note=f"{why}; run-queue share {m['rq_share_quiet']:.0%} quiet / "
                 f"{m['rq_share_attacked']:.0%} attacked; service {m['cores_quiet']:.2f} -> "
                 f"{m['cores_attacked']:.2f} cores, disk {m['disk_quiet']:.1f} -> "
                 f"{m['disk_attacked']:.1f} MB/s"))
    return out


def order(b: int) -> str:
    """The block order of pair `b`: quiet first, then attacked first (ABBA against drift)."""
    return "qa" if b % 2 == 0 else "aq"


# ---- the monitor's cases ----------------------------------------------------------------------

def uploads(url: str, job: str, bodies, fresh: bool, probe: Probe | None = None,
            block: Block | None = None) -> list[float]:
    """Latency (s) of each upload, over one keep-alive connection or a new one each time."""
    out = []
    client = None if fresh else httpx.Client(base_url=url, timeout=60)
    for rank, part, body in bodies:
        c = httpx.Client(base_url=url, timeout=60) if fresh else client
        got = []

        def put():
            got.append(c.put(f"/api/jobs/{job}/ranks/{rank}/parts/{part}", content=body,
                             headers=AUTH))
        if probe is not None:
            lat, rq = timed(probe, put)
        else:
            t0 = time.perf_counter()
            put()
            lat, rq = time.perf_counter() - t0, 0.0
        out.append(lat)
        if block is not None:
            block.lat.append(lat)
            block.rq.append(rq)
        assert got[0].status_code == 200, got[0].text
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


class Attackers:
    """Client processes of another address (127.0.0.2) running one request in a loop, started
    once per case and paused between its blocks (`go`), as adapt_dos.py's: started per block,
    their start-up (fork, a connection) fell inside the blocks, and the attack's weight varied
    from block to block. `inflight` counts requests under way (a quiet block starts without
    any), `served` those answered (the attack's rate is reported). Processes: threads here
    would take the measured client's interpreter lock."""

    def __init__(self, n: int, request: tuple, nice: int):
        self.go, self.stop = mp.Event(), mp.Event()
        self.inflight, self.served = mp.Value("i", 0), mp.Value("l", 0)
        self.procs = [mp.Process(target=attacker, args=(request, i, nice, self.go, self.stop,
                                                         self.inflight, self.served),
                                 daemon=True) for i in range(n)]
        for proc in self.procs:
            proc.start()
        self.started = False

    def resume(self) -> None:
        """Let the attack go on, and give it time to be under way (more the first time)."""
        self.go.set()
        time.sleep(1.0 if self.started else 3.0)
        self.started = True

    def pause(self) -> None:
        """Pause the attack; return once its requests under way are answered."""
        self.go.clear()
        deadline = time.monotonic() + 120
        while self.inflight.value and time.monotonic() < deadline:
            time.sleep(0.05)

    def cpu(self) -> float:
        """The attackers' CPU seconds so far."""
        return sum(cpu_s(p.pid) for p in self.procs if p.is_alive())

    def close(self) -> None:
        self.stop.set()
        self.go.set()
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()


def attacker(request: tuple, i: int, nice: int, go, stop, inflight, served) -> None:
    """One attacker process: `request` ("put", url, body) or ("get", url, path) in a loop while
    `go` is set."""
    os.nice(nice)   # (see the module's docstring)
    kind, url, what = request
    with httpx.Client(base_url=url, timeout=60,
                      transport=httpx.HTTPTransport(local_address="127.0.0.2")) as c:
        k = 0
        while not stop.is_set():
            if not go.wait(0.1):
                continue
            k += 1
            with inflight.get_lock():
                inflight.value += 1
            try:
                if kind == "put":
                    c.put(f"/api/jobs/dos/ranks/0/parts/{1000 + 1000 * i + k % 1000}",
                          content=what, headers=AUTH)
                elif kind == "meta":   # its job's meta.json changed, then a part
                    meta, bodies = what
                    meta["extra"]["note"] = k
                    c.put(f"/api/jobs/dosmeta{i}/meta", json=meta, headers=AUTH)
                    rank, part, body = bodies[k % len(bodies)]
                    c.put(f"/api/jobs/dosmeta{i}/ranks/{rank}/parts/{part}", content=body,
                          headers=AUTH)
                else:
                    c.get(what)   # no token: reads need none unless --private
                with served.get_lock():
                    served.value += 1
            except httpx.HTTPError:
                pass
            finally:
                with inflight.get_lock():
                    inflight.value -= 1


def busy_meta(meta: dict) -> dict:
    """A job's meta.json grown to 48 KB of small values in `extra` (within max_meta_bytes:
    a writer may send it), each walked by the monitor's check of a changed meta.json."""
    return {**meta, "extra": {**meta["extra"],
                              "tags": [{"k": i, "v": i * 0.5} for i in range(2000)]}}


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (/proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def serve(tmp: Path, read_interval_s: float | None = None) -> tuple[subprocess.Popen, str]:
    """`stragglers monitor serve` in its own process (as deployed: the analysis in a process
    of its own), on a free port; (process, URL) once it answers."""
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    token.chmod(0o600)
    pace = "" if read_interval_s is None else f", read_interval_s: {read_interval_s}"
    (tmp / "rules.yaml").write_text("settings: {window_steps: 10, stall_after_s: 600, "
                                    f"durable: false{pace}}}\n")
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
    ap.add_argument("--rounds", type=int, default=5, help="parts per rank per block")
    ap.add_argument("--blocks", type=int, default=8, help="quiet/attacked block pairs per case")
    ap.add_argument("--cases", default="", help="comma-separated case numbers (1-16; all)")
    ap.add_argument("--name", default=None, help="results file name (a path: written there, "
                    "not in benchmarks/results)")
    ap.add_argument("--attacker-nice", type=int, default=19, help="nice of the attacker "
                    "processes (cases 5-16); 0 where a busy machine leaves them no CPU at 19 "
                    "(then their CPU, taken from the service and the client, counts too)")
    ap.add_argument("--read-interval-s", type=float, default=None, help="the service's "
                    "read_interval_s (its default if not given; 0: reads not paced, the "
                    "baseline of cases 7-8)")
    args = ap.parse_args()
    trace = slow_job(steps=5 * args.rounds, dp=2, pp=2)
    parts = [(r, p, table_bytes(c)) for r, p, c in parts_of(trace, steps_per_part=5)]
    cases = [("1,000 idle connections", lambda p, st: idle(p, 1000), False),
             ("200 half request heads", lambda p, st: half_heads(p, 200), False),
             ("32 slow 64 MiB bodies", lambda p, st: slow_bodies(p, 32, st), False),
             ("1,000 idle, a new connection per upload", lambda p, st: idle(p, 1000), True),
             ("4 clients: parts whose pages declare 1 GB",
              (4, ("put", lying_part("lz4", 2, 1 << 30))), False),
             ("4 clients: 16 MiB bodies in a loop", (4, ("put", b"x" * (16 << 20))), False),
             ("8 clients: /metrics in a loop", (8, ("get", "/metrics")), False),
             ("8 clients: /api/jobs in a loop", (8, ("get", "/api/jobs")), False),
             ("8 clients: /health in a loop", (8, ("get", "/health")), False),
             ("8 clients: an unknown path (404) in a loop", (8, ("get", "/no/such/path")), False),
             ("8 clients: the dashboard page in a loop", (8, ("get", "/")), False),
             ("8 clients: plotly.min.js in a loop", (8, ("get", "/static/plotly.min.js")), False),
             ("8 clients: one window in a loop", (8, ("get", "/api/jobs/warm/windows/0")), False),
             ("8 clients: a refused read (422) in a loop",
              (8, ("get", "/api/alerts?limit=0")), False),
             ("1 client: /health in a loop", (1, ("get", "/health")), False),
             ("2 clients: a changed 48 KB meta.json before every part",
              (2, ("meta", (busy_meta(trace.meta.to_dict()), parts))), False)]
    chosen = [int(x) - 1 for x in args.cases.split(",") if x] or list(range(len(cases)))
    url = ""   # (the flood cases read it when they start)
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = serve(Path(tmp), args.read_interval_s)
        port = int(url.rsplit(":", 1)[1])
        probe = Probe(proc.pid)
        try:
            with httpx.Client(base_url=url, timeout=60) as c:
                c.put("/api/jobs/dos/meta", json=trace.meta.to_dict(), headers=AUTH)
                c.put("/api/jobs/warm/meta", json=trace.meta.to_dict(), headers=AUTH)
            # warm up: the analysis process starts and imports the engine at the first windows
            uploads(url, "warm", parts, False)
            time.sleep(5)
            for i in chosen:
                name, attack, fresh = cases[i]
                # a job per block, each sent the same parts (made case by case: all at once,
                # 15 cases passed the service's 120 new jobs a minute)
                with httpx.Client(base_url=url, timeout=60) as c:
                    for b in range(args.blocks):
                        for kind in "qa":
                            r = c.put(f"/api/jobs/run{i}-{b}-{kind}/meta",
                                      json=trace.meta.to_dict(), headers=AUTH)
                            assert r.status_code == 200, r.text
                quiet, attacked = [], []
                pool = None
                if isinstance(attack, tuple):   # client processes, paused between blocks
                    n, (verb, what) = attack
                    pool = Attackers(n, (verb, url, what), args.attacker_nice)
                spent = attacker_cpu = 0.0
                served = 0
                try:
                    for b in range(args.blocks):
                        for kind in order(b):
                            block = Block()
                            stop = threading.Event()
                            socks = []
                            if kind == "a" and pool is not None:
                                pool.resume()
                            elif kind == "a":
                                socks = attack(port, stop)
                                time.sleep(0.5)
                            cpu0, t0 = cpu_s(proc.pid), time.perf_counter()
                            io0 = disk_bytes(proc.pid)
                            a0 = pool.cpu() if pool and kind == "a" else 0.0
                            s0 = pool.served.value if pool else 0
                            try:
                                uploads(url, f"run{i}-{b}-{kind}", parts, fresh, probe, block)
                            finally:
                                took = time.perf_counter() - t0
                                block.cores = (cpu_s(proc.pid) - cpu0) / took
                                block.disk_mb_s = (disk_bytes(proc.pid) - io0) / took / 1e6
                                if pool is not None and kind == "a":
                                    attacker_cpu += pool.cpu() - a0
                                    served += pool.served.value - s0
                                    spent += took
                                stop.set()
                                for k in socks:
                                    k.close()
                            (attacked if kind == "a" else quiet).append(block)
                            if pool is not None and kind == "a":
                                pool.pause()
                            time.sleep(1)   # its windows analysed, the attack gone
                finally:
                    if pool is not None:
                        pool.close()
                rows[name] = measured(quiet, attacked)
                extra = ""
                if pool is not None:
                    rows[name].update(attacker_cores=attacker_cpu / max(spent, 1e-9),
                                      attack_per_s=served / max(spent, 1e-9))
                    extra = (f"; attackers {rows[name]['attacker_cores']:.2f} cores, "
                             f"{rows[name]['attack_per_s']:.0f} requests/s answered")
                print(line(name, rows[name]) + extra, flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)
    write(Run(benchmark="Monitor upload latency under connection DoS", issue="34",
              command=".venv/bin/python benchmarks/monitor_dos.py "
                      f"--rounds {args.rounds} --blocks {args.blocks}"
                      + (f" --cases {args.cases}" if args.cases else "")
                      + (f" --attacker-nice {args.attacker_nice}"
                         if args.attacker_nice != 19 else "")
                      + (f" --read-interval-s {args.read_interval_s:g}"
                         if args.read_interval_s is not None else ""),
              figures=figures(rows, "upload latency"),
              note=f"{os.cpu_count()} CPUs; {args.blocks} alternated quiet/attacked block "
                   f"pairs of {len(parts)} uploads per case"), args.name)


if __name__ == "__main__":
    main()
