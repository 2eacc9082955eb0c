"""A window with one rank whose ops differ from its stage peers' (red team round 11, findings 4
and 5: every window was an error, the real straggler never reported). A collective missing, or
one extra that no peer ran: every rank analysed, the collective rebuilt or left out, named in
the window's notes (round 12: leaving the rank's DP replica out hid a straggler in it). Most of
its collectives missing (another schedule): analysed without that rank's DP replica, the ranks
left out named missing, the odd one refused with what differs, the rest scored."""

from __future__ import annotations

import time

import numpy as np
import pytest

from monitor_jobs import slow_job
from stragglers.monitor.windows import Window, analyse_window
from stragglers.trace.model import OPTYPE_CODES, Trace


# the collectives rank 3 lacks in each case ("other": most of its stage's)
LACKS = {"missing": ["grads-reduce-scatter"],
         "other": ["params-all-gather", "grads-reduce-scatter", "layernorm-grads-all-reduce"]}


def odd_rank_3(trace: Trace, case: str) -> Trace:
    """Rank 3 (dp 1, pp 1) without some collectives (LACKS), or with one barrier a step more."""
    o = trace.ops
    if case in LACKS:
        keep = ~((o["rank"] == 3) & np.isin(o["optype"], [OPTYPE_CODES[x] for x in LACKS[case]]))
        return Trace({k: v[keep] for k, v in o.items()}, trace.meta, trace.source)
    rows = np.flatnonzero(o["rank"] == 3)
    rows = rows[np.lexsort((o["start_ts"][rows], o["step"][rows]))]
    last = rows[np.r_[o["step"][rows][1:] != o["step"][rows][:-1], True]]
    add = {k: v[last].copy() for k, v in o.items()}
    add["optype"][:], add["seq_id"][:], add["mb_id"][:] = OPTYPE_CODES["barrier"], 0, -1
    add["start_ts"] = add["start_ts"] + add["duration"]
    add["duration"][:] = 1e-4
    return Trace({k: np.concatenate([o[k], add[k]]) for k in o}, trace.meta, trace.source)


@pytest.mark.parametrize("case", ["missing", "extra"])
def test_a_window_with_a_rank_lacking_or_adding_a_collective_analyses_every_rank(case):
    trace = slow_job(steps=5, slow=(0, 0, 3.0))        # rank 0 a real straggler
    window = Window("j", 0, list(range(5)), odd_rank_3(trace, case), missing_ranks=[],
                    closed_at=time.time())
    row, refused = analyse_window(window)
    assert row.error is None and row.slowdown > 1.15, row.error
    assert row.missing_ranks == [] and refused == []
    what = ("Rebuilt at the workers that lack them" if case == "missing" else
            "Left out at every worker of their stage")
    op = "grads-reduce-scatter" if case == "missing" else "barrier"
    assert [n for n in row.notes if what in n and f"{op} #0 on stage 1" in n], row.notes
    assert {s.rank for s in row.scores} == {0, 1, 2, 3}
    assert max(row.scores, key=lambda s: s.score).rank == 0


def test_a_window_with_a_rank_of_other_ops_is_analysed_without_its_replica():
    trace = slow_job(steps=5, slow=(0, 0, 3.0))        # rank 0 a real straggler
    window = Window("j", 0, list(range(5)), odd_rank_3(trace, "other"), missing_ranks=[],
                    closed_at=time.time())
    row, refused = analyse_window(window)
    assert row.error is None and row.slowdown > 1.15, row.error
    assert row.missing_ranks == [1, 3]                  # rank 3 and its replica's rank 1
    (who, why), = refused
    assert who == "job j rank 3" and "lacks params-all-gather #0, grads-reduce-scatter #0" in why, \
        why
    assert {s.rank for s in row.scores} == {0, 2}       # the honest replica, scored
    assert max(row.scores, key=lambda s: s.score).rank == 0
