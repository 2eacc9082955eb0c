"""CPU contention in some steps, on hosts whose transfers wait for a CPU in every step, in a job
whose S its own jitter gives, is that jitter: clean ranks sharing one CPU beside other work.

The jobs here share their load across workers step by step (ranks on one CPU slow down
together), and every pipeline transfer is 20 ms late in steps 3 and 7 with its threads waiting
that long for a CPU (the job run again with those costs, its ops pushed back: S 1.07; 10 ms,
S 1.04, is within the step-to-step jitter of σ 0.2 that a shared load gives). Where the
transfers wait for a CPU in no other step, that is a busy host in those steps (a hog that came
and went): `cpu_contention` there. Where they wait in every step (the ranks outnumber their
cores), which steps the standing contention made late is the other load's lottery, and S
(1.07) is below the floor (1.16): `none`.
"""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import OPTYPE_CODES as C, P2P_OPTYPES, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze

from possible_traces import rerun

P2P = [C[o] for o in P2P_OPTYPES]


def _contended(steps: list[int], seconds: float, standing: float) -> Trace:
    """The job with every op of a step × one lognormal factor (σ 0.2), the same on every
    worker, and every p2p transfer `seconds` late in `steps`, its threads waiting that long
    for a CPU there, and `standing` s in every step: the job run again with those costs (its
    ops pushed back, peers waiting, as a loaded host runs it)."""
    trace = generate(dp=4, pp=2, microbatches=8, steps=10, seed=3)
    factor = np.exp(np.random.default_rng(0).normal(0, 0.2, 10))

    def edit(sched, costs, job) -> None:
        costs.duration *= np.repeat(factor, job.dp)[None, :]
        p2p = [n.id for n in sched.nodes if n.optype in P2P_OPTYPES]
        for step in steps:
            costs.duration[np.ix_(p2p, np.arange(step * job.dp, (step + 1) * job.dp))] += seconds

    out = rerun(trace, edit)
    ops = out.ops
    p2p = np.isin(ops["optype"], P2P)
    hit = p2p & np.isin(ops["step"], steps)
    ops["cpu_wait"] = np.where(p2p, standing + np.where(hit, seconds, 0.0), np.nan)
    return out


def test_contention_that_came_and_went_is_found_in_its_steps():
    result = analyze(_contended([3, 7], 0.02, standing=0.0))
    found = next((f for f in result.diagnosis if f.cause == "cpu_contention"), None)
    assert found is not None and found.where.steps == [3, 7], result.diagnosis


def test_some_steps_of_a_standing_contention_within_the_jitter_are_none():
    result = analyze(_contended([3, 7], 0.02, standing=0.02))
    assert [f.cause for f in result.diagnosis] == ["none"], result.diagnosis
    assert result.diagnosis_summary.noise_floor > result.slowdown
