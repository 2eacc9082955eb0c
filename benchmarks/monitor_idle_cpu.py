"""The monitor's CPU while idle with jobs of huge declared worlds: N jobs of 65,536 ranks
(dp 256 × pp 256, no layout), one part of rank 0 each, uploaded to an in-process monitor
(stall_after_s 3600, so every job stays running); then its process CPU over a quiet interval.
Run it for this tree and, side by side, for another (PYTHONPATH=/path/to/old/src):

    .venv/bin/python benchmarks/monitor_idle_cpu.py [--jobs 50] [--seconds 20]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "monitor"))

from monitor_jobs import parts_of, slow_job  # noqa: E402
from stragglers.monitor.server import MonitorServer  # noqa: E402
from stragglers.monitor.settings import MonitorConfig  # noqa: E402
from stragglers.trace.runformat import table_bytes  # noqa: E402

TOKEN = "idle-cpu-benchmark-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    cfg = MonitorConfig(stall_after_s=3600, new_jobs_per_client_per_minute=100_000,
                        new_jobs_per_minute=100_000)
    trace = slow_job(steps=5)
    meta = trace.meta.to_dict()
    meta.update(dp_size=256, pp_size=256, world_size=65_536)
    meta["extra"].pop("layout")
    body = table_bytes(parts_of(trace, 5)[0][2])
    with tempfile.TemporaryDirectory() as tmp:
        s = MonitorServer(Path(tmp) / "mon.db", port=0, token=TOKEN, config=cfg).start()
        try:
            with httpx.Client(base_url=s.url, timeout=60) as c:
                for i in range(args.jobs):
                    c.put(f"/api/jobs/j{i}/meta", json=meta, headers=AUTH).raise_for_status()
                    c.put(f"/api/jobs/j{i}/ranks/0/parts/0", content=body,
                          headers=AUTH).raise_for_status()
            s.monitor.wait_idle(60)
            time.sleep(2)
            cpu = time.process_time()
            time.sleep(args.seconds)
            used = (time.process_time() - cpu) / args.seconds
        finally:
            s.stop()
    print(f"{args.jobs} running jobs of 65,536 ranks, one part each: {used:.4f} cores idle")


if __name__ == "__main__":
    main()
