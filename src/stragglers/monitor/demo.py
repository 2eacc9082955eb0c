"""The live demo: a monitor, and examples/train_gpt.py with a slow rank uploading to it.

    python -m stragglers.monitor.demo [--port 8150] [--steps 80] [--out runs/demo-live] [--keep]

Starts `stragglers monitor serve`, prints the dashboard URL, runs a 4-process torchrun job
(dp 2 × pp 2) whose rank 1 is 4× slow for the first half of the steps and uploads its parts
(`--monitor-url`), then prints the windows and alerts. With --keep the monitor stays up until
Ctrl-C; otherwise it stops and the last line is the command that serves the store again (with
the demo's rules file, so its 5-step windows read as 5-step windows).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec

from stragglers.errors import EnvironmentFailure, StragglersError
from stragglers.monitor.records import AlertLogEntry, WindowSummary
from stragglers.whatif.config import STRAGGLING_SLOWDOWN

REPO = Path(__file__).resolve().parents[3]
TRAIN = REPO / "examples" / "train_gpt.py"
RULES = """settings: {window_steps: 5, stall_after_s: 120, close_grace_s: 2}
rules:
  - {name: straggling, when: "slowdown >= %g", for_windows: 3, severity: warning}
  # 4 ranks on a shared CPU: healthy windows reach S 1.7-2.3 (contention), so a plain
  # threshold flaps; hysteresis: fire after 2 windows >= 2.0, resolve after 3 below 1.8
  - {name: severe, when: "slowdown >= 2.0", for_windows: 2, resolve_when: "slowdown < 1.8",
     resolve_for_windows: 3, severity: critical}
  # healthy windows show worker_fault findings of x1.1-1.4 on random ranks: a worker's alert
  # fires at x1.5 twice in a row and resolves after 2 windows without a finding of x1.2 there
  - {name: worker_fault, when: "cause == worker_fault and speedup >= 1.5", for_windows: 2,
     resolve_when: "speedup < 1.2", resolve_for_windows: 2, severity: critical}
  - {name: stalled, when: "state == stalled"}
""" % STRAGGLING_SLOWDOWN


def run_demo(port: int = 8150, steps: int = 80, out: Path = Path("runs/demo-live"),
             keep: bool = False) -> int:
    """Run the live demo; returns the training's exit code."""
    if not TRAIN.exists():
        raise EnvironmentFailure(str(TRAIN), "the demo needs a source checkout with examples/")
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "rules.yaml").write_text(RULES)
    url = f"http://127.0.0.1:{port}"
    monitor = subprocess.Popen(
        [sys.executable, "-m", "stragglers.monitor", "serve", "--db", str(out / "monitor.db"),
         "--port", str(port), "--config", str(out / "rules.yaml"), "--data-dir",
         str(out / "uploads")])
    try:
        _wait_up(url, monitor)
        print(f"dashboard: {url}/jobs/gpt   (all jobs: {url}/, metrics: {url}/metrics)",
              flush=True)
        run = out / "gpt"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node=4", "--rdzv-endpoint", f"127.0.0.1:{_free_port()}", str(TRAIN),
               "--pp", "2", "--steps", str(steps), "--layers", "2", "--d-model", "32",
               "--max-seq-len", "64", "--slow-rank", "1", "--slow-factor", "4",
               "--slow-until-step", str(steps // 2), "--flush-interval", "0.3",
               "--trace-dir", str(run), "--overwrite", "--monitor-url", url]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        # (said before the run: its later windows name cpu_contention or none, as they should)
        print(f"job gpt: dp 2 x pp 2, {steps} steps; rank 1 is 4x slow until step "
              f"{steps // 2}, then recovers", flush=True)
        rc = subprocess.call(cmd, env=env, cwd=REPO)
        # (its last window stored, not a fixed 3 s: on a loaded machine the close grace and
        # the analysis took longer, and the last windows and alerts went unprinted)
        job = wait_last_window(url, "gpt", steps - 1 if rc == 0 else None, monitor)
        for w in job.windows:
            print(f"window {w.idx:2d} steps {w.first_step:3d}-{w.last_step:3d}  "
                  f"S = {w.slowdown or float('nan'):.2f}  {', '.join(w.causes)}")
        for e in reversed(job.alert_log):
            print(f"alert {e.status:8s} {e.rule}: {e.summary}")
        if keep:
            print(f"dashboard: {url}/jobs/gpt   (the monitor is still running; Ctrl-C stops "
                  "it)", flush=True)
            monitor.wait()
        else:
            # the monitor stops with the demo: a bare link here would be a dead one; with the
            # demo's rules (5-step windows) the store reads back as it was shown
            print(f"the monitor stopped; to see this job again: {reopen_command(out, port)} "
                  f"then open {url}/jobs/gpt (or run the demo with --keep)", flush=True)
        return rc
    except KeyboardInterrupt:
        return 130
    finally:
        if monitor.poll() is None:
            monitor.terminate()
            monitor.wait(timeout=30)


class JobPage(msgspec.Struct):
    """What the demo prints of `/api/jobs/NAME`: the job's windows and alert transitions."""

    windows: list[WindowSummary] = []
    alert_log: list[AlertLogEntry] = []


def wait_last_window(url: str, job: str, last_step: int | None,
                     proc: subprocess.Popen | None = None, timeout: float = 120.0) -> JobPage:
    """The job's page once its window ending at `last_step` is stored (None: a run that
    failed, whose last step is not known: once the monitor is idle); as it is after `timeout`
    otherwise (said)."""
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise EnvironmentFailure(url, f"the monitor exited ({proc.returncode})")
        page = _job_page(url, job)
        if last_step is None:
            done = httpx.get(f"{url}/health", timeout=30).json().get("idle") is True
        else:
            done = any(w.last_step >= last_step for w in page.windows)
        if done:
            return page
        if time.monotonic() > deadline:
            print(f"(the monitor had not taken the run's last window in {timeout:.0f} s: "
                  "what it had is shown)", flush=True)
            return page
        time.sleep(0.2)


def _job_page(url: str, job: str) -> JobPage:
    r = httpx.get(f"{url}/api/jobs/{job}", timeout=30)
    if r.status_code == 404:   # (not announced yet, or the run failed before it was)
        return JobPage()
    r.raise_for_status()
    return msgspec.json.decode(r.content, type=JobPage)


def reopen_command(out: Path, port: int) -> str:
    """The command that serves the demo's store again, with the demo's settings."""
    return (f"stragglers monitor serve --db {out / 'monitor.db'} --config {out / 'rules.yaml'} "
            f"--data-dir {out / 'uploads'} --port {port}")


def _wait_up(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise EnvironmentFailure(url, f"the monitor exited ({proc.returncode}); is the port "
                                     "taken? try --port")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise EnvironmentFailure(url, "the monitor did not answer in time")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    """Command line of the demo."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, default=8150, help="the monitor's port (0: any free)")
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--out", type=Path, default=Path("runs/demo-live"))
    p.add_argument("--keep", action="store_true", help="keep the monitor up after the run")
    a = p.parse_args()
    try:
        sys.exit(run_demo(a.port or _free_port(), a.steps, a.out, a.keep))
    except StragglersError as exc:   # one line, as the CLI prints it
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
