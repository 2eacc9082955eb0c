"""How much of a slow-looking transfer its own threads' CPU waits explain (the cpu_wait column).

    .venv/bin/python benchmarks/cpu_contention_share.py [--steps 16] [--delays-ms 20 60]
        [--schedules GPipe 1F1B ...] [--probe-iters 20000]

1. Clean pipelines (examples/train_pipeline.py, 2 ranks, each schedule): nothing is slow but
   the machine; the share of the transfers' lateness that lies within the recorded CPU waits.
2. A slow link injected into examples/train_gpt.py (--comm-delay-ms: the receive sleeps after
   the bytes arrive, pp 4): the share for the same kind of finding when the link is the cause.
3. The probe's cost per communication op (mark + waited_s, in-process, no gloo threads).
`contention_explains` (0.5) decides between communication and cpu_contention: a useful
measurement keeps case 2 well below it; where case 1 sits says whether clean runs on this
machine come out as CPU contention.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
SHARE = re.compile(r"(\d+)% of their lateness")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(nproc: int, script: Path, *args: str) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"{script.name} failed:\n{proc.stderr[-3000:]}")


def findings(run: Path) -> list[tuple[str, str]]:
    from stragglers.trace.runformat import read_run
    from stragglers.whatif import analyze

    result = analyze(read_run(run))
    out = []
    for f in result.diagnosis:
        m = SHARE.search(f.evidence)
        if f.cause in ("communication", "cpu_contention"):
            out.append((f.cause, f"{m.group(1)}%" if m else "no cpu_wait"))
    return out or [(result.diagnosis[0].cause, "-")]


def probe_cost(iters: int) -> float:
    from stragglers.record.schedstat import CommWaitProbe

    probe = CommWaitProbe()
    t0 = time.perf_counter_ns()
    for _ in range(iters):
        probe.waited_s(probe.mark())
    probe.close()
    return (time.perf_counter_ns() - t0) / iters / 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--schedules", nargs="+", default=["GPipe", "1F1B", "Interleaved1F1B",
                                                       "LoopedBFS", "InterleavedZeroBubble",
                                                       "ZBVZeroBubble", "DualPipeV"])
    p.add_argument("--delays-ms", nargs="+", type=float, default=[20.0, 60.0])
    p.add_argument("--probe-iters", type=int, default=20000)
    args = p.parse_args()
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in args.schedules:
            run = Path(tmp) / schedule
            torchrun(2, REPO / "examples" / "train_pipeline.py", "--schedule", schedule,
                     "--steps", str(args.steps), "--d-model", "128", "--batch", "16",
                     "--out", str(run))
            print(f"clean {schedule:22s} {findings(run)}", flush=True)
        for delay in args.delays_ms:
            run = Path(tmp) / f"link{delay:g}"
            torchrun(4, REPO / "examples" / "train_gpt.py", "--pp", "4", "--layers", "4",
                     "--steps", "10", "--comm-delay-rank", "1", "--comm-delay-ms", f"{delay:g}",
                     "--trace-dir", str(run))
            print(f"slow link {delay:g} ms{'':13s} {findings(run)}", flush=True)
    print(f"probe per communication op: {probe_cost(args.probe_iters):.1f} µs "
          f"(load average {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
