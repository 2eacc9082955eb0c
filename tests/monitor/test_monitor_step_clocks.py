"""The op-span bounds on steps each timed from their own start (NDTimeline samples sampled steps
so: every step begins near 0 s) and on one clock. "An op ends after its rank's next step began"
holds only where the next step follows on the same clock (it began after half of this step's
ops had: part_limits.op_spans); every rank's step is also bounded, clock-free, by the other
ranks' same step (windows.spans_past_others), so a rank cannot switch the bound off by making
its steps look restarted, and a stall the others did not wait for is not taken. Synthetic jobs
(the real samples: test_monitor_real_sampled_steps.py), real trackers, the engine's real
analysis."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from monitor_jobs import parts_of, slow_job
from stragglers.monitor.part_limits import check_op_spans
from stragglers.monitor.windows import JobTracker, analyse_window
from stragglers.trace.model import Trace

SAMPLED = [0, 1, 3, 4, 6, 9, 10, 11, 13, 14]   # (as NDTimeline's: some consecutive, some not)


@functools.cache
def job(slow: bool = True, steps: int = 15) -> Trace:
    """A dp2 x pp2 job (rank 3 at dp 1, pp 1 three times slower where `slow`) whose steps last
    ~6 s, as NDTimeline's samples' 2-46 s: a step shorter than OP_END_SLACK_S (the synthetic
    job's 0.3 s) hides an op's end past its next step's start inside the slack. Shared: copy."""
    trace = slow_job(steps=steps, slow=(1, 1, 3.0) if slow else None)
    trace.ops["start_ts"] = trace.ops["start_ts"] * 20.0
    trace.ops["duration"] = trace.ops["duration"] * 20.0
    return trace


def restarted(trace: Trace, ranks=None, keep=SAMPLED) -> Trace:
    """The job with each step of `ranks` (None: all) timed from that step's own start, its
    earliest op on those ranks, as NDTimeline records it; only the steps in `keep`."""
    o = {k: v.copy() for k, v in trace.ops.items()}
    mine = np.ones(len(o["step"]), bool) if ranks is None else np.isin(o["rank"], ranks)
    for s in np.unique(o["step"]):
        at = mine & (o["step"] == s)
        o["start_ts"][at] -= o["start_ts"][at].min()
    sel = np.isin(o["step"], keep)
    return Trace({k: v[sel] for k, v in o.items()}, trace.meta, trace.source)


def poisoned(trace: Trace, rank: int, step: int, seconds: float = 3000.0) -> Trace:
    """The job with the first op of `rank` at `step` lasting `seconds` (nothing else moved)."""
    o = {k: v.copy() for k, v in trace.ops.items()}
    o["duration"][int(np.flatnonzero((o["rank"] == rank) & (o["step"] == step))[0])] = seconds
    return Trace(o, trace.meta, trace.source)


def windows(trace: Trace, per_part: int = 1, window_steps: int = 5):
    """Each window of the job (parts of `per_part` steps, all delivered) analysed:
    [(window, row, refused)]."""
    tracker = JobTracker("j", trace.meta, window_steps=window_steps, gap_wait_s=0.0)
    for rank, n, cols in parts_of(trace, per_part):
        tracker.add_part(rank, n, int(cols["step"].max()), cols, 1.0)
    cut = tracker.close_ready(2.0)
    tail = tracker.close_partial("finished", 3.0)
    return [(w, *analyse_window(w)) for w in cut + ([tail] if tail else [])]


def test_a_rank_of_steps_each_timed_from_its_own_start_passes_its_part_check():
    # (refused before: "an op ... ending 0.3 s after the rank's step 1 began")
    trace = restarted(job())
    for rank in np.unique(trace.ops["rank"]).tolist():
        mine = trace.ops["rank"] == rank
        assert check_op_spans({k: v[mine] for k, v in trace.ops.items()}, rank) is None


def test_an_op_past_its_next_step_on_one_clock_is_still_refused_in_one_line():
    trace = poisoned(job(False, 6), rank=3, step=2)
    mine = trace.ops["rank"] == 3
    exc = check_op_spans({k: v[mine] for k, v in trace.ops.items()}, "part")
    assert exc is not None and exc.field == "duration", exc
    text = str(exc)
    assert "\n" not in text and "an op of 3000 s" in text and "on the same clock" in text, text


def test_windows_of_steps_each_timed_from_their_own_start_keep_every_step():
    # a real straggler (rank of dp 1, pp 1 three times slower): every step analysed, S shows it
    # (before: every step of every rank "ended after its next step began", steps left out)
    got = windows(restarted(job()), per_part=2)
    assert [w.steps for w, _, _ in got] == [SAMPLED[:5], SAMPLED[5:]]
    for w, row, refused in got:
        assert refused == [] and row.error is None, (refused, row.error)
        assert row.steps == w.steps and row.missing_ranks == []
        assert row.slowdown > 1.5, row.slowdown


@pytest.mark.parametrize("step", [3, 6])   # inside a window, and its last step
def test_a_poisoned_op_in_steps_each_timed_from_their_own_start_is_left_out(step):
    trace = poisoned(restarted(job(False)), rank=3, step=step)
    mine = trace.ops["rank"] == 3   # (its part cannot tell: one rank, no clock to compare)
    assert check_op_spans({k: v[mine] for k, v in trace.ops.items()}, "part") is None
    (w, row, refused), _ = windows(trace)
    assert [source for source, _ in refused] == ["job j rank 3"], refused
    assert refused[0][1].startswith(f"step {step}: an op of 3000 s ends"), refused
    assert row.steps == [s for s in w.steps if s != step], row.steps
    assert row.error is None and row.slowdown < 1.5, (row.error, row.slowdown)


def test_a_rank_cannot_switch_the_bound_off_by_restarting_its_clock_each_step():
    # one clock for ranks 0-2; rank 3 times each step from its own start and poisons step 3
    # (before: its first "overlapping" step alone was left out, step 3 analysed: S ~2,000)
    trace = poisoned(restarted(job(False), ranks=[3], keep=range(15)), rank=3, step=3)
    (w, row, refused), *_ = windows(trace)
    assert [(source, problem.split(":")[0]) for source, problem in refused] == \
        [("job j rank 3", "step 3")], refused
    assert row.steps == [0, 1, 2, 4], row.steps
    assert row.error is None and row.slowdown < 1.5, (row.error, row.slowdown)


def test_a_stall_on_one_ranks_clock_that_no_other_rank_waited_for_is_left_out():
    # rank 3's step 2 lasts 3,000 s more and its later steps begin after it, on its one clock
    # (its part is consistent), while the others went on: in a synchronous job they would
    # have waited (before: kept, S 1,863, nothing refused)
    base = job(False, 6)
    o = {k: v.copy() for k, v in base.ops.items()}
    three = o["rank"] == 3
    first = int(np.flatnonzero(three & (o["step"] == 2))[0])
    o["start_ts"][three & (o["start_ts"] > o["start_ts"][first])] += 3000.0
    o["duration"][first] += 3000.0
    trace = Trace(o, base.meta, base.source)
    assert check_op_spans({k: v[three] for k, v in o.items()}, "part") is None
    (w, row, refused), _ = windows(trace)
    assert [(source, problem.split(":")[0]) for source, problem in refused] == \
        [("job j rank 3", "step 2")], refused
    assert row.error is None and row.slowdown < 1.5, (row.error, row.slowdown)


def test_every_poisoned_step_of_a_rank_is_left_out_not_its_first_only():
    # (before: step 1 left out, step 3 analysed with its op of 3,000 s: S 2,329)
    trace = poisoned(poisoned(job(False, 6), 3, 1), 3, 3)
    (w, row, refused), _ = windows(trace)
    assert [(source, problem.split(":")[0]) for source, problem in refused] == \
        [("job j rank 3", "step 1"), ("job j rank 3", "step 3")], refused
    assert row.steps == [0, 2, 4] and row.slowdown < 1.5, (row.steps, row.slowdown)


def test_an_op_started_late_to_unchain_its_step_still_has_the_step_left_out():
    # one op of rank 3's step 2 starts 1e6 s later: the step's mean start passes its next
    # step's, so its part's check no longer compares them; the window's clock-free bound does
    base = job(False, 6)
    o = {k: v.copy() for k, v in base.ops.items()}
    at = np.flatnonzero((o["rank"] == 3) & (o["step"] == 2))
    o["start_ts"][at[0]] += 1e6
    o["duration"][at[1]] = 3000.0
    three = o["rank"] == 3
    assert check_op_spans({k: v[three] for k, v in o.items()}, "part") is None
    (w, row, refused), _ = windows(Trace(o, base.meta, base.source))
    assert [(source, problem.split(":")[0]) for source, problem in refused] == \
        [("job j rank 3", "step 2")], refused
    assert row.steps == [0, 1, 3, 4] and row.slowdown < 1.5, (row.steps, row.slowdown)


def _held_after_its_collectives(stall: float = 20.0) -> Trace:
    """The healthy job, one clock, rank 3 held `stall` s after its last op of step 2 (a
    checkpoint, a GC pause after the step's last collective); the others wait for it in
    their first op of step 3, and every later step begins that much later."""
    base = job(False, 9)
    o = {k: v.copy() for k, v in base.ops.items()}
    mine = np.flatnonzero((o["rank"] == 3) & (o["step"] == 2))
    o["duration"][mine[np.argmax(o["start_ts"][mine] + o["duration"][mine])]] += stall
    for rank in range(4):
        later = (o["step"] >= 3) & (o["rank"] == rank)
        head = np.flatnonzero(later & (o["step"] == 3))
        head = head[np.argmin(o["start_ts"][head])]
        o["start_ts"][later] += stall
        if rank != 3:
            o["start_ts"][head] -= stall
            o["duration"][head] += stall
    return Trace(o, base.meta, base.source)


def test_a_stall_waited_for_in_an_unrecorded_step_is_kept_with_steps_sampled():
    # every second step recorded (sample_every=2): the others waited for rank 3 in step 3,
    # which no one recorded; their step 4 began the stall later. The stall is kept, not
    # refused as a poisoned op (before: step 2 left out, S 1.003, the straggler hidden)
    held = _held_after_its_collectives()
    every = windows(held, window_steps=3)[0]
    o = held.ops
    kept = np.isin(o["step"], [0, 2, 4, 6, 8])
    sampled = Trace({k: v[kept] for k, v in o.items()}, held.meta, held.source)
    (w, row, refused), *_ = windows(sampled, window_steps=3)
    assert refused == [] and row.steps == [0, 2, 4], (refused, row.steps)
    assert row.slowdown > 1.3 and every[1].slowdown > 1.3, (row.slowdown, every[1].slowdown)
    # a stall of the same rank no one waited for (its later steps not moved) is still refused
    poisoned_ = poisoned(sampled, 3, 2)
    (w, row, refused), *_ = windows(poisoned_, window_steps=3)
    assert [(s, p.split(":")[0]) for s, p in refused] == [("job j rank 3", "step 2")], refused
