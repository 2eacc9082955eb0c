"""The live monitor's alerting speed and silence: time to alert at 1 step/s with 1,024 ranks.

    .venv/bin/python benchmarks/monitor_time_to_alert.py [--ranks 1024] [--steps 120]
        [--clean-ranks 256] [--stall-after 10] [--flush-every 1] [--quick] [--json out.json]

A `stragglers monitor serve` process (as users run it: the analysis process on, default alert
rules) watches two run directories that this script writes as recorders do, one part per rank
per step (each part flushed at the end of its step), in real time at 1 step/s; with
`--flush-every k`, one part per rank every k steps, flushed at the end of its last step (the
recorder's `flush_interval_s` = k steps: k times fewer parts, and a step's values reach the
monitor up to k − 1 steps later, which the time to alert includes):

- job `big`, `--ranks` data-parallel ranks: from step 30, every 4 steps another rank turns
  1.5× slower for 24 steps (its compute; so the others wait for it at the all-reduce), then
  recovers: each onset is one trial;
- job `clean`, `--clean-ranks` ranks with the same noise and no slowdown.

Noise (both jobs): per rank and step, the compute time is lognormal (σ 3 %) around a per-rank
level (±5 %), times a factor per step shared by all ranks (σ 5 %, a longer batch), plus a
GC-like pause (+20-60 %) in 2 % of rank-steps. Each rank-step is a compute op and a gradient
all-reduce that ends when the step's slowest rank arrives (the shape `stragglers analyze`
gives per-worker step times).

Measured: time to alert = a webhook receiver's arrival time of the fast detector's
`rank_slowdown` alert for the rank, less the wall time its first slow step began (onset),
split into the steps the detector needed (onset to the step that decided it, from the alert's
text: data, not this machine) and the monitor's latency (that step's parts flushed → webhook);
the same to the window analysis' `worker_fault` alert naming the rank (default rules: 2
windows of 10 steps); false alerts = fast alerts of ranks never slowed in `big` or of any rank
of `clean` (the window rules' alerts on `clean` are listed apart: its GC-like pauses do cost
it time, which the what-if analysis says); the monitor's ingest lag, scraped every second. Dead-man: at the end `clean` stops while `big` goes on without one rank for
`--stall-after` + 8 s: the delays of the `stalled` (job) and `rank_silent` (rank) alerts after
their last part, against stall_after_s. The writer's own lag (how late each step's parts were
flushed) is reported: figures hold only when it stays well under a second. Parts are encoded
ahead into a folder nobody watches and renamed into the run directory at their step.

--overhead: the change detector's cost on ingest alone, 256 ranks × 40 watched parts by a
monitor in this process with and without it, alternated 3 times (ratio of seconds to idle).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from stragglers.trace.model import COLUMNS, OPTYPE_CODES, JobMeta  # noqa: E402
from stragglers.trace.runformat import rank_file_name, write_meta, write_rank  # noqa: E402

FIRST_ONSET, EVERY, SLOW_FOR, FACTOR = 30, 4, 24, 1.5


class Receiver:
    """A webhook receiver: (arrival time, alert) of every alert posted to it."""

    def __init__(self):
        got = self.got = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                now = time.time()
                got.extend((now, a) for a in body["alerts"])
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def first(self, name: str, job: str, rank: int | None = None, status="firing"):
        """(arrival time, alert) of the first such alert ((None, None): none came)."""
        for t, a in list(self.got):
            lab = a["labels"]
            if lab["alertname"] == name and lab["job"] == job and a["status"] == status and \
                    (rank is None or lab.get("rank") == str(rank)):
                return t, a
        return None, None


class Job:
    """An emulated data-parallel job: its noise, its slow ranks, its parts step by step."""

    def __init__(self, root: Path, name: str, ranks: int, seed: int, slow: dict[int, tuple]):
        self.dir, self.ranks, self.slow = root / name, ranks, slow
        self.staging = root.parent / "staging" / name
        self.rng = np.random.default_rng(seed)
        self.level = 0.8 * np.exp(self.rng.normal(0, 0.05, ranks))
        self.clock = 0.0
        self.renamed: dict[int, float] = {}   # rank → when its latest part was renamed in
        meta = JobMeta(name=name, dp_size=ranks, pp_size=1, extra={"layout": [
            {"rank": r, "dp_rank": r, "stage": 0, "host": f"node{r // 8}"}
            for r in range(ranks)]})
        write_meta(self.dir, meta)

    def step_ops(self, step: int) -> dict[str, np.ndarray]:
        """Every rank's ops of one step (a compute op, then the all-reduce to the step's end)."""
        n, rng = self.ranks, self.rng
        busy = self.level * np.exp(rng.normal(0, 0.05) + rng.normal(0, 0.03, n))
        busy *= 1 + (rng.random(n) < 0.02) * rng.uniform(0.2, 0.6, n)
        for rank, (first, last) in self.slow.items():
            if first <= step < last:
                busy[rank] *= FACTOR
        span = float(busy.max()) + 0.05
        start, self.clock = self.clock, self.clock + span
        ranks = np.arange(n)
        ops = {"rank": np.tile(ranks, 2), "dp_rank": np.tile(ranks, 2),
               "stage": np.zeros(2 * n), "step": np.full(2 * n, step),
               "optype": np.repeat([OPTYPE_CODES["forward-compute"],
                                    OPTYPE_CODES["grads-all-reduce"]], n),
               "start_ts": np.concatenate([np.full(n, start), start + busy]),
               "duration": np.concatenate([busy, span - busy]),
               "seq_id": np.zeros(2 * n), "mb_id": np.concatenate([np.zeros(n), -np.ones(n)]),
               "mc": np.zeros(2 * n), "gmc": np.zeros(2 * n)}
        return {k: np.asarray(v).astype(COLUMNS[k]) for k, v in ops.items()}

    def prepare(self, steps: int, pool: ThreadPoolExecutor, every: int = 1) -> None:
        """Every rank's part of every `every` steps (part number = first step // every),
        written ahead into a folder nobody watches (this machine cannot encode a thousand
        parts a second besides running the monitor)."""
        n = self.ranks
        for first in range(0, steps, every):
            blocks = [self.step_ops(step) for step in range(first, min(first + every, steps))]
            ops = {k: np.concatenate([b[k] for b in blocks]) for k in blocks[0]}
            rows = np.arange(len(ops["rank"]))

            def one(rank: int):
                sel = rows[ops["rank"] == rank]
                write_rank(self.staging, rank, {k: v[sel] for k, v in ops.items()},
                           part=first // every)

            list(pool.map(one, range(n)))

    def flush_step(self, step: int, skip: set = frozenset(), every: int = 1) -> None:
        """At the end of a step that ends a part (every `every` steps), each rank's part into
        the run directory, by a rename, as the recorder writes its parts."""
        if (step + 1) % every:
            return
        for rank in range(self.ranks):
            if rank not in skip:
                name = rank_file_name(rank, step // every)
                os.rename(self.staging / name, self.dir / name)
                self.renamed[rank] = time.time()


def start_monitor(tmp: Path, receiver: Receiver, stall_after: float) -> tuple:
    port = _free_port()
    cfg = tmp / "monitor.yaml"
    cfg.write_text(f"settings: {{window_steps: 10, stall_after_s: {stall_after}, "
                   # rescans re-queue every part not stored yet: behind by more than rescan_s,
                   # the watcher multiplied its queue (99,000 items for 34,000 parts)
                   f"tick_s: 0.5, rescan_s: 3600}}\nwebhooks: [\"{receiver.url}\"]\n")
    proc = subprocess.Popen([sys.executable, "-m", "stragglers.monitor", "serve", "--db",
                             str(tmp / "mon.db"), "--port", str(port), "--config", str(cfg),
                             "--watch", str(tmp / "runs")], cwd=REPO,
                            stdout=open(tmp / "monitor.log", "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    raise SystemExit("the monitor did not start (see monitor.log)")


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of the monitor process and of its children (the analysis
    process) so far."""
    import psutil

    main = psutil.Process(pid)
    out = {"service": sum(main.cpu_times()[:2]), "children": 0.0}
    for child in main.children(recursive=True):
        try:
            out["children"] += sum(child.cpu_times()[:2])
        except psutil.NoSuchProcess:
            pass
    return out


