"""The monitor's CPU while idle with jobs of huge declared worlds: N jobs of 65,536 ranks
(dp 256 × pp 256, no layout), one part of rank 0 each, uploaded to an in-process monitor
(stall_after_s 3600, so every job stays running); then its process CPU over a quiet interval.
`--baseline REV` measures that commit's monitor too, in the same run (its src/ from git, in a
child process), and writes both to results/monitor_idle_cpu.json:

    .venv/bin/python benchmarks/monitor_idle_cpu.py [--jobs 50] [--seconds 20] [--baseline REV]
"""

from __future__ import annotations

import argparse
import os
import subprocess
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


REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--baseline", default=None, help="also measure this commit's monitor")
    ap.add_argument("--name", default=None, help="write the result as this name (a path: "
                    "there, e.g. /tmp/x) instead of results/monitor_idle_cpu.json")
    args = ap.parse_args()
    if args.baseline is None:
        print(f"{idle_cores(args.jobs, args.seconds):.4f}")
        return
    from results import Figure, Run, write

    with tempfile.TemporaryDirectory() as old:
        tar = subprocess.run(["git", "archive", args.baseline, "src"], cwd=REPO, check=True,
                             capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", old], input=tar, check=True)
        argv = [sys.executable, __file__, "--jobs", str(args.jobs), "--seconds",
                str(args.seconds)]
        then = float(subprocess.run(argv, check=True, capture_output=True, text=True,
                                    env={**os.environ, "PYTHONPATH": f"{old}/src"}
                                    ).stdout.split()[-1])
    now = idle_cores(args.jobs, args.seconds)
    print(f"{args.jobs} running jobs of 65,536 ranks, one part each: {now:.4f} cores idle "
          f"(at {args.baseline}: {then:.4f})")
    write(Run(benchmark="Monitor: idle CPU with huge declared worlds (issue 34)", issue="34",
              command=" ".join([".venv/bin/python benchmarks/monitor_idle_cpu.py",
                                *sys.argv[1:]]),
              figures=[Figure(name=f"{args.jobs} running jobs of 65,536 declared ranks, one "
                                   "part each: the monitor's CPU while idle",
                              value=f"{now:.4f} cores",
                              anchor=f"commit {args.baseline}, same run: {then:.4f} cores")]),
          args.name)


def idle_cores(jobs: int, seconds: float) -> float:
    """The in-process monitor's CPU (cores) over `seconds` of quiet with `jobs` such jobs."""
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
                for i in range(jobs):
                    c.put(f"/api/jobs/j{i}/meta", json=meta, headers=AUTH).raise_for_status()
                    c.put(f"/api/jobs/j{i}/ranks/0/parts/0", content=body,
                          headers=AUTH).raise_for_status()
            s.monitor.wait_idle(60)
            time.sleep(2)
            cpu = time.process_time()
            time.sleep(seconds)
            used = (time.process_time() - cpu) / seconds
        finally:
            s.stop()
    return used


if __name__ == "__main__":
    main()
