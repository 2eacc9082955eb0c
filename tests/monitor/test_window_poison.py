"""One op cannot poison a window (review M7): an op whose duration does not fit its own step
(past MAX_OP_SECONDS, or ending after its rank's next step began) is refused with its part,
422 naming the row, before anything is stored; a real stall (the next step starts after it)
is kept."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from conftest import eventually
from monitor_jobs import get, parts_of, slow_job
from stragglers.monitor.part_limits import MAX_OP_SECONDS, check_op_spans
from stragglers.monitor.server import MonitorServer
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

TOKEN = "window-poison-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CFG = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


def one_rank_part(steps: int = 5, rank: int = 3) -> dict[str, np.ndarray]:
    """A healthy job's part of one rank (columns copied)."""
    for r, n, cols in parts_of(slow_job(steps=steps, slow=None), steps):
        if r == rank:
            return {k: v.copy() for k, v in cols.items()}
    raise AssertionError("no part")


def test_an_op_ending_after_its_ranks_next_step_began_is_refused_naming_the_row():
    cols = one_rank_part()
    assert check_op_spans(cols, "p") is None          # as recorded: every op fits
    first = int(np.argmin(cols["step"]))
    cols["duration"][first] = 5e10                    # (inside the times' 1e11 s bound)
    exc = check_op_spans(cols, "p")
    assert exc is not None and exc.field == "duration" and "row" in str(exc), exc
    cols = one_rank_part()
    step0 = cols["step"] == cols["step"].min()
    i = int(np.flatnonzero(step0)[0])
    nxt = cols["start_ts"][cols["step"] == cols["step"].min() + 1].min()
    period = nxt - cols["start_ts"][step0].min()
    # past the next step's start by more than one step (and 1 s): refused
    cols["duration"][i] = nxt - cols["start_ts"][i] + max(period, 1.0) + 0.5
    assert check_op_spans(cols, "p") is not None
    # within it: kept (work left on a device stream)
    cols["duration"][i] = nxt - cols["start_ts"][i] + 0.5
    assert check_op_spans(cols, "p") is None


def test_an_op_of_the_parts_last_step_is_bounded_and_a_real_stall_is_kept():
    cols = one_rank_part()
    last = int(np.flatnonzero(cols["step"] == cols["step"].max())[-1])
    cols["duration"][last] = MAX_OP_SECONDS * 2
    exc = check_op_spans(cols, "p")
    assert exc is not None and f"row {last} " in str(exc), exc
    # a stall of 100 s in step 1: every later op starts 100 s later, as on a real rank
    cols = one_rank_part()
    s1 = cols["step"] == cols["step"].min() + 1
    i = int(np.flatnonzero(s1)[np.argmax(cols["start_ts"][s1])])
    later = cols["start_ts"] > cols["start_ts"][i]
    cols["duration"][i] += 100.0
    cols["start_ts"][later] += 100.0
    assert check_op_spans(cols, "p") is None


@pytest.mark.slow
def test_one_poisoned_op_is_refused_before_it_is_stored_and_fires_no_alert(tmp_path):
    # (fails before: the part was stored, window 2's slowdown was 3.1e10, and `severe` and
    # `new_cause` fired)
    trace = slow_job(steps=30, slow=None)
    s = MonitorServer(tmp_path / "mon.db", port=0, token=TOKEN, config=CFG).start()
    try:
        with httpx.Client(base_url=s.url, timeout=60, headers=AUTH) as c:
            assert c.put("/api/jobs/j/meta", json=trace.meta.to_dict()).status_code == 200
            for rank, n, cols in parts_of(trace, 5):
                if rank == 3 and n == 2:
                    bad = {k: v.copy() for k, v in cols.items()}
                    bad["duration"][0] = 5e10
                    r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(bad))
                    assert r.status_code == 422, r.text
                    assert "duration" in r.json()["error"] and "row 0" in r.json()["error"]
                r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols))
                assert r.status_code == 200, r.text   # (nothing of the bad one was stored)
            eventually(lambda: get(c, "/api/jobs/j?history=100")["windows_total"] >= 6,
                       what="6 windows")
            job = get(c, "/api/jobs/j?history=100")
            worst = max(w["slowdown"] for w in job["windows"] if w["slowdown"] is not None)
            assert worst < 1.5, [w["slowdown"] for w in job["windows"]]
            assert not [a for a in job["alerts"] if a["rule"] in ("severe", "new_cause")]
    finally:
        s.stop()