def _starts(alert: dict | None, since: float) -> float | None:
    """Seconds from `since` to the alert's startsAt (when the monitor decided it)."""
    if alert is None:
        return None
    from datetime import datetime
    return datetime.fromisoformat(alert["startsAt"].replace("Z", "+00:00")).timestamp() - since


def percentile(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def run(args) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="smon-alert-"))
    (tmp / "runs").mkdir()
    rng = np.random.default_rng(1)
    onsets = list(range(FIRST_ONSET, args.steps - SLOW_FOR, EVERY))
    slow_ranks = rng.choice(args.ranks, len(onsets), replace=False).tolist()
    slow = {int(r): (s, s + SLOW_FOR) for r, s in zip(slow_ranks, onsets)}
    silent_rank = next(r for r in range(args.ranks) if r not in slow)
    receiver = Receiver()
    k = args.flush_every
    if args.steps % k:
        raise SystemExit(f"--steps ({args.steps}) must be a multiple of --flush-every ({k})")
    tail = -(-int(args.stall_after / args.step_s + 8) // k) * k   # whole parts
    big = Job(tmp / "runs", "big", args.ranks, 2, slow)
    clean = Job(tmp / "runs", "clean", args.clean_ranks, 3, {})
    pool = ThreadPoolExecutor(4)
    t = time.time()
    big.prepare(args.steps + tail, pool, k)
    clean.prepare(args.steps, pool, k)
    print(f"parts written ahead in {time.time() - t:.0f} s", file=sys.stderr)
    proc, url = start_monitor(tmp, receiver, args.stall_after)
    cpu0 = process_cpu(proc.pid)   # its start (imports) left out
    began, lag, lag_seen = {}, [], []
    dt = args.step_s
    stop = threading.Event()

    def scrape():   # the monitor's own ingest lag, every second
        while not stop.wait(1.0):
            try:
                text = httpx.get(url + "/metrics", timeout=5).text
            except httpx.HTTPError:
                continue
            m = re.search(r"^stragglers_ingest_lag_seconds (\S+)$", text, re.M)
            if m:
                lag_seen.append(float(m[1]))

    threading.Thread(target=scrape, daemon=True).start()
    t0 = time.time() + 2.0
    try:
        for step in range(args.steps + tail):
            # step `step` runs over [t0 + step dt, t0 + (step + 1) dt); its parts are flushed
            # at its end
            began[step] = t0 + step * dt
            time.sleep(max(0.0, t0 + (step + 1) * dt - time.time()))
            if step < args.steps:
                clean.flush_step(step, every=k)
                big.flush_step(step, every=k)
            else:   # the end: `clean` falls silent, `big` goes on without one rank
                big.flush_step(step, skip={silent_rank}, every=k)
            if step == args.steps - 1:   # the dead-man counts from each one's own last part
                clean_last = max(clean.renamed.values())
                big_rank_last = big.renamed[silent_rank]
            lag.append(time.time() - (t0 + (step + 1) * dt))
        # the dead-man alerts: wait for them (the monitor may be behind its ingest)
        deadline = time.time() + args.stall_after + 120
        while time.time() < deadline and None in (receiver.first("stalled", "clean")[0],
                                                  receiver.first("rank_silent", "big")[0]):
            time.sleep(0.5)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        cpu = {name: sec - cpu0[name] for name, sec in process_cpu(proc.pid).items()}
    finally:
        stop.set()
        proc.terminate()
        proc.wait(30)
        pool.shutdown()
    fast, window, steps_to_decide, pipeline = [], [], [], []
    for rank, (first, _) in slow.items():
        t, alert = receiver.first("rank_slowdown", "big", rank)
        fast.append(None if t is None else t - began[first])
        if alert is not None:
            # the step whose arrival decided it (data), and how long after that step's parts
            # were flushed the webhook got it (the monitor's latency at this load)
            decided = int(re.search(r"decided at step (\d+)",
                                    alert["annotations"]["description"])[1])
            steps_to_decide.append(decided - first + 1)
            flushed = (decided // k) * k + k - 1   # the step whose end flushed its part
            pipeline.append(t - (began[flushed] + dt))
        t, _ = receiver.first("worker_fault", "big", rank)
        window.append(None if t is None else t - began[first])
    false_fast = sorted({a["labels"].get("rank") for _, a in receiver.got
                         if a["labels"]["alertname"] == "rank_slowdown" and a["status"] ==
                         "firing" and int(a["labels"].get("rank", -1)) not in slow})
    clean_alerts = sorted({(a["labels"]["alertname"], a["labels"].get("rank", ""))
                           for _, a in receiver.got if a["labels"]["job"] == "clean"
                           and a["labels"]["alertname"] != "stalled"})
    stalled, stalled_alert = receiver.first("stalled", "clean")
    silent, silent_alert = receiver.first("rank_silent", "big", silent_rank)
    got_fast = [x for x in fast if x is not None]
    got_window = [x for x in window if x is not None]
    return {
        "ranks": args.ranks, "clean_ranks": args.clean_ranks, "steps": args.steps,
        "trials": len(slow), "step_s": args.step_s, "flush_every": k,
        "fast_alerted": len(got_fast), "fast_median_s": percentile(got_fast, 50),
        "fast_p90_s": percentile(got_fast, 90), "fast_max_s": max(got_fast, default=None),
        "steps_to_decide": steps_to_decide,
        "pipeline_median_s": percentile(pipeline, 50), "pipeline_p90_s": percentile(pipeline, 90),
        "ingest_lag_max_s": max(lag_seen, default=None),
        "window_alerted": len(got_window), "window_median_s": percentile(got_window, 50),
        "window_p90_s": percentile(got_window, 90),
        "false_fast_alerts_big": false_fast,
        # the window rules' alerts on `clean` are listed apart: its GC-like pauses do cost it
        # time (each one holds a step's all-reduce), which the what-if analysis reports
        "fast_alerts_on_clean_job": [a for a in clean_alerts if a[0] == "rank_slowdown"],
        "other_alerts_on_clean_job": [a for a in clean_alerts if a[0] != "rank_slowdown"],
        "stall_after_s": args.stall_after,
        "stalled_delay_s": None if stalled is None else stalled - clean_last,
        "rank_silent_delay_s": None if silent is None else silent - big_rank_last,
        # the same split at the alert's startsAt (the monitor's decision, on this host's clock):
        # decided after the last part, then delivered (stored, posted, received)
        "stalled_decided_s": _starts(stalled_alert, clean_last),
        "rank_silent_decided_s": _starts(silent_alert, big_rank_last),
        "writer_lag_median_s": statistics.median(lag), "writer_lag_max_s": max(lag),
        # CPU per part (load-independent, unlike the times): the service process (watcher,
        # ingest, change detector, store) and its analysis process (read-ahead, windows)
        # (per part the monitor stored by the end: one far behind has not stored them all)
        "parts_written": args.ranks * (args.steps + tail) // k - tail // k
        + args.clean_ranks * args.steps // k,
        "parts_stored": (stored := int(sum(float(line.split(" ")[-1]) for line in
                                           metrics.splitlines() if line.startswith(
                                               "stragglers_parts_ingested_total")))),
        "cpu_us_per_part": {name: round(sec / max(stored, 1) * 1e6)
                            for name, sec in cpu.items()},
        "monitor_health": {line.split(" ")[0]: float(line.split(" ")[-1])
                           for line in metrics.splitlines() if line.startswith((
                               "stragglers_ingest_lag_seconds",
                               "stragglers_queue_depth",
                               "stragglers_alert_notifications_total",
                               "stragglers_store_errors_total"))},
        "tmp": str(tmp)}


def overhead(ranks: int, steps: int, rounds: int) -> dict:
    """Ingest of `ranks` × `steps` watched parts by a monitor in this process with and without
    the change detector, alternated `rounds` times (no window closes: ingest and detection
    alone); seconds until idle, and their ratio."""
    from stragglers.monitor.service import Monitor, PartIn
    from stragglers.monitor.settings import MonitorConfig
    from stragglers.monitor.store import open_store

    tmp = Path(tempfile.mkdtemp(prefix="smon-overhead-"))
    job = Job(tmp / "runs", "o", ranks, 4, {})
    with ThreadPoolExecutor(4) as pool:
        job.prepare(steps, pool)
    for step in range(steps):
        job.flush_step(step)
    meta = json.loads((job.dir / "meta.json").read_text())
    times: dict[str, list[float]] = {"without": [], "with": []}
    for i in range(rounds):
        for label in ("without", "with"):
            store = open_store(str(tmp / f"{label}{i}.db"))
            cfg = MonitorConfig(change_detector=label == "with", window_steps=100_000,
                                stall_after_s=3600, tick_s=0.5)
            mon = Monitor(store, cfg, data_dir=tmp / f"up{label}{i}").start()
            mon.register_job("o", job.dir, "files", meta)
            t = time.perf_counter()
            for step in range(steps):
                for rank in range(ranks):
                    mon.submit(PartIn("o", rank, step, "files",
                                      path=job.dir / rank_file_name(rank, step)))
            mon.wait_idle(600)
            times[label].append(time.perf_counter() - t)
            mon.stop()
            store.close()
    ratio = [w / wo for w, wo in zip(times["with"], times["without"])]
    return {"parts": ranks * steps, "seconds": times, "ratio_with_to_without": ratio,
            "median_ratio": statistics.median(ratio)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--clean-ranks", type=int, default=256)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--stall-after", type=float, default=10.0)
    ap.add_argument("--step-s", type=float, default=1.0, help="seconds per step")
    ap.add_argument("--flush-every", type=int, default=1, help="steps per part (the "
                    "recorder's flush_interval_s in steps)")
    ap.add_argument("--quick", action="store_true", help="256 ranks, 90 steps")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--overhead", action="store_true", help="only the change detector's cost "
                    "on ingest: 256 ranks x 40 watched parts with and without it, 3 rounds")
    args = ap.parse_args()
    if args.overhead:
        print(json.dumps(overhead(256, 40, 3), indent=1))
        return
    if args.quick:
        args.ranks, args.clean_ranks, args.steps = 256, 64, 90
    out = run(args)
    text = json.dumps(out, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    write_results(out, args)


def write_results(out: dict, args: argparse.Namespace) -> None:
    """Time to alert, false alerts and the dead-man's delays against issue 32's goals."""
    from results import Figure, Run, write

    def sec(x) -> str:
        return "–" if x is None else f"{x:.1f} s"

    def ms(x) -> str:   # the dead-man's delays differ from stall_after_s by milliseconds
        return "–" if x is None else f"{x:.3f} s"

    at_goal = out["ranks"] >= 1024 and out["step_s"] <= 1.0
    false = len(out["false_fast_alerts_big"]) + len(out["fast_alerts_on_clean_job"])
    late = [x for x in (out["stalled_delay_s"], out["rank_silent_delay_s"]) if x is not None]
    write(Run(benchmark="Live monitor: time to alert and silence", issue="32",
              command=f".venv/bin/python benchmarks/monitor_time_to_alert.py --ranks {out['ranks']} "
                      f"--clean-ranks {out['clean_ranks']} --steps {out['steps']}"
                      + (f" --step-s {out['step_s']:g}" if out["step_s"] != 1.0 else "")
                      + (f" --stall-after {args.stall_after:g}" if args.stall_after != 10 else "")
                      + (f" --flush-every {out['flush_every']}" if out["flush_every"] != 1
                         else ""),
              figures=[Figure(name=f"time to alert, a ×1.5 rank among {out['ranks']} at a step "
                                   f"every {out['step_s']:g} s, a part every "
                                   f"{out['flush_every']} step(s) ({out['fast_alerted']} of "
                                   f"{out['trials']} onsets alerted)",
                              value=f"median {sec(out['fast_median_s'])}, p90 "
                                    f"{sec(out['fast_p90_s'])}",
                              anchor="Mycroft 15 s, Holmes 30 s",
                              goal="median ≤ 10 s at 1,024 ranks, 1 step/s",
                              met=(out["fast_median_s"] is not None
                                   and out["fast_median_s"] <= 10) if at_goal else None,
                              note=("" if at_goal else "not the goal's size or rate; ")
                              + f"a part every {out['flush_every']} step(s) is the recorder's "
                              "flush interval: the time includes the wait for the part"),
                       Figure(name="the monitor's latency (deciding step's parts flushed → "
                                   "webhook), median / p90",
                              value=f"{sec(out['pipeline_median_s'])} / {sec(out['pipeline_p90_s'])}"),
                       Figure(name="false `rank_slowdown` alerts on never-slowed ranks and the "
                                   "clean job", value=str(false), goal="0", met=false == 0),
                       Figure(name=f"dead-man, stall_after_s {out['stall_after_s']:g}: `stalled` / "
                                   "`rank_silent` received after the job's (rank's) last part",
                              value=f"{ms(out['stalled_delay_s'])} / "
                                    f"{ms(out['rank_silent_delay_s'])}",
                              goal="within stall_after_s of the last part",
                              met=bool(late) and max(late) <= out["stall_after_s"],
                              note="from the last part's rename; decided (startsAt) at "
                                   f"{ms(out['stalled_decided_s'])} / "
                                   f"{ms(out['rank_silent_decided_s'])}: the monitor counts "
                                   "from the file's ctime (within file_time_slack_s of its "
                                   "notice), the rest is the store's commit and the post"),
                       Figure(name="CPU per stored part: service process / its analysis "
                                   "process (load-independent, unlike the times)",
                              value=" / ".join(f"{us / 1e3:.2f} ms" for us in
                                               out["cpu_us_per_part"].values()),
                              note="parts a second the monitor can take on one core each: "
                                   "1 / the larger of the two")]))


if __name__ == "__main__":
    main()
