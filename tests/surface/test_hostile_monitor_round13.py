"""Red team round thirteen (issue 34): the live monitor against one rank's numbers that its own
timeline cannot hold (computes timed short or overlapping each other, a send before the compute
that feeds it, a GC pause through the rank's own ops, two GC pauses side by side), what round
twelve's fixes (collective ends judged, the span bound, odd op sets) leave open.

Each test is one defect class, marked xfail(strict=True) until its fix lands (then the mark goes):
a pass before the fix fails the suite, so each flips exactly when its defect is gone. Real
servers on loopback (the monitor on a thread of this process), real SQLite, real parts.
"""

from __future__ import annotations

import sys

import numpy as np

from conftest import REPO, eventually
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.model import OPTYPE_CODES

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import (at_rank, get, healthy, parts_of, serving_job, slow_job,  # noqa: E402
                          straggler_seen, windows_of)

TOKEN = "hostile-round13-token-0123456789"
MONITOR = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)
COMPUTE = [OPTYPE_CODES[n] for n in ("forward-compute", "backward-compute", "optimizer", "gc")]
GC = OPTYPE_CODES["gc"]


def _with_rows(cols: dict, add: dict) -> dict:
    """`cols` with the rows `add`, in the recorder's order (step, start)."""
    merged = {k: np.concatenate([cols[k], add[k]]) for k in cols}
    order = np.lexsort((merged["start_ts"], merged["step"]))
    return {k: v[order] for k, v in merged.items()}


def _earlier(optype: str, by: float):
    """A part change: `optype`'s rows start `by` seconds earlier, their ends kept."""
    code = OPTYPE_CODES[optype]

    def change(cols):
        sel = cols["optype"] == code
        return {**cols, "start_ts": np.where(sel, cols["start_ts"] - by, cols["start_ts"]),
                "duration": np.where(sel, cols["duration"] + by, cols["duration"])}
    return change


def test_one_ranks_computes_timed_short_do_not_blame_an_honest_rank(tmp_path):
    """A healthy 2x2 job (steps ~0.33 s; S ~1.005, no alert) whose rank 3 (dp 1, pp 1) writes
    its compute ops (forward, backward, optimizer) with duration 0.0 and everything else as
    it is: a recorder that timed computes on the host without synchronising (a kernel's
    launch, not its run), or a hostile uploader. Its collectives and transfers still start
    and end where its peers' do, so the clock checks of round twelve see nothing. Every
    window reads S 1.319-1.322 and `worker_fault` (critical) fires at rank 2 (dp 0, pp 1,
    healthy), `straggling` with it (/3 instead of 0: S 1.19, the same alerts; /1000, a ms
    slip: S 1.32; in a 4x2 job one rank of 8 so: S 1.15, `straggling`). One worker's
    understated computes set the ideal its stage peers are judged against. A rank whose
    computes cannot fill the time between its own transfers (rank 3 idles 2/3 of every step
    while its peers wait on nobody) is refused, or its computes are left out of the ideal
    (named); the windows read the healthy job and nothing fires."""
    trace = slow_job(steps=20, slow=None)
    zero = at_rank(3, lambda cols: {**cols, "duration": np.where(
        np.isin(cols["optype"], COMPUTE), 0.0, cols["duration"])})
    healthy(windows_of(tmp_path, trace, zero, TOKEN, MONITOR))


def test_a_straggler_slow_between_its_kernels_is_alerted(tmp_path):
    """The 2x2 job whose rank 0 (dp 0, pp 0) is a real 3x straggler (S ~1.6, severe and
    worker_fault at rank 0). Its parts are written with its compute durations divided by 3,
    its start times as they were: its kernels take their normal time and the slowness sits
    in the gaps between them, as on a host-bound rank (slow launches, a CPU-starved data
    loader) or under a recorder that hides it. Every rank's step still takes ~2.4x as long,
    its peers waiting on rank 0 at every collective. Each window finds it (cause host_stall
    at rank 0, 'fixing it would make steps 2.35x faster') but reads S 1.005-1.008 (S leaves
    launch delays out, whatif/_analyze), `stragglers_slowdown` 1.006, every worker_score
    1.0; no default rule (monitor/alerts.DEFAULT_RULES) looks at host_stall, and its one
    alert, `new_cause` (info), fires at window 0 and resolves at window 1 while the stall
    goes on in every window: nothing is left firing. A hold-up of 2.35x in every window
    fires a warning or critical alert (a host_stall rule, or S counting launch delays) that
    stays firing while the cause does."""
    trace = slow_job(steps=20, slow=(0, 0, 3.0))
    short = at_rank(0, lambda cols: {**cols, "duration": np.where(
        np.isin(cols["optype"], COMPUTE), cols["duration"] / 3, cols["duration"])})
    job = windows_of(tmp_path, trace, short, TOKEN, MONITOR)
    if job is None:
        return
    slowdowns = [round(w["slowdown"], 3) for w in job["windows"]]
    firing = [a["rule"] for a in job["alerts"] if a["labels"]["severity"] != "info"]
    assert min(slowdowns) > 1.15 or firing, (slowdowns, job["windows"][-1]["causes"],
                                             [(e["rule"], e["status"], e["window"])
                                              for e in job["alert_log"]])


