"""CPU contention in some steps, on hosts whose transfers wait for a CPU in every step, in a job
whose S its own jitter gives, is that jitter: clean ranks sharing one CPU beside other work.

The jobs here share their load across workers step by step (ranks on one CPU slow down
together), and every pipeline transfer is 10 ms late in steps 3 and 7 with its threads waiting
that long for a CPU. Where the transfers wait for a CPU in no other step, that is a busy host
in those steps (a hog that came and went): `cpu_contention` there. Where they wait in every
step (the ranks outnumber their cores), which steps the standing contention made late is the
other load's lottery, and S (1.08) is below the floor (1.17): `none`.
"""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import OPTYPE_CODES as C, P2P_OPTYPES, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze

P2P = [C[o] for o in P2P_OPTYPES]


def _shared_load(trace: Trace, sigma: float, seed: int) -> Trace:
    """Every op of a step × one lognormal factor (sigma), the same on every worker."""
    ops = {k: v.copy() for k, v in trace.ops.items()}
    steps = np.unique(ops["step"])
    factor = dict(zip(steps.tolist(), np.exp(np.random.default_rng(seed).normal(0, sigma,
                                                                                len(steps)))))
    ops["duration"] = ops["duration"] * np.array([factor[int(s)] for s in ops["step"]])
    return Trace(ops, trace.meta)


def _late_transfers(trace: Trace, steps: list[int], seconds: float, standing: float) -> Trace:
    """Every p2p transfer `seconds` late in `steps`, its threads waiting that long for a CPU
    there, and `standing` s in every step."""
    ops = {k: v.copy() for k, v in trace.ops.items()}
    p2p = np.isin(ops["optype"], P2P)
    hit = p2p & np.isin(ops["step"], steps)
    ops["duration"] = ops["duration"] + np.where(hit, seconds, 0.0)
    ops["cpu_wait"] = np.where(p2p, standing + np.where(hit, seconds, 0.0), np.nan)
    return Trace(ops, trace.meta)


def _job() -> Trace:
    return _shared_load(generate(dp=4, pp=2, microbatches=8, steps=10, seed=3), 0.2, 0)


def test_contention_that_came_and_went_is_found_in_its_steps():
    result = analyze(_late_transfers(_job(), [3, 7], 0.01, standing=0.0))
    found = next((f for f in result.diagnosis if f.cause == "cpu_contention"), None)
    assert found is not None and found.where.steps == [3, 7], result.diagnosis


def test_some_steps_of_a_standing_contention_within_the_jitter_are_none():
    result = analyze(_late_transfers(_job(), [3, 7], 0.01, standing=0.02))
    assert [f.cause for f in result.diagnosis] == ["none"], result.diagnosis
    assert result.diagnosis_summary.noise_floor > result.slowdown
