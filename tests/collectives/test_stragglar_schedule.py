"""Schedules: optimal for powers of two, valid for every n, and a verifier that catches errors."""

import re
import time

import pytest

from stragglers.collectives.schedule import (Schedule, Transfer, lower_bound_rounds, synthesize,
                                             verify)
from stragglers.errors import InputError, StragglersError

SPEC_N8 = """
R0: 0⇄S:0
R1: 1⇄S:1  0→3:0
R2: 2⇄S:2  1→4:1  0→5:0  3→6:0
R3: 3⇄S:3  4⇄0:1/0  5⇄1:0/1  6⇄2:0/2
R4: 4⇄S:4  5⇄2:1/2  6⇄0:2/1  1⇄3:1/3
R5: 5⇄S:5  6⇄1:2/3  0⇄3:2/3  2⇄4:2/4
R6: 6⇄S:6  0⇄2:3/4  1⇄4:3/4  3⇄5:3/5
R7: 0⇄3:4/5  1⇄5:4/5  2⇄6:4/6  S→4:6
R8: 0⇄2:5/6  1⇄4:5/6  3⇄6:5/6  S→5:6
"""
SPEC_N4 = """
R0: 0⇄S:0
R1: 1⇄S:1   0→2:0
R2: 2⇄S:2   0⇄1:0/1
R3: 0⇄2:1/2 S→1:2
"""


def parse(text: str, n: int) -> Schedule:
    """The spec's notation back into a Schedule (so the verifier can judge the paper's own)."""
    rank = lambda tok: n - 1 if tok == "S" else int(tok)  # noqa: E731
    rounds = []
    for line in text.strip().splitlines():
        rnd = []
        for tok in line.split(":", 1)[1].split():
            if m := re.fullmatch(r"(\d+)⇄S:(\d+)", tok):
                a, k = int(m[1]), int(m[2])
                rnd += [Transfer(a, n - 1, k, True), Transfer(n - 1, a, k, True)]
            elif m := re.fullmatch(r"(\w+)⇄(\w+):(\d+)/(\d+)", tok):
                rnd += [Transfer(rank(m[1]), rank(m[2]), int(m[3])), Transfer(rank(m[2]), rank(m[1]), int(m[4]))]
            elif m := re.fullmatch(r"(\w+)→(\w+):(\d+)", tok):
                rnd.append(Transfer(rank(m[1]), rank(m[2]), int(m[3])))
            else:
                raise AssertionError(tok)
        rounds.append(tuple(rnd))
    return Schedule(n, tuple(rounds), "spec")


@pytest.mark.parametrize("n", [2, 4, 8, 16, 32, 64, 128])
def test_power_of_two_schedules_are_optimal_and_valid(n):
    sched = synthesize(n)
    verify(sched)
    assert sched.num_rounds == n - 2 + n.bit_length() - 1 == lower_bound_rounds(n)
    assert sched.note == ""


# docs/stragglar.md §2: the paper's greedy maximum-weight matching measured 6→7, 10→12, 12→15, 24→27
PAPER_ROUNDS = {6: 7, 10: 12, 12: 15, 24: 27}


@pytest.mark.slow
@pytest.mark.parametrize("n", [6, 10, 12, 14, 24])
def test_other_even_n_get_a_valid_schedule_with_a_note(n):
    sched = synthesize(n)
    verify(sched)
    assert sched.num_rounds >= lower_bound_rounds(n)
    assert "not a power of two" in sched.note and str(sched.num_rounds) in sched.note


@pytest.mark.slow
@pytest.mark.timeout(1800)  # ~1 min of CPU; minutes of wall time on the shared 2-core box
def test_every_even_n_up_to_64_matches_or_beats_the_paper():
    """The paper's counts where the spec lists them; elsewhere its formula n−2+⌈log₂n⌉ ("close
    to"), which we meet or miss by at most 2 rounds (measured 2026-12-01: equal at 6, 10, 12,
    18, 20, 24 and the powers of two, +2 at 50, 58, 62, +1 elsewhere)."""
    rounds = {}
    for n in range(4, 65, 2):
        sched = synthesize(n)
        verify(sched)
        rounds[n] = sched.num_rounds
        assert rounds[n] <= PAPER_ROUNDS.get(n, lower_bound_rounds(n) + 2), (n, rounds[n])
    assert all(rounds[n] == lower_bound_rounds(n) for n in (4, 8, 16, 32, 64))
    assert rounds[10] == 12 and rounds[24] == 27 and rounds[12] <= 14  # 12: one better


def test_plans_are_kept_per_schedule_not_per_id():
    # the old cache was keyed by id(schedule): after an eviction a new schedule could get an
    # old id and the plan of another n (a 46-round schedule got the 4-round plan)
    seen = {}
    for _ in range(3):
        for n in (4, 5, 6, 8):
            synthesize.cache_clear()
            sched = synthesize(n)
            for rank in range(n):
                plan = sched.rank_plan(rank)
                assert len(plan) == sched.num_rounds
                assert all(t.src == rank for sends, _ in plan for t in sends)
                assert all(t.dst == rank for _, recvs in plan for t in recvs)
            seen.setdefault(n, sched.rounds)
            assert sched.rounds == seen[n]  # deterministic: every rank builds the same one
    with pytest.raises(InputError, match="rank"):
        synthesize(4).rank_plan(4)


@pytest.mark.parametrize("n", [3, 5, 7, 9])
def test_odd_n_is_answered_not_crashed(n):
    sched = synthesize(n)
    verify(sched)
    assert "odd n" in sched.note


def test_spec_example_schedules_pass_the_verifier_and_describe_round_trips():
    verify(parse(SPEC_N8, 8))
    verify(parse(SPEC_N4, 4))
    ours = synthesize(8)
    again = parse(ours.describe(), 8)
    assert [set(r) for r in again.rounds] == [set(r) for r in ours.rounds]


@pytest.mark.parametrize("corrupt,message", [
    (lambda r: r[:-1], "still lacks"),                                       # drop the last round
    (lambda r: r[:3] + ((r[3][0], r[3][1], Transfer(0, 1, 6)),) + r[4:], "does not hold"),
    (lambda r: r[:1] + (r[1] + (Transfer(0, 4, 0),),) + r[2:], "sends twice"),
    (lambda r: r[:1] + (r[1] + (Transfer(2, 4, 0),),) + r[2:], "does not hold"),
    (lambda r: ((Transfer(0, 7, 0, True),),) + r[1:], "without its reverse"),
])
def test_verifier_rejects_broken_schedules(corrupt, message):
    good = parse(SPEC_N8, 8)
    bad = Schedule(8, corrupt(good.rounds), "corrupted")
    with pytest.raises(StragglersError, match=message):
        verify(bad)


def test_schedules_are_cached_and_n256_is_fast():
    synthesize.cache_clear()
    # CPU time, not wall time: other processes on the shared box stretch the wall clock
    t0 = time.process_time()
    sched = synthesize(256)
    cpu = time.process_time() - t0
    assert sched.num_rounds == 262
    assert synthesize(256) is sched
    assert cpu < 3.0  # the goal is <= 1 s of one core (benchmarks measure it)


def test_bad_n_is_a_user_error():
    with pytest.raises(InputError, match="n"):
        synthesize(1)
