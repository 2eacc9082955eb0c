"""A transfer's end is stamped when it completes, not when Python next gets the GIL."""

from __future__ import annotations

import pytest
from conftest import REPO, torchrun

from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.runformat import read_run

WORKER = REPO / "tests" / "record" / "workers" / "gil_worker.py"
HOLD_S = 3.0  # the worker: rank 0 holds the GIL this long; rank 1 sends once it has begun
pytestmark = pytest.mark.distributed


def recv_durations(out) -> list[float]:
    ops = read_run(out).ops
    sel = (ops["rank"] == 0) & (ops["optype"] == OPTYPE_CODES["forward-recv"])
    return sorted(ops["duration"][sel].tolist())


def test_the_native_waiter_stamps_a_receive_done_while_the_gil_is_held(tmp_path):
    proc = torchrun(WORKER, 2, str(tmp_path / "native"), timeout=240)
    assert "rank 0 native waiter: True" in proc.stdout, proc.stdout  # `make` builds it
    # done while rank 0 computes: before it let go of the GIL (HOLD_S after the post)
    durations = recv_durations(tmp_path / "native")
    assert len(durations) == 2 and max(durations) < HOLD_S, durations


def test_the_python_waiter_stamps_it_only_once_it_gets_the_gil(tmp_path):
    # The fallback (native module switched off) is as late as the GIL keeps it: what the
    # native waiter is for, and what the test above would see without it.
    proc = torchrun(WORKER, 2, str(tmp_path / "python"), timeout=240,
                    env={"STRAGGLERS_RECORD_NATIVE": "0"})
    assert "rank 0 native waiter: False" in proc.stdout, proc.stdout
    durations = recv_durations(tmp_path / "python")
    # the stamp is after the loop, less the waiter's own wait for a CPU (its run delay)
    assert len(durations) == 2 and min(durations) >= HOLD_S - 0.5, durations
