"""A rank on another clock for a step (a host's clock stepped by NTP or by hand, a constant
offset, a wild jump between parts) is moved onto the other ranks' clock by its collective ends,
or its step is left out (monitor/clocks.py): on one clock every rank's span of a step overlaps
the others', since they meet at its collectives. Before, the engine read the gap as waiting: a
healthy 2x2 job with one rank 5e4 s off read S 1.21 in every window (1.005 on one clock).
Steps each timed from their own start are never moved; a host's jitter is tested in test_monitor_clocks_small_offsets.py.
Synthetic jobs, real trackers, the engine's real analysis (the red team's through a real
monitor: tests/surface/test_hostile_services_round10.py)."""

from __future__ import annotations

import functools

import numpy as np
import pytest

from monitor_jobs import parts_of, slow_job
from stragglers.monitor.clocks import align_step_clocks
from stragglers.monitor.windows import JobTracker, analyse_window
from stragglers.trace.model import OPTYPE_CODES, Trace
from test_monitor_step_clocks import job, restarted


@functools.cache
def healthy() -> Trace:
    """A healthy dp2 x pp2 job of 20 steps (no slow worker: S ~1.007). Shared: copy."""
    return slow_job(steps=20, slow=None)


def moved(trace: Trace, seconds: float, ranks=(3,), from_step: int = 0) -> Trace:
    """The job with `ranks`' clock `seconds` off from `from_step` on (durations as they were)."""
    o = {k: v.copy() for k, v in trace.ops.items()}
    o["start_ts"][np.isin(o["rank"], ranks) & (o["step"] >= from_step)] += seconds
    return Trace(o, trace.meta, trace.source)


def slowdowns(trace: Trace, per_part: int = 5, window_steps: int = 5):
    """S of each window of the job (parts of `per_part` steps, all delivered), the refusals of
    all and each window's missing ranks."""
    tracker = JobTracker("j", trace.meta, window_steps=window_steps, gap_wait_s=0.0)
    for rank, n, cols in parts_of(trace, per_part):
        tracker.add_part(rank, n, int(cols["step"].max()), cols, 1.0)
    cut = tracker.close_ready(2.0)
    tail = tracker.close_partial("finished", 3.0)
    rows = [analyse_window(w) for w in cut + ([tail] if tail else [])]
    assert all(row.error is None for row, _ in rows), [row.error for row, _ in rows]
    return ([row.slowdown for row, _ in rows], [r for _, rs in rows for r in rs],
            [row.missing_ranks for row, _ in rows])


def same(plain: list[float], windows: int):
    """slowdowns' answer for a job read as on one clock: S of `plain` each (to 1e-3: collective
    ends agree to a fraction of a millisecond, not to the bit), nothing refused or missing."""
    return pytest.approx(plain, abs=1e-3), [], [[]] * windows


def test_a_rank_whose_clock_is_5e4_s_off_from_its_first_part_reads_as_on_one_clock():
    # (before: S 1.205, 1.208, 1.21, 1.216 in windows 0-3, plain 1.005-1.008)
    plain, _, _ = slowdowns(healthy())
    assert max(plain) < 1.02, plain
    assert slowdowns(moved(healthy(), 5e4)) == same(plain, 4)


def test_a_forward_jump_of_1e9_s_between_parts_reads_as_on_one_clock():
    # (before: window 0 S 1.005, windows 1-3 1.208-1.216: the clock jumped at part 1, step 5)
    plain, _, _ = slowdowns(healthy())
    assert slowdowns(moved(healthy(), 1e9, from_step=5)) == same(plain, 4)
    # an hour back at step 5 (its step 5 begins before its step 4 did) likewise (before: 1.19)
    assert slowdowns(moved(healthy(), -3600.0, from_step=5)) == same(plain, 4)


def test_two_ranks_of_one_host_off_together_are_moved_together_and_a_straggler_still_shows():
    # ranks 1 and 3 (host1) an hour behind ranks 0 and 2, a real straggler at dp 1, pp 1:
    # the two sets are as large, the one holding rank 0 stays (before: S 1.82 against 1.72)
    trace = slow_job(steps=20)
    plain, _, _ = slowdowns(trace)
    assert min(plain) > 1.5, plain
    assert slowdowns(moved(trace, -3600.0, ranks=(1, 3))) == same(plain, 4)


def test_steps_each_timed_from_their_own_start_with_one_rank_off_keep_every_step():
    # NDTimeline-like: every rank's sampled steps each from ~0 s, rank 3's 5e4 s off
    trace = restarted(job())
    plain, _, _ = slowdowns(trace, per_part=2)
    assert len(plain) == 2 and min(plain) > 1.5, plain
    assert slowdowns(moved(trace, 5e4), per_part=2) == same(plain, 2)


def test_steps_each_timed_from_their_own_start_are_never_moved():
    # steps each timed from their own start (their collectives' ends agree): nothing moved,
    # nothing left out (a small offset on one host is moved since s49-hK: see
    # test_monitor_clocks_small_offsets.py, with hosts' jitter within END_TOLERANCE_S kept)
    clocks = align_step_clocks(restarted(job()).ops)
    assert (clocks.start_ts, clocks.moved, clocks.left_out) == (None, {}, {})


def test_a_rank_off_whose_collective_ends_do_not_agree_has_its_steps_left_out_named():
    # rank 3 5e4 s off, its collectives' ends scattered by up to ±20 ms (no consensus within
    # END_TOLERANCE_S): no offset is trusted; each of its steps is left out, named, and the
    # window analysed without it (before: nothing refused, S 1.2)
    trace = moved(healthy(), 5e4)
    o = trace.ops
    sync = (o["rank"] == 3) & np.isin(o["optype"], [OPTYPE_CODES[n] for n in (
        "params-all-gather", "grads-reduce-scatter", "layernorm-grads-all-reduce",
        "embedding-grads-all-reduce", "forward-send", "forward-recv", "backward-send",
        "backward-recv")])
    o["start_ts"][sync] += np.random.default_rng(0).uniform(-0.02, 0.02, int(sync.sum()))
    got, refused, missing = slowdowns(trace)
    assert {source for source, _ in refused} == {"job j rank 3"}, refused
    assert [problem.split(":")[0] for _, problem in refused] == [f"step {s}" for s in range(20)]
    assert "another clock" in refused[0][1] and "\n" not in refused[0][1], refused[0][1]
    assert missing == [[3]] * 4 and max(got) < 1.1, (missing, got)
