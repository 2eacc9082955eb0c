"""The steady route to `slow_group` (fewer than five workers a stage) is asked of every member
against every fast worker, and of a group beside two fast workers or more: the split is chosen
from the data, so the slow side's median behind the fast one's in every step of five held by
chance far more often than the sign test's 1 in 32.

Noise-only synthetic jobs of five steps were named a slow group: dp 4 × pp 1 noise 0.3 seed 53
(`slow_group [0, 3]` ×1.126, not below threshold) and noise 0.2 seed 6 (`[1, 3]`), and dp 3 ×
pp 1 noise 0.3 seed 28 (`[0, 2]`, two workers behind one fast worker in every step).
The true positives stay: tests/whatif/test_slow_group_steady_few_workers.py.
"""

from __future__ import annotations

import pytest

from stragglers.trace.synth import generate
from stragglers.whatif import analyze


@pytest.mark.parametrize("dp, noise, seed", [(4, 0.3, 53), (4, 0.2, 6), (3, 0.3, 28)],
                         ids=["dp4-noise0.3-seed53", "dp4-noise0.2-seed6", "dp3-noise0.3-seed28"])
def test_a_noise_only_job_of_few_workers_names_no_slow_group(dp, noise, seed):
    result = analyze(generate(dp=dp, pp=1, microbatches=4, vpp=1, steps=5, seed=seed,
                              noise=noise, sync="ddp"))
    assert [d.cause for d in result.diagnosis] == ["none"]
