"""Without findings, S is noise unless the lower end of its interval over steps (the gain
test's) clears the noise floor + `noise_margin`: S is a mean over the steps, and from five or
six steps of a noisy job it lies a few percent from the floor either way. Noise-only dp 2-4
jobs of 5-6 steps (σ 0.2) read S 1.104-1.111 over floors 1.066-1.086 and were `unexplained`
(8 of 202 of benchmarks/whatif_noise_only.py --few-seeds 40; 1 after, a worker ×1.09 by
chance in a job of six steps).
"""

from __future__ import annotations

import pytest

from stragglers.trace.synth import generate
from stragglers.whatif import analyze


@pytest.mark.parametrize("dp, pp, steps, seed", [(2, 2, 5, 18), (4, 1, 5, 13), (4, 1, 6, 6)],
                         ids=["dp2-pp2-5steps-seed18", "dp4-5steps-seed13", "dp4-6steps-seed6"])
def test_a_short_noise_only_job_is_none(dp, pp, steps, seed):
    result = analyze(generate(dp=dp, pp=pp, microbatches=4, vpp=1, steps=steps, seed=seed,
                              noise=0.2, sync="ddp" if pp == 1 else "zero"))
    assert [d.cause for d in result.diagnosis] == ["none"]
