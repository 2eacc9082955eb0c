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

from conftest import REPO
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.model import OPTYPE_CODES

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import (alerts_beyond_left_out, at_rank, dropping, healthy,  # noqa: E402
                          slow_job, straggler_seen, windows_of)

TOKEN = "hostile-round12-token-0123456789"
MONITOR = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


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

    job = windows_of(tmp_path, trace, change, TOKEN, MONITOR, windows=3)
    if job is None:
        return
    windows = job["windows"]
    assert [w["error"] for w in windows if w["error"]] == [], windows[0]["error"]
    assert min(w["slowdown"] for w in windows) > 1.15, (
        [round(w["slowdown"], 3) for w in windows], windows[0].get("notes"),
        windows[0].get("missing"))


def test_a_collective_lost_at_one_rank_does_not_hide_the_straggler_beside_it(tmp_path):
    """The same 2x2 job (rank 0 3x slow; S ~1.6). Rank 2 (dp 0, pp 1: the straggler's replica
    peer, itself healthy) loses its grads-reduce-scatter rows (a profiler that dropped the
    kernel; a hostile uploader). whatif/grid.odd_workers rightly finds rank 2 the odd one, and
    leave_out drops its whole DP replica: ranks 0 and 2. Every window reads S ~1.0, no alert
    but an info `new_cause` (partial) that resolves in the next window: the 3x straggler at
    rank 0, whose rows are whole, is never reported (the same when rank 0 itself loses the
    op: a straggler hides itself by one row). Leaving out the disputed op (its identity
    dropped from the stage's workers in the window) rather than the replica keeps every
    worker's time; failing that, a window that lost a replica must not read as healthy."""
    trace = slow_job(steps=20, slow=(0, 0, 3.0))
    job = windows_of(tmp_path, trace, dropping(2, "grads-reduce-scatter"), TOKEN, MONITOR)
    if job is None:
        return
    windows = job["windows"]
    assert [w["error"] for w in windows if w["error"]] == [], windows[0]["error"]
    slowdowns = [round(w["slowdown"], 3) for w in windows]
    assert min(slowdowns) > 1.15, (slowdowns, job["alerts"])


def test_one_ranks_zero_durations_in_float64_do_not_blame_an_honest_rank(tmp_path):
    """Round 11's finding 9 (rank 3's durations as int64 whole seconds, every op 0 s: S 1.32,
    critical worker_fault at the honest rank 2) was fixed by refusing integer seconds columns
    (trace/columns.too_narrow, by Arrow type). The same numbers in float64 pass: a healthy
    2x2 job whose rank 3 writes every duration as 0.0 (a recorder that took only start
    times; or durations /1000, a unit slip: the same) reads S 1.321-1.326 in every window and
    fires `worker_fault` (critical) and `straggling`. Nothing checks that one collective's
    ends agree across its members: rank 3's collectives end (start + 0) before their peers'
    ends of the same collective, which no one clock allows. Refused (422) or left out named,
    the windows read the healthy job (S ~1.007) and nothing fires."""
    trace = slow_job(steps=20, slow=None)
    zero = at_rank(3, lambda cols: {**cols, "duration": cols["duration"] * 0.0})
    job = windows_of(tmp_path, trace, zero, TOKEN, MONITOR)
    if job is None:
        return
    slowdowns = [round(w["slowdown"], 3) for w in job["windows"] if w["slowdown"]]
    assert max(slowdowns) < 1.1, slowdowns
    assert not alerts_beyond_left_out(job, (1, 3)), [(a["rule"], a["labels"]) for a in job["alerts"]]


def test_a_two_rank_data_parallel_job_missing_a_collective_is_still_analysed(tmp_path):
    """Round 11's finding 4 (a rank missing one collective: every window an error) was fixed
    for the 2x2 job by leaving the odd worker's replica out (whatif/grid.odd_workers). A plain
    data-parallel job of two ranks (dp 2, pp 1: the commonest small job) whose rank 0 is a
    real 3x straggler and whose rank 1 lost its grads-reduce-scatter rows: each part 200, and
    every window (4 of 4) is still an error 'no step has ops from every worker; 5 of 5 steps
    are incomplete ... ops missing from workers (dp 1, pp 0)': no window analysed, no alert.
    odd_workers breaks a 1-1 tie only by another stage (`elsewhere`, or `nowhere_else ... and
    pp > 1`); with one stage the op is `undecided` and judges nobody, so nothing is left out
    and the engine refuses every step. Every window analysed (the disputed op left out of the
    window, or rank 1's replica, named), rank 0's slowness seen."""
    trace = slow_job(steps=20, dp=2, pp=1, slow=(0, 0, 3.0))
    job = windows_of(tmp_path, trace, dropping(1, "grads-reduce-scatter"), TOKEN, MONITOR)
    straggler_seen(job)


def test_a_pipeline_transfer_lost_at_one_rank_leaves_no_window_unanalysed(tmp_path):
    """The 2x2 job (rank 0 3x slow; S ~1.6) whose rank 3 (dp 1, pp 1) lost its forward-recv
    rows (a recorder that does not time receives; hostile). Each part 200, every window (4 of
    4) an error 'no step has ops from every worker ... ops missing from workers (dp 1, pp 1)':
    the odd worker is named but not left out. whatif/grid.odd_workers leaves a 1-1 tie over a
    pipeline transfer `undecided` (no other stage runs forward-recv; `nowhere_else` settles
    collectives only), so nobody is left out and the engine refuses every step. Every window
    analysed (rank 3's replica left out, named), rank 0's slowness seen."""
    trace = slow_job(steps=20, slow=(0, 0, 3.0))
    straggler_seen(windows_of(tmp_path, trace, dropping(3, "forward-recv"), TOKEN, MONITOR))


def test_one_ranks_collectives_on_a_later_clock_do_not_make_a_straggler(tmp_path):
    """A healthy 2x2 job (steps ~0.33 s; S ~1.007) whose rank 3 times its collectives on
    another clock than its computes, 0.05 s later (a recorder timing compute on the host and
    collectives by device events calibrated apart; hostile): every collective of rank 3 ends
    0.05 s after its peers' ends of the same collective, its computes are on time. All parts
    200; windows S 1.131/1.134/1.135/1.134 and `straggling` fires. (+0.3 s: S 1.003-1.006;
    -0.05 s: S 1.005-1.008: both handled.) Rank 3 is neither moved (the window's notes are
    empty) nor left out: clocks.align_step_clocks judges the ends but moves only where the
    spans allow, and the span bound lets 0.05 s pass ('a tenth or 0.05 s'). A rank whose collective ends disagree with
    every peer's while its computes do not is not on another clock: its step is left out
    (named) or refused, and the windows read the healthy job."""
    trace = slow_job(steps=20, slow=None)

    def change(rank, cols):
        if rank != 3:
            return cols
        coll = ~np.isin(cols["optype"], [OPTYPE_CODES[n] for n in (
            "forward-compute", "backward-compute", "optimizer", "gc", "forward-send",
            "forward-recv", "backward-send", "backward-recv")])
        return {**cols, "start_ts": np.where(coll, cols["start_ts"] + 0.05, cols["start_ts"])}

    job = windows_of(tmp_path, trace, change, TOKEN, MONITOR)
    if job is not None:   # (healthy() less the windows' account of rank 3 left out)
        assert max(round(w["slowdown"], 3) for w in job["windows"] if w["slowdown"]) < 1.1
        assert not alerts_beyond_left_out(job, (1, 3)), job["alerts"]
