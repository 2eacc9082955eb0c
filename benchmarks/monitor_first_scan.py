"""The watched roots' first scan against the service's first answer (issue 34, round three).

A root of `--folders` empty folders and a few runs: seconds from `MonitorServer.start()` to
the first `/health` answer (a client polls from the moment start() is called), the longest
wait between answers, and when every run is a job. Run it at two commits side by side:
`PYTHONPATH=<checkout>/src python benchmarks/monitor_first_scan.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "monitor"))
from monitor_jobs import parts_of, slow_job, start_run, write_parts  # noqa: E402

from stragglers.monitor.server import MonitorServer  # noqa: E402
from stragglers.monitor.settings import MonitorConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folders", type=int, default=30_000)
    ap.add_argument("--runs", type=int, default=4)
    ap.add_argument("--tmp", default=None, help="folder for the root and the store")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(dir=args.tmp))
    root = tmp / "runs"
    root.mkdir()
    for i in range(args.folders):
        (root / f"empty-{i:06d}").mkdir()
    trace = slow_job(steps=10)
    for i in range(args.runs):
        start_run(root / f"job-{i}", trace)
        write_parts(root / f"job-{i}", parts_of(trace, 5))
    cfg = MonitorConfig(window_steps=5, stall_after_s=600, rescan_s=3600)
    server = MonitorServer(tmp / "mon.db", watch=[root], port=0, config=cfg)
    answers: list[tuple[float, dict]] = []   # (seconds since start(), /health)
    stop = threading.Event()

    def poll() -> None:   # (the socket listens already: a request waits in its backlog)
        with httpx.Client(base_url=server.url, timeout=120) as c:
            while not stop.is_set():
                health = c.get("/health").json()
                answers.append((time.perf_counter() - t0, health))
                time.sleep(0.02)

    poller = threading.Thread(target=poll, daemon=True)
    t0 = time.perf_counter()
    poller.start()
    server.start()
    t_started = time.perf_counter() - t0
    try:
        while not answers or answers[-1][1]["jobs"] < args.runs or \
                answers[-1][1].get("scanning"):
            time.sleep(0.05)
    finally:
        stop.set()
        poller.join()
        server.stop()
    times = [0.0] + [t for t, _ in answers]
    scanning = [t for t, a in answers if a.get("scanning")]
    print(json.dumps({"folders": args.folders, "runs": args.runs,
                      "start_returned_s": round(t_started, 3),
                      "first_health_s": round(answers[0][0], 3),
                      "longest_gap_s": round(max(b - a for a, b in zip(times, times[1:])), 3),
                      "answers_while_scanning": len(scanning),
                      "all_jobs_s": round(answers[-1][0], 3)}))


if __name__ == "__main__":
    main()
