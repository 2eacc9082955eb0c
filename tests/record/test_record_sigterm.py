"""SIGTERM (how torchrun stops workers) writes out the recorded steps before the process goes."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stragglers.trace.runformat import read_run

WORKER = Path(__file__).parent / "workers" / "term_worker.py"


def _terminated(tmp_path: Path, mode: str) -> tuple[Path, subprocess.Popen, str, str]:
    """Run the worker in `mode` until it has recorded 5 steps, send SIGTERM, wait for it."""
    pytest.importorskip("torch")
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(WORKER), str(out), mode], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        out_, err = proc.communicate()
        pytest.fail(f"worker did not start: {line!r} {out_!r} {err[-2000:]!r}")
    proc.send_signal(signal.SIGTERM)
    stdout, err = proc.communicate(timeout=60)
    return out, proc, stdout, err


def _steps(out: Path) -> list[int]:
    return np.unique(read_run(out).ops["step"]).tolist()


@pytest.mark.slow
def test_sigterm_writes_the_queued_steps_and_still_ends_the_process(tmp_path):
    out, proc, _, err = _terminated(tmp_path, "default")
    # killed by the signal, as without the recorder (a shell reports 143)
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, err[-2000:])
    # the writer was told to write once an hour: without the flush on SIGTERM no part exists
    assert _steps(out) == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_the_programs_own_handler_still_runs_and_recording_goes_on(tmp_path):
    out, proc, stdout, err = _terminated(tmp_path, "handler")
    assert proc.returncode == 0, err[-2000:]
    recorded = int(stdout.split("recorded ")[-1])
    # the program's handler stopped its loop; the 2 steps it recorded after the flush and
    # the ones before are all there, in one run
    assert recorded >= 7
    assert _steps(out) == list(range(recorded))