def test_two_gc_pauses_side_by_side_leave_the_window_analysed(tmp_path):
    """The 2x2 job (rank 0 3x slow; S ~1.6). Rank 3 records two GC pauses back to back after
    its first forward compute of each step (1 us each, seq_id 0 and 1, apart in time: a
    gen-0 collection and the gen-2 one it set off, as gc.callbacks reports them). Every
    part is stored (200; part_rows.check_seq_ids leaves GC rows out, 'the grid numbers those
    itself'), then every window (4 of 4) is an error 'field seq_id: two ops share (dp_rank=1,
    stage=1, step=.., optype=gc, seq_id=0)': whatif/grid numbers a pause by the computes
    before it (gc_slots), two pauses in one slot share a cell and the whole window is
    refused; the straggler is never reported. Pauses sharing a slot are one pause (their
    durations summed) or the later one its own cell: every window analysed, rank 0 seen."""
    trace = slow_job(steps=20, slow=(0, 0, 3.0))

    def two_pauses(cols):
        fc = np.flatnonzero((cols["optype"] == OPTYPE_CODES["forward-compute"])
                            & (cols["mb_id"] == 0))
        add = {k: np.concatenate([v[fc], v[fc]]) for k, v in cols.items()}
        end = np.concatenate([cols["start_ts"][fc] + cols["duration"][fc]] * 2)
        n = len(fc)
        add["optype"][:] = GC
        add["mb_id"][:] = -1
        add["seq_id"] = np.repeat(np.array([0, 1], np.int32), n)
        add["start_ts"] = end + np.repeat([0.0, 2e-6], n)
        add["duration"] = np.full(2 * n, 1e-6)
        return _with_rows(cols, add)

    straggler_seen(windows_of(tmp_path, trace, at_rank(3, two_pauses), TOKEN, MONITOR))


def test_a_gc_pause_through_its_ranks_own_ops_does_not_make_a_straggler(tmp_path):
    """A healthy 2x2 job (S ~1.005, no alert) whose rank 3 writes one `gc` row per step, 0.2 s
    long, starting with the step's first op: a pause of the host during which the same rank
    launched and ran its all-gather, receives and forward computes (every one of them on
    time, ending where its peers' ends say). A GC pause stops the host: ops it launches
    cannot start inside it. Every window reads S 1.252-1.257 and `straggling` fires: the
    analysis takes the pause at its stated length though the rank's own timeline has no room
    for it. A pause overlapping the rank's own later ops is cut to the time they leave
    (here none) or refused; the windows read the healthy job and nothing fires."""
    trace = slow_job(steps=20, slow=None)

    def pause(cols):
        steps, first = np.unique(cols["step"], return_index=True)
        add = {k: v[first].copy() for k, v in cols.items()}
        add["optype"][:] = GC
        add["mb_id"][:] = -1
        add["seq_id"][:] = 0
        add["duration"] = np.full(len(steps), 0.2)
        return _with_rows(cols, add)

    healthy(windows_of(tmp_path, trace, at_rank(3, pause), TOKEN, MONITOR))


def test_a_send_starting_before_the_compute_that_feeds_it_does_not_make_a_straggler(tmp_path):
    """A healthy 2x2 job (S ~1.005, no alert) whose rank 3 (dp 1, pp 1) writes each
    backward-send 0.05 s earlier with its end kept (duration + 0.05 s): the send now starts
    before the backward compute whose gradient it carries (backward computes are ~0.04 s),
    which no schedule allows; its end, and its partner's receive, are where they were, so
    the clock checks by collective ends and the transfer pairing see nothing. Every window
    reads S 1.189-1.198 and `straggling` fires (the same for forward-recv 0.05 s early,
    S 1.13). A transfer that starts before the compute it depends on ended, on its own
    rank, is cut to start there (or the step left out, named); the windows read the healthy
    job and nothing fires."""
    trace = slow_job(steps=20, slow=None)
    early = at_rank(3, _earlier("backward-send", 0.05))
    healthy(windows_of(tmp_path, trace, early, TOKEN, MONITOR))


