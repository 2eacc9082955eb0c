"""Red team round twelve (issue 34): the live monitor and the shared serving layer against what
round eleven's fixes added (clock alignment by collective ends, the tighter span bound, window
notes, replaced runs in a Bloom filter, the non-recursive watch, integer seconds refused,
workers whose op set differs from their stage's majority left out).

Each test is one defect class, marked xfail(strict=True) until its fix lands (then the mark goes):
a pass before the fix fails the suite, so each flips exactly when its defect is gone. Real
servers on loopback (the monitor on a thread of this process), real SQLite, real files.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest

from conftest import REPO, eventually
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.model import OPTYPE_CODES
from stragglers.trace.runformat import table_bytes

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import get, parts_of, serving_job, slow_job  # noqa: E402

TOKEN = "hostile-round12-token-0123456789"
MONITOR = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


def _put_all(c, trace, change):
    """PUT every part of `trace` (5 steps a part), `change(rank, cols)` applied; how many 422."""
    refused = 0
    for rank, n, cols in parts_of(trace, 5):
        cols = change(rank, cols)
        r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols))
        assert r.status_code in (200, 422), r.text
        refused += r.status_code == 422
    return refused


@pytest.mark.xfail(strict=True, reason="an extra p2p row at one rank gets its honest peer's "
                   "replica (the straggler's) left out: whatif/grid.odd_workers tie rule")
def test_an_extra_send_at_one_rank_does_not_leave_out_its_honest_peer(tmp_path):
    """A 2x2 job whose rank 0 (dp 0, pp 0) is a real straggler (3x; S ~1.6). Rank 3 (dp 1,
    pp 1, the last stage) adds one `forward-send` row a step (seq_id 0; a copy of its own
    backward-send's time), an op its stage never runs: a hostile uploader, or a recorder that
    mislabels a transfer. whatif/grid.odd_workers breaks the 1-1 tie at stage 1 by 'the rest
    of the job': stage 0's majority ran (forward-send, 0), so the op is taken as the
    schedule's and the *honest* rank 2 'lacks' it; replica 0 (ranks 0 and 2) is left out, the
    straggler with it. The tie rule's 'elsewhere' is meant for gradient collectives every stage
    runs (its docstring), not pipeline transfers, which are each stage's own. The odd worker is
    rank 3 (or the window undecided for that op): rank 0's slowness still seen."""
    trace = slow_job(steps=20, slow=(0, 0, 3.0))

    def change(rank, cols):
        if rank != 3:
            return cols
        src = (cols["optype"] == OPTYPE_CODES["backward-send"]) & (cols["seq_id"] == 0)
        add = {k: v[src].copy() for k, v in cols.items()}
        add["optype"][:] = OPTYPE_CODES["forward-send"]
        merged = {k: np.concatenate([cols[k], add[k]]) for k in cols}
        order = np.lexsort((merged["start_ts"], merged["step"]))
        return {k: v[order] for k, v in merged.items()}

    with serving_job(tmp_path / "mon.db", trace, TOKEN, MONITOR) as c:
        if _put_all(c, trace, change):
            return
        eventually(lambda: get(c, "/api/jobs/j?history=10")["windows_total"] >= 3,
                   what="windows 0-2")
        job = get(c, "/api/jobs/j?history=10")
        windows = job["windows"]
        assert [w["error"] for w in windows if w["error"]] == [], windows[0]["error"]
        assert min(w["slowdown"] for w in windows) > 1.15, (
            [round(w["slowdown"], 3) for w in windows], windows[0].get("notes"),
            windows[0].get("missing"))
