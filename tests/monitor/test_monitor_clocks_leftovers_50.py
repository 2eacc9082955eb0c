"""What session 49 left of the rank clocks' weaknesses (issue 34, monitor/clocks.py): a flat
1 ms tolerance on collective ends, a rank whose steps are numbered one apart from its peers',
and two equal halves of a job one of which writes its durations in another unit. Each through
a real monitor on loopback (real SQLite, the engine's real analysis) where the windows read
it, the alignment alone where it says all."""

from __future__ import annotations

import numpy as np
import pytest

from monitor_jobs import alerts_beyond_left_out, at_rank, healthy, slow_job, straggler_seen, \
    windows_of
from stragglers.monitor.clocks import _RECV, _SEND, _SYNC, align_step_clocks
from stragglers.monitor.settings import MonitorConfig
from stragglers.trace.model import Trace
from test_monitor_clocks_small_offsets import jittered
from test_monitor_rank_clocks import healthy as healthy_job
from test_monitor_rank_clocks import moved

TOKEN = "clocks-leftovers-50-token-0123456789"
MONITOR = MonitorConfig(window_steps=5, stall_after_s=600, tick_s=0.05)


def scaled(trace: Trace, factor: float) -> Trace:
    """The job with every time `factor` times as long (the healthy 2x2 job's steps ~0.33 s)."""
    o = {k: v.copy() for k, v in trace.ops.items()}
    o["start_ts"] = o["start_ts"].astype(np.float64) * factor
    o["duration"] = o["duration"].astype(np.float64) * factor
    return Trace(o, trace.meta, trace.source)


def later(seconds: float):
    """A part change: the rows' clock `seconds` ahead."""
    return lambda cols: {**cols, "start_ts": cols["start_ts"] + seconds}


def test_a_clock_under_a_millisecond_off_on_20_ms_steps_is_moved(tmp_path):
    # steps of ~20 ms, rank 3 0.9 ms ahead: a flat 1 ms tolerance left it where it was and
    # the windows read it as waiting (before: S 1.098/1.100/1.106/1.103, `straggling`); the
    # step's tolerance (1/256 of its span: 76 us) moves it, as 2 ms was
    job = windows_of(tmp_path, scaled(slow_job(steps=20, slow=None), 0.06),
                     at_rank(3, later(0.0009)), TOKEN, MONITOR)
    assert max(w["slowdown"] for w in job["windows"]) < 1.02, job["windows"]
    healthy(job)
    assert any(n.startswith("rank 3: its clock was moved by -0.0009") for n in
               job["window"]["notes"]), job["window"]["notes"]


@pytest.mark.parametrize("seed", range(3))
def test_hosts_jitter_of_a_tenth_of_a_second_on_minute_steps_leaves_nothing_out(seed):
    # steps of ~58 s, every collective end jittered within ±0.1 s (0.17 % of the step): no
    # offset, nothing left out (before: 15-17 rank steps of honest ranks left out as numbers
    # no offset explains, their ends more than 2 ms from every peer's); a clock 1 s off there
    # is still moved
    job = scaled(healthy_job(), 180.0)
    clocks = align_step_clocks(jittered(job, 0.1, seed).ops)
    assert (clocks.start_ts, clocks.moved, clocks.left_out) == (None, {}, {})
    clocks = align_step_clocks(moved(jittered(job, 0.1, seed), 1.0).ops)
    assert clocks.moved == {(3, s): pytest.approx(1.0, abs=0.2) for s in range(20)}
    assert clocks.left_out == {}


def numbered(d: int):
    """A part change: the rows' steps numbered `d` on."""
    return lambda cols: {**cols, "step": cols["step"] + d}


def test_a_rank_counting_its_steps_from_one_is_left_out_named_not_moved(tmp_path):
    # rank 3's step s holds its peers' step s-1 (a recorder counting from 1): every window
    # analysed without it, no clock moved (before: 12 of its 19 steps moved by 0.32 s, each
    # analysed with its step s-1's numbers as step s, 7 left out)
    job = windows_of(tmp_path, slow_job(steps=20, slow=None), at_rank(3, numbered(1)), TOKEN,
                     MONITOR)
    # (rank 3 left out, its replica's rank 1 with it: named, ranks_left_out; nothing else)
    assert max(w["slowdown"] for w in job["windows"] if w["slowdown"]) < 1.1, job["windows"]
    assert not alerts_beyond_left_out(job, (1, 3)), job["alerts"]
    last = job["window"]
    assert 3 in last["missing_ranks"] and not [n for n in last["notes"] if "moved" in n], last


