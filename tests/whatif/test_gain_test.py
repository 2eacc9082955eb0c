"""One answer to "is this gain real", shared by the diagnosis and advise (whatif/confidence.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from stragglers.advice.plan import MIN_GAIN
from stragglers.advice.remedies.base import speedup_interval
from stragglers.errors import InputError
from stragglers.whatif.config import DiagnosisConfig
from stragglers.whatif.confidence import ADVISE, GainTest, gain_is_real, ratio_interval


def test_the_diagnosis_config_carries_the_gain_tests_settings():
    diagnosis = DiagnosisConfig()
    for f in dataclasses.fields(GainTest):
        assert getattr(diagnosis, f.name) == getattr(GainTest(), f.name), f.name
    assert (ADVISE.min_gain, ADVISE.bootstrap_samples, ADVISE.confidence) == (1.02, 400, 0.9)
    assert MIN_GAIN == ADVISE.min_gain
    with pytest.raises(InputError):
        GainTest(min_gain=0.5)


@pytest.mark.parametrize("gain, low, established, real", [
    (1.04, 1.031, False, True),
    (1.04, 1.02, False, False),      # the interval reaches into the noise
    (1.04, None, False, True),       # one step: no interval, the point decides
    (1.02, None, False, False),
    (1.031, 1.05, False, True),      # an interval above its point: the lower of the two
    (1.02, 1.05, False, False),
    (1.04, 1.02, True, True),        # established apart from noise: above 1 is enough
    (1.02, 1.01, True, False),       # not worth fixing
    (1.04, 0.99, True, False),       # not surely a gain
])
def test_the_gate(gain, low, established, real):
    assert gain_is_real(gain, low, DiagnosisConfig(), established) is real


def test_advise_interval_is_the_diagnosis_bootstrap_at_its_settings():
    rng = np.random.default_rng(3)
    base = 1.0 + 0.1 * rng.random(12)
    remedy = base / (1.05 + 0.02 * rng.standard_normal(12))
    lo, hi = ratio_interval(base, remedy, ADVISE)
    assert speedup_interval(base, remedy) == [lo, hi]
    # the same numbers as advise's own bootstrap before it was shared (400 seeded resamples)
    idx = np.random.default_rng(0).integers(0, 12, (400, 12))
    old = np.percentile(base[idx].mean(axis=1) / remedy[idx].mean(axis=1), [5, 95])
    assert [lo, hi] == [float(x) for x in old]
    # steps that cannot be used are left out; fewer than four left: no interval
    assert speedup_interval(np.r_[base, np.nan], np.r_[remedy, 1.0]) == [lo, hi]
    assert speedup_interval(base[:3], remedy[:3]) is None
