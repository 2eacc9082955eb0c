"""A window's notes are bounded when read back, not only when written (issue 34): a stored row
(a damaged store, an older version, a hand edit) whose notes were 10 MB, 100,000 lines or not
text went out whole through the window API, the job page (and the alert rules' reads)."""

from __future__ import annotations

import json
import sqlite3

from monitor_jobs import get, serving_job, slow_job
from stragglers.monitor.settings import MonitorConfig
from stragglers.monitor.store_base import NOTE_CHARS
from stragglers.monitor.windows import MAX_NOTES

TOKEN = "notes-read-back-token-0123456789abcdef"
HOSTILE = {
    0: json.dumps(["x" * 10_000_000]),                      # one line of 10 MB
    1: json.dumps([f"rank {i}: moved" for i in range(100_000)]),   # 100,000 lines
    2: json.dumps([5, {"a": 1}, None, ["y"], "rank 1: moved"]),   # items not text
    3: '{"rank 1": "moved"}',                                 # not a list
    4: '["unterminated',                                      # not JSON
}


def test_stored_notes_out_of_bounds_are_cut_to_them_and_the_job_still_reads(tmp_path):
    db = tmp_path / "mon.db"
    config = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)
    with serving_job(db, slow_job(steps=10, slow=None), TOKEN, config) as c:
        con = sqlite3.connect(db)
        with con:
            for idx, notes in HOSTILE.items():
                con.execute("INSERT INTO windows (job, idx, first_step, last_step, steps, "
                            "scores, diagnosis, missing_ranks, reason, closed_at, analysed_at, "
                            "analysis_s, notes) VALUES ('j', ?, ?, ?, ?, '[]', '[]', '[]', "
                            "'complete', 1, 2, 0.1, ?)",
                            (idx, idx * 5, idx * 5 + 4,
                             json.dumps(list(range(idx * 5, idx * 5 + 5))), notes))
        con.close()
        got = {idx: get(c, f"/api/jobs/j/windows/{idx}")["notes"] for idx in HOSTILE}
        assert len(got[0]) == 1 and len(got[0][0]) <= NOTE_CHARS, len(got[0][0])
        cut = len(got[0][0]) - len(f"… ({10_000_000 - NOTE_CHARS + 40} more characters)")
        assert got[0][0] == "x" * cut + f"… ({10_000_000 - cut} more characters)", got[0][0][-60:]
        assert got[1] == [f"rank {i}: moved" for i in range(MAX_NOTES)], len(got[1])
        assert got[2] == ["rank 1: moved"]
        assert got[3] == [] and got[4] == []
        # the job's page (its last window: 4, then the 10 MB one) answers, bounded
        assert get(c, "/api/jobs/j")["window"]["idx"] == 4
        page = c.get("/api/jobs/j?window=0")
        assert page.status_code == 200 and len(page.content) < 100_000, len(page.content)