@pytest.mark.parametrize("d", [1, -1])
def test_each_step_of_a_rank_numbered_apart_is_named_with_the_shift(d):
    # (before, +1: 12 of 19 steps moved, 7 left out as lying before their peers' ends; -1:
    # likewise after)
    o = {k: v.copy() for k, v in healthy_job().ops.items()}
    o["step"][o["rank"] == 3] += d
    keep = (o["step"] >= 0) & (o["step"] <= 19)
    clocks = align_step_clocks({k: v[keep] for k, v in o.items()})
    steps = range(1, 20) if d > 0 else range(19)
    assert clocks.moved == {} and set(clocks.left_out) == {(3, s) for s in steps}
    why = clocks.left_out[(3, 7)]
    assert why.startswith(f"step 7: the rank's steps are numbered apart from its peers' by "
                          f"{-d:+d} (its step 7 holds their step {7 - d}"), why


def tenth(cols):
    return {**cols, "duration": cols["duration"] / 1000}


@pytest.mark.parametrize("ranks", [(1, 3), (0, 2)])
def test_half_the_ranks_writing_durations_in_ms_do_not_make_a_straggler(tmp_path, ranks):
    # the 2x2 job's replica 1 (ranks 1 and 3) or replica 0 writes every duration /1000: two
    # equal halves, no majority of ranks on one clock. Where a rank of the slipped half came
    # first to a collective, it ends before its peer began, which no clock allows: it is
    # left out, the window read without its replica (before, (1, 3): S 2.007/2.005/2.004/
    # 1.006; (0, 2): 2.009/2.014/2.009/2.011, `straggling` and `worker_fault`)
    job = windows_of(tmp_path, slow_job(steps=20, slow=None),
                     lambda r, cols: tenth(cols) if r in ranks else cols, TOKEN, MONITOR)
    # (the slipped half left out, named: ranks_left_out; nothing else)
    assert max(w["slowdown"] for w in job["windows"] if w["slowdown"]) < 1.1, job["windows"]
    assert not alerts_beyond_left_out(job, ranks), job["alerts"]
    assert set(ranks) <= set(job["window"]["missing_ranks"]), job["window"]


def test_a_real_straggler_beside_a_slipped_half_is_still_seen(tmp_path):
    # rank 0 (replica 0) three times slower, replica 1's durations /1000: replica 1 left out,
    # the straggler read in replica 0
    job = windows_of(tmp_path, slow_job(steps=20, slow=(0, 0, 3.0)),
                     lambda r, cols: tenth(cols) if r in (1, 3) else cols, TOKEN, MONITOR)
    straggler_seen(job)


@pytest.mark.parametrize("jump", [3600.0, 0.05, -0.05])
def test_a_clock_stepped_within_one_step_leaves_that_step_out_and_no_peer(jump):
    # rank 3's later half of step 6 an hour (50 ms) on: its peers' ends of that step lie before
    # its starts, which does not make them the ones whose numbers are wrong (one step of the
    # window; the judgement is the window's): only rank 3's step 6 is left out, as before
    o = {k: v.copy() for k, v in slow_job(steps=20, slow=(1, 1, 3.0)).ops.items()}
    at = np.flatnonzero((o["rank"] == 3) & (o["step"] == 6))
    at = at[np.argsort(o["start_ts"][at])]
    o["start_ts"][at[len(at) // 2:]] += jump
    for lo, hi in ((0, 20), (5, 10)):   # (the whole job, and the window holding step 6)
        sel = (o["step"] >= lo) & (o["step"] < hi)
        clocks = align_step_clocks({k: v[sel] for k, v in o.items()})
        assert set(clocks.left_out) == {(3, 6)} and clocks.moved == {}, clocks


@pytest.mark.parametrize("seed", range(3))
def test_a_rank_whose_collective_times_are_scattered_judges_no_honest_peer(seed):
    # rank 2 on a clock 100 s ahead (moved, its set placed), rank 3 5e4 s off with its
    # collectives' times scattered by ±20 ms (no offset: every step of it left out): rank
    # 2's ends lie before some of rank 3's scattered starts, which is rank 3's doing; only
    # rank 3 is left out (judged against every set left out, rank 2 was too: S an error)
    o = moved(moved(healthy_job(), 100.0, ranks=(2,)), 5e4).ops
    sync = (o["rank"] == 3) & np.isin(o["optype"], [*_SYNC, *_SEND, *_RECV])
    o["start_ts"][sync] += np.random.default_rng(seed).uniform(-0.02, 0.02, int(sync.sum()))
    clocks = align_step_clocks(o)
    assert {r for r, _ in clocks.left_out} == {3}
    assert clocks.moved == {(2, s): pytest.approx(100.0, abs=1e-3) for s in range(20)}