def test_computes_overlapping_on_one_rank_do_not_make_a_straggler(tmp_path):
    """A healthy 2x2 job (S ~1.005, no alert) whose rank 3 (dp 1, pp 1) writes its compute
    durations x3 with its start times kept: each forward and backward compute now runs on
    through the ops its rank started after it (two computes at once on one compute stream;
    a send of a gradient not computed yet), while its transfers and collectives start and
    end where its peers' say. Every window reads S 1.719-1.725; `severe` and `worker_fault`
    (critical, at rank 3) and `straggling` fire (rank 2's computes x3: S 1.75 the same). The
    other side too: rank 3's backward computes starting 0.02 s inside its forward computes,
    ends kept, S 1.16 and worker_fault. (x10: S 1.003-1.006, nothing fires.)
    A compute is charged only the time its own stream leaves it (from the later of its start
    and the previous op's end to the earlier of its end and the next op's start), or the
    rank's step left out, named; the windows read the healthy job and nothing fires."""
    trace = slow_job(steps=20, slow=None)
    longer = at_rank(3, lambda cols: {**cols, "duration": np.where(
        np.isin(cols["optype"], COMPUTE), cols["duration"] * 3, cols["duration"])})
    healthy(windows_of(tmp_path, trace, longer, TOKEN, MONITOR))


def test_a_straggler_left_out_by_the_clock_check_is_not_silent(tmp_path):
    """The 2x2 job whose rank 3 (dp 1, pp 1) is a real 3x straggler (S ~1.72, severe and
    worker_fault at rank 3). Rank 3 writes its gradient collectives' starts (all-gather,
    layernorm/embedding all-reduces, reduce-scatter, clip) 0.03 s later and earlier in
    turn, their durations kept (a jittery device clock; a straggler hiding itself): no one
    offset explains its ends, so clocks.align_step_clocks leaves each of its steps out, and
    with every step of it out windows._leave_out drops rank 3 (and whole_replicas its
    replica peer, rank 1). Every window reads S 1.000-1.002 (causes 'partial'), `notes` is
    empty and nothing is left firing: `ranks_left_out` (session 49's warning for ranks left
    out) holds only for the engine's odd workers (result.left_out), not for ranks the clock
    check or _leave_out removed. The straggler and half the job vanish without a word. A
    window that left ranks out for their clocks names them in its notes and
    `ranks_left_out` fires (or the straggler is still seen)."""
    trace = slow_job(steps=20, slow=(1, 1, 3.0))
    gradient = [OPTYPE_CODES[n] for n in (
        "params-all-gather", "grads-reduce-scatter", "layernorm-grads-all-reduce",
        "embedding-grads-all-reduce", "optimizer-clip-main-grad")]

    def jitter(cols):
        sign = np.where(np.arange(len(cols["step"])) % 2 == 0, 1.0, -1.0)
        return {**cols, "start_ts": np.where(np.isin(cols["optype"], gradient),
                                             cols["start_ts"] + 0.03 * sign, cols["start_ts"])}

    job = windows_of(tmp_path, trace, at_rank(3, jitter), TOKEN, MONITOR)
    if job is None:
        return
    slowdowns = [round(w["slowdown"], 3) for w in job["windows"]]
    firing = [a["rule"] for a in job["alerts"] if a["labels"]["severity"] != "info"]
    assert min(slowdowns) > 1.15 or firing, (slowdowns, [w["causes"] for w in job["windows"]],
                                             job["alerts"])


def test_the_fast_detector_is_not_moved_by_computes_longer_than_their_step(tmp_path):
    """A healthy data-parallel job of 4 ranks (dp 4, pp 1; 100 steps of ~0.33 s, windows of 10
    steps: S 1.007-1.010 in every window) whose rank 3 writes its compute durations x3 from
    step 50 on, its start times kept: each compute now runs through the ops after it, and
    the rank's computes sum to ~2x its step's whole span, which one compute stream cannot
    hold. The window analysis cuts them (every window S <= 1.010, nothing from it), but the
    fast detector (changes.busy_per_step: the sum of compute durations) reads rank 3 2-3x
    slower and fires `rank_slowdown` (warning, detector fast) at rank 3. A rank's busy time
    is the union of its computes within its step (or durations cut at the next op's start,
    as the analysis does); no alert fires."""
    from stragglers.trace.runformat import table_bytes

    trace = slow_job(steps=100, dp=4, pp=1, slow=None)
    config = MonitorConfig(window_steps=10, stall_after_s=600, tick_s=0.05)
    with serving_job(tmp_path / "mon.db", trace, TOKEN, config) as c:
        for rank, n, cols in parts_of(trace, 10):
            if rank == 3:
                late = np.isin(cols["optype"], COMPUTE) & (cols["step"] >= 50)
                cols = {**cols, "duration": np.where(late, cols["duration"] * 3,
                                                     cols["duration"])}
            r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}", content=table_bytes(cols))
            assert r.status_code == 200, r.text
        eventually(lambda: get(c, "/api/jobs/j?history=100")["windows_total"] >= 10,
                   what="windows 0-9")
        # the change detector's pass over every part is counted until done (Monitor.idle)
        eventually(lambda: get(c, "/api/stats")["idle"], what="the monitor idle")
        job = get(c, "/api/jobs/j?history=100")
    slowdowns = [round(w["slowdown"], 3) for w in job["windows"]]
    assert max(slowdowns) < 1.1, slowdowns
    # (the windows leave rank 3's steps out, its computes running past its next step, and say
    # so since round 13 #8: `ranks_left_out` naming rank 3, and the cause 'partial' they
    # leave, are the windows' account of it; no rank is blamed, no change detected)
    said = [a for a in job["alerts"] if a["rule"] == "ranks_left_out"
            or (a["rule"] == "new_cause" and a["labels"]["cause"] == "partial")]
    assert all("rank(s) 3:" in a["annotations"]["description"] for a in said
               if a["rule"] == "ranks_left_out"), said
    assert not [a for a in job["alerts"] if a not in said], \
        [(a["rule"], a["labels"]) for a in job["alerts"]]


