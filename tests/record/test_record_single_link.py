"""Lateness on every carrier of a transfer family, a different transfer each step, is no link.

A recorded two-stage pipeline on CPU has one link: a receive woken a scheduler tick late
looks like a link that held the bytes, and with no healthy link to compare with it was
diagnosed `communication` (whatif/README.md, "A single link has no healthy link to compare
with"). A slow link is a place (its transfers late while others' are not) or a time (its
steps); lateness on every carrier in most steps is neither, and is left to the noise floor.
The traces are synthetic with the lateness written in, so the verdicts do not depend on the
machine's timing.
"""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import OPTYPE_CODES, P2P_OPTYPES, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze

P2P = [OPTYPE_CODES[o] for o in P2P_OPTYPES]


def late(trace: Trace, dp: int, seconds: float, per_step: int, steps=None) -> Trace:
    """`trace` with `per_step` of DP rank dp's transfers in each step (random ones; all of
    them with per_step=0) `seconds` longer."""
    ops = {k: v.copy() for k, v in trace.ops.items()}
    p2p = np.isin(ops["optype"], P2P) & (ops["dp_rank"] == dp)
    rng = np.random.default_rng(0)
    for s in (np.unique(ops["step"]) if steps is None else steps):
        rows = np.flatnonzero(p2p & (ops["step"] == s))
        ops["duration"][rng.choice(rows, per_step, replace=False) if per_step else rows] += seconds
    return Trace(ops, trace.meta)


def causes(trace: Trace) -> list[str]:
    return [d.cause for d in analyze(trace).diagnosis]


def test_sporadic_lateness_on_the_only_link_is_no_slow_link():
    one_link = generate(dp=1, pp=2, microbatches=8, steps=10, seed=3)
    for per_step in (2, 4):
        found = causes(late(one_link, 0, 0.05, per_step))
        assert not {"communication", "cpu_contention"} & set(found), (per_step, found)


def test_a_link_late_in_some_steps_is_still_found_there():
    one_link = generate(dp=1, pp=2, microbatches=8, steps=10, seed=3)
    result = analyze(late(one_link, 0, 0.05, 0, steps=[3, 7]))
    comm = next(d for d in result.diagnosis if d.cause == "communication")
    assert comm.where.steps == [3, 7]


def test_sporadic_lateness_on_one_of_two_links_is_that_link():
    two_links = generate(dp=2, pp=2, microbatches=8, steps=10, seed=3)
    result = analyze(late(two_links, 1, 0.05, 2))
    comm = next(d for d in result.diagnosis if d.cause == "communication")
    assert comm.where.dp == [1] and not comm.where.steps
