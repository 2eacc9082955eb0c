"""The monitor on one PostgreSQL with two instances (issue 32 item 1), against SQLite, side by side.

    .venv/bin/python benchmarks/monitor_postgres.py [--quick] [--json out.json]

Starts a real PostgreSQL (initdb + pg_ctl in a temporary directory, as the tests do, but with
PostgreSQL's durable defaults: every commit flushed, as SQLite's store is) and real
`stragglers monitor serve` processes.

1. ingest: the same uploads (synthetic dp × pp jobs, recorder-style parts, the run format's
   bytes) from 16 client threads, each reply once the part is durable, to: one instance on
   SQLite (today's store, the baseline), one instance on PostgreSQL, two instances on one
   PostgreSQL (the uploads split between them). Records/s from the first upload to the last
   reply; the configurations run in turn, `--rounds` times, in alternating order.
   With --before: also the SQLite store's add_parts alone (3,200 parts in batches of 16, in
   this process, durable and not), the --before tree's store against this one, alternating.
2. takeover: 20 jobs streaming to two instances on one PostgreSQL (every job flushes a part per
   rank each round, the round's parts split between the instances); one instance is killed
   with -9 mid-run; the rest of the run goes to the survivor. Measured: the time from the kill
   until the survivor holds every lease; then, once every job closed, whether every step of
   every job was analysed in exactly one window (none twice, none lost), and how often each
   alert change reached a real webhook receiver on loopback.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "monitor"))

from monitor_jobs import parts_of, slow_job  # noqa: E402
from pg_cluster import PostgresCluster, why_not  # noqa: E402
from stragglers.trace.runformat import table_bytes  # noqa: E402


class Receiver:
    """A webhook receiver on loopback keeping every alert it is sent."""

    def __init__(self):
        self.alerts: list[tuple] = []
        lock, alerts = threading.Lock(), self.alerts

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                m = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    alerts.extend((a["fingerprint"], a["status"], a["startsAt"], a["endsAt"])
                                  for a in m["alerts"])
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


SRC: list = [None]   # the src/ folder whose monitor is measured (--src; None: this tree's)
NEW_SETTINGS = ("lease_s", "alert_claim_s", "change_detector")   # unknown to --before trees


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(db: str, tmp: Path, name: str, settings: dict, hook: str | None = None,
          src: Path | None = None):
    """A `stragglers monitor serve` process (of the code under `src`, default this tree's);
    (process, URL)."""
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(json.dumps({"settings": settings, "webhooks": [hook] if hook else [],
                               "rules": [{"name": "severe", "when": "slowdown >= 1.3",
                                          "severity": "critical"}]}))
    port = free_port()
    log = open(tmp / f"{name}.log", "w")
    env = {**os.environ, "PYTHONPATH": str(src)} if src else None
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db", db,
                             "--port", str(port), "--config", str(cfg), "--data-dir",
                             str(tmp / "shared")], cwd=src.parent if src else REPO,
                            stdout=log, stderr=log, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{name} did not start (see {tmp / (name + '.log')})")


def stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def meta(trace, job: str, end: bool = False) -> dict:
    m = trace.meta.to_dict()
    m["name"] = job
    m["extra"]["clock"] = {"start": 1000.0, **({"end": 2000.0} if end else {})}
    return m


def workload(jobs: int, steps: int, spp: int, seed: int = 0, dp: int = 2, pp: int = 2):
    """(job → trace, job → [(rank, part, bytes, records)]) of synthetic dp × pp jobs."""
    traces = {f"job{i:02d}": slow_job(steps=steps, dp=dp, pp=pp,
                                      slow=(i % dp, pp - 1, 2.0 + (i % 3)), seed=seed + i)
              for i in range(jobs)}
    parts = {j: [(r, p, table_bytes(c), len(c["step"])) for r, p, c in parts_of(t, spp)]
             for j, t in traces.items()}
    return traces, parts


def bench_ingest(tmp: Path, cluster: PostgresCluster, kind: str, traces, parts,
                 settings: dict, before: Path | None = None) -> dict:
    """Uploads of every part from 16 threads to `kind` (sqlite | pg1 | pg2, or sqlite-before:
    the SQLite monitor of the source tree `before`, without leases); records/s."""
    run = tmp / f"ingest-{kind}-{time.monotonic_ns()}"
    (run / "shared").mkdir(parents=True)
    src = SRC[0]
    if kind == "sqlite-before":
        src = before
        settings = {k: v for k, v in settings.items() if k not in NEW_SETTINGS}
    if kind.startswith("sqlite"):
        db = str(run / "mon.db")
    else:
        db = cluster.create_schema(run.name.replace("-", "_"))
    procs = [serve(db, run, f"i{n}", settings, src=src)
             for n in range(2 if kind == "pg2" else 1)]
    urls = [u for _, u in procs]
    clients = [httpx.Client(base_url=u, timeout=120) for u in urls]
    try:
        for i, (job, trace) in enumerate(traces.items()):
            assert clients[i % len(clients)].put(f"/api/jobs/{job}/meta",
                                                 json=meta(trace, job)).status_code == 200
        todo = [(job, *p) for job, ps in parts.items() for p in ps]

        def put(k):
            job, rank, part, body, _ = todo[k]
            r = clients[k % len(clients)].put(f"/api/jobs/{job}/ranks/{rank}/parts/{part}",
                                              content=body)
            assert r.status_code == 200, r.text

        t0 = time.perf_counter()
        with cf.ThreadPoolExecutor(16) as pool:
            list(pool.map(put, range(len(todo))))
        elapsed = time.perf_counter() - t0
        records = sum(p[4] for p in todo)
        return {"kind": kind, "parts": len(todo), "records": records, "seconds": elapsed,
                "records_per_s": records / elapsed}
    finally:
        for c in clients:
            c.close()
        stop([p for p, _ in procs])


def bench_store(before: Path, durable: bool, runs: int = 6) -> dict:
    """add_parts of the SQLite store of the `before` tree and of this one, alternating."""
    import importlib.util

    from stragglers.monitor.store_sqlite import SQLiteStore

    spec = importlib.util.spec_from_file_location(
        "store_before", before / "stragglers" / "monitor" / "store.py")
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)

    def run(cls) -> float:
        with tempfile.TemporaryDirectory() as d:
            s = cls(Path(d) / "s.db", durable=durable)
            for j in range(8):
                s.register_job(f"job{j}", f"/r/{j}", "http", {"world_size": 8})
            n, t0 = 0, time.perf_counter()
            for _ in range(200):
                rows = []
                for _ in range(16):
                    p = n // 64
                    rows.append((f"job{n % 8}", (n // 8) % 8, p, 176, p * 8, p * 8 + 7, 9000,
                                 "http", "d"))
                    n += 1
                s.add_parts(rows)
            took = time.perf_counter() - t0
            s.close()
            return took

    times = {"before": [], "now": []}
    for i in range(runs):
        order = (("before", old.Store), ("now", SQLiteStore))
        for name, cls in order if i % 2 == 0 else order[::-1]:
            times[name].append(run(cls))
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"durable": durable, "parts": 3200, "seconds": times, "median_s": med,
            "now_over_before": med["now"] / med["before"]}


def bench_takeover(tmp: Path, cluster: PostgresCluster, jobs: int, steps: int, spp: int,
                   settings: dict, round_s: float) -> dict:
    """Two instances, `jobs` jobs streaming, kill -9 of one mid-run (see the module doc)."""
    import psycopg

    run = tmp / "takeover"
    (run / "shared").mkdir(parents=True)
    db_url = cluster.create_schema("takeover")
    hook = Receiver()
    (a, url_a), (b, url_b) = (serve(db_url, run, n, settings, hook.url, SRC[0])
                              for n in ("a", "b"))
    db = psycopg.connect(db_url, autocommit=True)
    traces, parts = workload(jobs, steps, spp, seed=100)
    ca, cb = httpx.Client(base_url=url_a, timeout=120), httpx.Client(base_url=url_b, timeout=120)
    try:
        for i, (job, trace) in enumerate(traces.items()):
            assert (ca, cb)[i % 2].put(f"/api/jobs/{job}/meta",
                                       json=meta(trace, job)).status_code == 200
        rounds = max(p for ps in parts.values() for _, p, _, _ in ps) + 1   # parts per rank
        by_round = [[(job, r, p, body) for job, ps in parts.items() for r, p, body, _ in ps
                     if p == k] for k in range(rounds)]
        live = [ca, cb]
        killed_at = None
        a_jobs, took = [], {}
        b_id = cb.get("/health").json()["instance"]

        def watch_leases():
            """From the kill on, every 20 ms: when does B hold every lease?"""
            with psycopg.connect(db_url, autocommit=True) as w:
                while True:
                    owners = dict(w.execute("SELECT job, owner FROM leases").fetchall())
                    if all(o == b_id for o in owners.values()):
                        took["s"] = time.monotonic() - killed_at
                        return
                    time.sleep(0.02)
        for k, batch in enumerate(by_round):
            t_round = time.monotonic()
            if k == rounds // 2:
                owners = dict(db.execute("SELECT job, owner FROM leases").fetchall())
                a_id = ca.get("/health").json()["instance"]
                a_jobs = sorted(j for j, o in owners.items() if o == a_id)
                os.kill(a.pid, signal.SIGKILL)
                a.wait()
                killed_at = time.monotonic()
                watcher = threading.Thread(target=watch_leases, daemon=True)
                watcher.start()
                live = [cb]
            for n, (job, r, p, body) in enumerate(batch):
                c = live[n % len(live)]
                assert c.put(f"/api/jobs/{job}/ranks/{r}/parts/{p}",
                             content=body).status_code == 200
            time.sleep(max(0.0, round_s - (time.monotonic() - t_round)))
        watcher.join(timeout=120)
        takeover_s = took.get("s")
        for job, trace in traces.items():
            assert cb.put(f"/api/jobs/{job}/meta", json=meta(trace, job, end=True)
                          ).status_code == 200
        all_steps = {j: sorted(set(np.unique(t.ops["step"]).tolist())) for j, t in
                     traces.items()}
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            counted = {j: sum(len(json.loads(s)) for (s,) in db.execute(
                "SELECT steps FROM windows WHERE job = %s", (j,)).fetchall()) for j in traces}
            undelivered = db.execute("SELECT COUNT(*) FROM alert_outbox WHERE delivered_at "
                                     "IS NULL").fetchone()[0]
            if all(counted[j] >= len(all_steps[j]) for j in traces) and not undelivered:
                break
            time.sleep(0.2)
        exact, windows = 0, 0
        for job in traces:
            rows = db.execute("SELECT idx, steps FROM windows WHERE job = %s ORDER BY idx",
                              (job,)).fetchall()
            windows += len(rows)
            steps = [s for _, st in rows for s in json.loads(st)]
            exact += [i for i, _ in rows] == list(range(len(rows))) and steps == all_steps[job]
        outbox = db.execute("SELECT fingerprint, status, attempts FROM alert_outbox").fetchall()
        keys = hook.alerts
        return {"jobs": jobs, "parts": sum(len(p) for p in parts.values()),
                "jobs_held_by_killed": len(a_jobs), "lease_s": settings["lease_s"],
                "takeover_s": takeover_s, "windows": windows,
                "jobs_every_step_once": exact, "alert_changes": len(outbox),
                "alerts_received": len(keys), "alerts_distinct": len(set(keys)),
                "alerts_missing": len(outbox) - len(set(keys)),
                "alerts_twice": len(keys) - len(set(keys)),
                "messages_claimed_again": sum(1 for *_, n in outbox if n > 1)}
    finally:
        ca.close()
        cb.close()
        db.close()
        stop([a, b])
        hook.server.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    ap.add_argument("--rounds", type=int, default=2, help="ingest runs per configuration")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--before", type=Path, default=None, help="the src/ folder of an earlier "
                    "tree (git archive COMMIT src | tar -x -C DIR): its SQLite monitor is run "
                    "side by side as `sqlite-before`")
    ap.add_argument("--src", type=Path, default=None, help="the src/ folder whose monitor is "
                    "measured (a snapshot: git archive HEAD src | tar -x -C DIR), so that edits "
                    "to this tree during the run do not change what runs")
    ap.add_argument("--only", choices=("ingest", "takeover"), default=None)
    args = ap.parse_args()
    SRC[0] = args.src
    reason = why_not()
    if reason:
        sys.exit(f"monitor_postgres: {reason}")
    # the fast change detector (item 2) off: this measures the store, the leases and the
    # outbox, which the --before tree's SQLite monitor lacks, not the detector, which it lacks too
    settings = {"window_steps": 4, "stall_after_s": 600, "tick_s": 0.1, "lease_s": 3.0,
                "alert_claim_s": 5.0, "repeat_s": 36000, "change_detector": False}
    # durable: every commit flushed, as SQLite's (synchronous=FULL) is
    cluster = PostgresCluster().start(durable=True)
    tmp = Path(tempfile.mkdtemp(prefix="stragglers-bench-pg-"))
    out = {"date": time.strftime("%Y-%m-%d"), "settings": settings, "ingest": []}
    try:
        n_jobs, steps = (4, 16) if args.quick else (8, 48)
        traces, parts = workload(n_jobs, steps, spp=8, dp=4, pp=2)
        kinds = ["sqlite", "pg1", "pg2"] + (["sqlite-before"] if args.before else [])
        for r in range(args.rounds if args.only != "takeover" else 0):
            for kind in (kinds if r % 2 == 0 else kinds[::-1]):
                res = bench_ingest(tmp, cluster, kind, traces, parts, settings, args.before)
                out["ingest"].append(res)
                print(f"ingest {kind:6s}: {res['parts']} parts, {res['records']} records in "
                      f"{res['seconds']:.2f} s = {res['records_per_s']:,.0f} records/s",
                      flush=True)
        if args.before and args.only != "takeover":
            out["store"] = [bench_store(args.before, durable) for durable in (False, True)]
            for st in out["store"]:
                how = "durable" if st["durable"] else "no fsync"
                print(f"store add_parts of 3,200 parts ({how}): before "
                      f"{st['median_s']['before']:.3f} s, now {st['median_s']['now']:.3f} s "
                      f"({st['now_over_before']:.2f}x)", flush=True)
        if out["ingest"]:
            med = {k: float(np.median([x["records_per_s"] for x in out["ingest"]
                                       if x["kind"] == k])) for k in kinds}
            out["ingest_median"] = med
            print("ingest median records/s: " + ", ".join(f"{k} {v:,.0f}" for k, v in
                                                          med.items())
                  + "; " + ", ".join(f"{k}/sqlite {med[k] / med['sqlite']:.2f}" for k in kinds
                                     if k != "sqlite"), flush=True)
        if args.only != "ingest":
            tk = bench_takeover(tmp, cluster, 8 if args.quick else 20,
                                16 if args.quick else 32, 2, settings, round_s=0.5)
            out["takeover"] = tk
            print("takeover: " + json.dumps(tk), flush=True)
    finally:
        cluster.stop()
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    if not args.before and not args.src:  # a tree outside the repository is not a page figure
        write_results(out, args)


def write_results(out: dict, args: argparse.Namespace) -> None:
    """The takeover against its bound and the ingest rates side by side."""
    from results import Figure, Run, write

    figures = []
    tk = out.get("takeover")
    if tk:
        bound = tk["lease_s"] * 4 / 3
        figures += [Figure(name="takeover: one of two instances killed (-9), the survivor holds "
                                "every lease", value=f"{tk['takeover_s']:.2f} s",
                           goal=f"≤ lease_s + lease_s/3 = {bound:.1f} s",
                           met=tk["takeover_s"] <= bound),
                    Figure(name=f"{tk['jobs']} jobs through the takeover: jobs with every step in "
                                "exactly one window / alerts twice / lost",
                           value=f"{tk['jobs_every_step_once']} of {tk['jobs']} / "
                                 f"{tk['alerts_twice']} / {tk['alerts_missing']}",
                           goal="every step once, no alert lost or doubled",
                           met=tk["jobs_every_step_once"] == tk["jobs"] and tk["alerts_twice"] == 0
                           and tk["alerts_missing"] == 0)]
    med = out.get("ingest_median")
    if med:
        figures.append(Figure(
            name=f"ingest, PostgreSQL one instance / two instances (median of {args.rounds} rounds)",
            value=f"{med['pg1'] / med['sqlite']:.2f}× / {med['pg2'] / med['sqlite']:.2f}× SQLite's "
                  f"{med['sqlite']:,.0f} records/s", anchor="SQLite, one instance, same run",
            note="two instances on one machine share its cores; the design is for separate hosts"))
    write(Run(benchmark="The monitor on PostgreSQL, two instances", issue="32",
              command=f".venv/bin/python benchmarks/monitor_postgres.py --rounds {args.rounds}"
                      + (f" --only {args.only}" if args.only else "")
                      + (" --quick" if args.quick else ""), figures=figures))


if __name__ == "__main__":
    main()
