"""Red team round eleven (issue 34): the live monitor and the shared serving layer against what
the last session added (per-step rank clock alignment, run identity by extra.started, sampled
steps, the float32 start_ts rule, NDTimeline per-step clocks in the part checks).

Each test is one defect class, marked xfail(strict=True) until its fix lands (then the mark goes):
a pass before the fix fails the suite, so each flips exactly when its defect is gone. Real
servers on loopback (the monitor on a thread of this process, as rounds nine and ten start it),
real SQLite, real files.
"""

from __future__ import annotations

import json
import sys

import pytest

from conftest import REPO, eventually
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.runformat import table_bytes

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import get, parts_of, serving_job, slow_job  # noqa: E402

TOKEN = "hostile-round11-token-0123456789"
MONITOR = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


@pytest.mark.xfail(strict=True, reason="a rank's clock off by less than two step spans (0.3 s) "
                   "is not aligned: a healthy job reads S 1.2 and fires straggling")
def test_a_rank_clock_off_by_less_than_two_steps_does_not_make_a_straggler(tmp_path):
    """A healthy 2x2 job (steps of ~0.33 s; every window S ~1.007) whose rank 3 runs on a host
    whose clock is 0.3 s ahead of the others' (no NTP on that host, or an NTP step the size of
    a step). clocks.align_step_clocks moves a rank onto the others' clock only where its span
    of a step lies apart from theirs by more than the step's span (an offset past ~2 spans):
    the same job with rank 3 0.7 s ahead reads S 1.005, 0.3 s ahead (and 0.05 s, 0.2 s, 0.4 s)
    reads S 1.205-1.216 in every window and `straggling` fires for a job with no straggler.
    The ends of one collective agree across its ranks on one clock, whatever the span overlap:
    aligned by them (or refused), the windows read as the job ran."""
    trace = slow_job(steps=20, slow=None)
    with serving_job(tmp_path / "mon.db", trace, TOKEN, MONITOR) as c:
        refused = 0
        for rank, n, cols in parts_of(trace, 5):
            if rank == 3:
                cols = {**cols, "start_ts": cols["start_ts"] + 0.3}
            r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols))
            assert r.status_code in (200, 422), r.text
            refused += r.status_code == 422
        if refused:
            return
        eventually(lambda: get(c, "/api/jobs/j?history=10")["windows_total"] >= 4,
                   what="windows 0-3")
        job = get(c, "/api/jobs/j?history=10")
        slowdowns = [round(w["slowdown"], 3) for w in job["windows"]]
        assert max(slowdowns) < 1.1, slowdowns
        assert not [a["rule"] for a in job["alerts"]], job["alerts"]


@pytest.mark.xfail(strict=True, reason="extra.started = 10**400 (a JSON integer) is a 500 "
                   "OverflowError, not a 422 naming extra.started")
def test_a_run_start_too_large_for_a_float_is_refused_naming_the_field(tmp_path):
    """meta.json's extra.started (the run-identity clock added last session) given as the JSON
    integer 10**400: jobmeta.run_started calls math.isfinite on it, which raises OverflowError
    ('int too large to convert to float'): PUT /api/jobs/{job}/meta answers 500 'internal error
    (OverflowError)' (for a new job and for a job already tracked); the same file in a watched
    run is refused at every rescan (each 0.2 s) as 'OverflowError: int too large to convert to
    float', naming no field. A bad value is a 422 naming extra.started, as -1 or 'x' are."""
    trace = slow_job(steps=10, slow=None)
    with serving_job(tmp_path / "mon.db", trace, TOKEN, MONITOR) as c:
        meta = trace.meta.to_dict()
        meta["extra"]["started"] = 10**400
        body = json.dumps(meta).encode()
        for job in ("j", "k"):   # (tracked already; new)
            r = c.put(f"/api/jobs/{job}/meta", content=body,
                      headers={"Content-Type": "application/json"})
            assert r.status_code == 422, (r.status_code, r.text)
            assert "extra.started" in r.json()["error"], r.text
        assert get(c, "/health")["status"] == "ok"