def test_a_restart_does_not_resolve_a_rank_slowdown_that_goes_on(tmp_path):
    """A data-parallel job of 4 ranks (dp 4, pp 1; windows of 10 steps): 30 healthy steps,
    then rank 3 runs 3x slow to the end (60 steps; every window from then on S 1.98,
    worker_fault at rank 3). After 30 slow steps the fast detector fires `rank_slowdown` at
    rank 3; the monitor is then restarted on its store (an upgrade, a crash) and the
    remaining 30 slow steps arrive. The new RankChangeDetector (watchdog._detector) starts
    from nothing: it warms up on rank 3's slow steps, takes them as the rank's baseline,
    judges rank 3 not firing, and on_changes resolves the alert (a `resolved` sent to the
    receivers) while the windows still read S 1.98. Without the restart the same parts leave
    it firing. What a firing fast alert fired against (its frozen baseline) survives a
    restart, or a firing alert stays until the rank is judged against a baseline from
    before it fired."""
    import httpx

    from stragglers.monitor.server import MonitorServer
    from stragglers.trace.runformat import table_bytes

    ops, shift, first = [], 0.0, 0
    for slow, seed, steps in ((None, 0, 30), ((3, 0, 3.0), 1, 60)):
        piece = {k: v.copy() for k, v in
                 slow_job(steps=steps, dp=4, pp=1, slow=slow, seed=seed).ops.items()}
        piece["step"] += first
        piece["start_ts"] += shift
        shift = float((piece["start_ts"] + piece["duration"]).max()) + 0.01
        first = int(piece["step"].max()) + 1
        ops.append(piece)
    trace = slow_job(steps=1, dp=4, pp=1, slow=None)
    trace.ops = {k: np.concatenate([o[k] for o in ops]) for k in ops[0]}
    parts = parts_of(trace, 10)
    config = MonitorConfig(window_steps=10, stall_after_s=600, tick_s=0.05)
    db = tmp_path / "mon.db"

    def serve(numbers, windows: int) -> list[str]:
        """Parts `numbers` PUT on a monitor of `db`; the ranks of rank_slowdown firing once
        `windows` windows closed and the monitor is idle (the detector's pass done)."""
        s = MonitorServer(db, port=0, token=TOKEN, config=config).start()
        try:
            with httpx.Client(base_url=s.url, timeout=60,
                              headers={"Authorization": f"Bearer {TOKEN}"}) as c:
                if 0 in numbers:   # (the job's meta.json once, as its recorder does)
                    assert c.put("/api/jobs/j/meta",
                                 json=trace.meta.to_dict()).status_code == 200
                for rank, n, cols in parts:
                    if n in numbers:
                        r = c.put(f"/api/jobs/j/ranks/{rank}/parts/{n}",
                                  content=table_bytes(cols))
                        assert r.status_code == 200, r.text
                eventually(lambda: get(c, "/api/jobs/j?history=100")["windows_total"]
                           >= windows, what=f"{windows} windows")
                eventually(lambda: get(c, "/api/stats")["idle"], what="the monitor idle")
                job = get(c, "/api/jobs/j?history=100")
                return [a["labels"]["rank"] for a in job["alerts"]
                        if a["rule"] == "rank_slowdown"], \
                    [round(w["slowdown"], 2) for w in job["windows"]]
        finally:
            s.stop()

    firing, _ = serve(range(6), 5)
    assert firing == ["3"], firing   # fired before the restart
    firing, slowdowns = serve(range(6, 9), 8)
    assert firing == ["3"], (firing, slowdowns[-3:])
