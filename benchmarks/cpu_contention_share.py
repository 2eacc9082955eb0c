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
machine come out as CPU contention. The CPU waits grow with the machine's load, so every run
records the 1-minute load average over its course (min/median/max, sampled each second) and the
result's note says what load the findings were measured at.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
from results import Figure, Load, Run, write  # noqa: E402

SHARE = re.compile(r"(\d+)% of their lateness")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LoadOverRun:
    """The 1-minute load average sampled every second on a thread while one run goes on."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []  # (monotonic time, load)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> "LoadOverRun":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    def _sample(self) -> None:
        self.samples.append((time.monotonic(), os.getloadavg()[0]))

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            self._sample()

    def summary(self) -> Load:
        """Min, median and max of the samples, and the seconds they span."""
        loads = [x for _, x in self.samples]
        return Load(min=round(min(loads), 1), median=round(statistics.median(loads), 1),
                    max=round(max(loads), 1), samples=len(loads),
                    seconds=round(self.samples[-1][0] - self.samples[0][0], 1))


def torchrun(nproc: int, script: Path, *args: str) -> Load:
    """Run `script` on `nproc` gloo ranks; returns the load over the run."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": str(REPO / "src")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script), *args]
    with LoadOverRun() as load:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        raise SystemExit(f"{script.name} failed:\n{proc.stderr[-3000:]}")
    return load.summary()


def load_range(loads: list[Load]) -> str:
    """The load over a set of runs: lowest minimum to highest maximum, and the median of medians."""
    return (f"{min(x.min for x in loads):.1f}–{max(x.max for x in loads):.1f} "
            f"(median {statistics.median(x.median for x in loads):.1f})")


def shares_note(clean: dict[str, list[tuple[str, str]]]) -> str:
    """How much of the clean runs' lateness their CPU waits explain, lowest to highest."""
    from stragglers.whatif.config import DiagnosisConfig

    shares = [int(share[:-1]) for found in clean.values() for cause, share in found
              if share.endswith("%")]
    if not shares:
        return "no clean run has a communication or cpu_contention finding"
    return (f"CPU waits explain {min(shares)}–{max(shares)}% of the clean runs' late transfers "
            f"(cpu_contention from {DiagnosisConfig().contention_explains:.0%})")


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
    clean: dict[str, list[tuple[str, str]]] = {}
    links: dict[str, list[tuple[str, str]]] = {}
    loads: dict[str, Load] = {}  # table row -> the load over that run
    with tempfile.TemporaryDirectory() as tmp:
        for schedule in args.schedules:
            run = Path(tmp) / schedule
            loads[f"clean {schedule}"] = torchrun(
                2, REPO / "examples" / "train_pipeline.py", "--schedule", schedule,
                "--steps", str(args.steps), "--d-model", "128", "--batch", "16",
                "--out", str(run))
            clean[schedule] = findings(run)
            print(f"clean {schedule:22s} {clean[schedule]} {loads[f'clean {schedule}']}",
                  flush=True)
        for delay in args.delays_ms:
            run = Path(tmp) / f"link{delay:g}"
            loads[f"slow link {delay:g} ms"] = torchrun(
                4, REPO / "examples" / "train_gpt.py", "--pp", "4", "--layers", "4",
                "--steps", "10", "--comm-delay-rank", "1", "--comm-delay-ms", f"{delay:g}",
                "--trace-dir", str(run))
            links[f"{delay:g} ms"] = findings(run)
            print(f"slow link {delay:g} ms{'':13s} {links[f'{delay:g} ms']} "
                  f"{loads[f'slow link {delay:g} ms']}", flush=True)
    probe_load = os.getloadavg()[0]
    probe = probe_cost(args.probe_iters)
    print(f"probe per communication op: {probe:.1f} µs (load average {probe_load:.1f})")

    def said(found: list[tuple[str, str]]) -> str:
        return ", ".join(f"{cause} {share}" for cause, share in found)

    def row(name: str, found: list[tuple[str, str]]) -> dict[str, str]:
        over = loads[name]
        return {"run": name, "findings (cause, share explained by CPU waits)": said(found),
                "load over the run (min/median/max)":
                    f"{over.min:.1f}/{over.median:.1f}/{over.max:.1f}",
                "seconds": f"{over.seconds:.0f}"}

    clean_loads = [loads[f"clean {k}"] for k in clean]
    link_loads = [loads[f"slow link {k}"] for k in links]

    clean_none = sum(found[0][0] == "none" for found in clean.values())
    write(Run(benchmark="CPU waits of communication: how much of a slow-looking transfer they "
                        "explain", issue="15",
              command=".venv/bin/python benchmarks/cpu_contention_share.py",
              figures=[Figure(name="injected slow links: first finding, share of lateness "
                                   "explained by CPU waits",
                              value="; ".join(f"{k}: {said(v)}" for k, v in links.items()),
                              goal="communication", met=all(v[0][0] == "communication"
                                                            for v in links.values())),
                       Figure(name=f"clean pipelined runs ({len(clean)} schedules) diagnosed "
                                   "`none`", value=f"{clean_none} of {len(clean)}",
                              goal="a clean pipelined run is `none` (issue 15)",
                              met=clean_none == len(clean),
                              note=shares_note(clean)),
                       Figure(name="probe cost per communication op (mark + read, in-process)",
                              value=f"{probe:.1f} µs",
                              note=f"a wall time, at load {probe_load:.1f} when it began")],
              note=f"The findings were measured at load {load_range(clean_loads)} over the "
                   f"clean runs and {load_range(link_loads)} over the slow-link runs (1-minute "
                   "load average, sampled each second; per run in the table).",
              table=[row(f"clean {k}", v) for k, v in clean.items()]
              + [row(f"slow link {k}", v) for k, v in links.items()]))


if __name__ == "__main__":
    main()
