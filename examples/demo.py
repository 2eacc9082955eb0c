"""`make demo`: train a small GPT on 4 CPU processes (dp 2 × pp 2) with one slow rank, then analyse it.

    python examples/demo.py [--steps 20] [--slow-rank 2] [--slow-factor 3] [--out runs/demo]

1. `torchrun` (python -m torch.distributed.run) starts examples/train_gpt.py with the recorder
   on; rank 2 (DP rank 1, pipeline stage 0) does 3× the compute of the others.
2. `stragglers analyze` replays the recorded trace, prints the report and writes the HTML one.
3. The demo says whether the diagnosis named the injected worker.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A free TCP port on loopback for torchrun's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--slow-rank", type=int, default=2)
    p.add_argument("--slow-factor", type=float, default=3.0)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "demo")
    args = p.parse_args()

    trace_dir, html, result_json = args.out / "trace", args.out / "report.html", args.out / "result.json"
    shutil.rmtree(trace_dir, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1"}
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4",
             "--rdzv-endpoint", f"127.0.0.1:{free_port()}", str(REPO / "examples" / "train_gpt.py"),
             "--pp", "2", "--steps", str(args.steps), "--trace-dir", str(trace_dir),
             "--slow-rank", str(args.slow_rank), "--slow-factor", str(args.slow_factor)]
    print(f"[demo] training: dp 2 × pp 2 on CPU (gloo), {args.steps} steps, rank {args.slow_rank} "
          f"{args.slow_factor:g}× slower\n[demo] $ {' '.join(train[1:])}", flush=True)
    t0 = time.perf_counter()
    subprocess.run(train, check=True, env=env, cwd=REPO)
    print(f"[demo] trained in {time.perf_counter() - t0:.0f} s; analysing {trace_dir}", flush=True)
    analyze = [sys.executable, "-m", "stragglers.cli", "analyze", str(trace_dir),
               "--html", str(html), "--json", str(result_json)]
    print(f"[demo] $ stragglers {' '.join(analyze[3:])}", flush=True)
    subprocess.run(analyze, check=True, env=env, cwd=REPO)

    result = json.loads(result_json.read_text())
    dp, stage = args.slow_rank // 2, args.slow_rank % 2
    named = [d for d in result.get("diagnosis", []) if d.get("cause") == "worker_fault"]
    print(f"[demo] injected: rank {args.slow_rank} = DP rank {dp}, stage {stage}, "
          f"{args.slow_factor:g}× compute")
    if named:
        print(f"[demo] diagnosed: worker_fault at {named[0].get('where')}")
    else:
        causes = ", ".join(str(d.get("cause")) for d in result.get("diagnosis", [])) or "none"
        print(f"[demo] diagnosed: {causes} (the injected worker fault was not named)")
    print(f"[demo] HTML report: {html.resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
