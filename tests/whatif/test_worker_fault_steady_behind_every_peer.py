"""worker_fault's steady route (2-4 workers: no outlier test) asks a worker to be behind EVERY
peer of its stage in every step, over enough steps that some worker of n doing so by chance is
1 in 32 or less (n^-(T-1): six steps beside one peer, five beside two or three).

The worker is chosen from the data: "behind its peers' median in every step of five" held by
chance for some worker of n up to n/32 a stage, and at noise σ 0.2-0.3 the ×1.06 margin of that
route is met (19 of 6,000 noise-only jobs of 2-4 workers a stage named a worker fault, e.g. dp 2
× pp 2 noise 0.3 seed 11: rank 2 ×1.21, not below threshold). The faults stay: two of four
workers slowed unlike (a worker found is no peer of the rest), one of two over six steps, one of
three or four over five.
"""

from __future__ import annotations

import pytest

from stragglers.trace.synth import generate
from stragglers.whatif import analyze

from test_worker_fault_few_workers import _found, _scaled


@pytest.mark.parametrize("dp, pp, steps, noise, seed", [
    (2, 2, 5, 0.3, 11), (2, 1, 5, 0.3, 54), (4, 1, 8, 0.2, 32), (4, 1, 5, 0.3, 93)],
    ids=["dp2-pp2-5steps-seed11", "dp2-5steps-seed54", "dp4-8steps-seed32", "dp4-5steps-seed93"])
def test_a_noise_only_job_of_few_workers_names_no_worker_fault(dp, pp, steps, noise, seed):
    result = analyze(generate(dp=dp, pp=pp, microbatches=4, vpp=1, steps=steps, seed=seed,
                              noise=noise, sync="ddp" if pp == 1 else "zero"))
    assert [d.cause for d in result.diagnosis if d.cause not in ("none", "unexplained")] == []


@pytest.mark.parametrize("dp, pp, steps, slow", [
    (4, 1, 6, {1: 1.3, 2: 1.6}), (4, 1, 5, {2: 1.1}), (3, 1, 5, {0: 1.12}), (2, 1, 6, {1: 1.13}),
    (2, 2, 6, {3: 1.13})], ids=["two-unlike-of-four", "one-of-four", "one-of-three",
                                "one-of-two-6-steps", "dp2-pp2-6-steps"])
def test_a_steady_fault_among_few_workers_is_still_named(dp, pp, steps, slow):
    trace = generate(dp=dp, pp=pp, microbatches=4, steps=steps, seed=2, noise=0.03,
                     sync="ddp" if pp == 1 else "zero")
    for rank, factor in slow.items():
        trace = _scaled(trace, rank, [factor] * steps)
    assert [(c, sorted(r)) for c, r in _found(trace)] == [("worker_fault", sorted(slow))]
