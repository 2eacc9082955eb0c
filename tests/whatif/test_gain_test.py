"""One answer to "is this gain real", shared by the diagnosis and advise (whatif/confidence.py)."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest

from stragglers.advice.plan import MIN_GAIN
from stragglers.advice.remedies.base import RemedyBase, speedup_interval
from stragglers.errors import InputError
from stragglers.whatif.config import DiagnosisConfig
from stragglers.whatif.confidence import GAIN, GainTest, gain_is_real, ratio_interval

TEST_FIELDS = [f.name for f in dataclasses.fields(GainTest)]


def test_the_diagnosis_and_advise_read_one_gain_test():
    # DiagnosisConfig declares the gain test's fields from GainTest: same defaults, same help
    # (its --set documentation), same bounds; advise's line is the same value
    diagnosis = DiagnosisConfig()
    assert GainTest(**{name: getattr(diagnosis, name) for name in TEST_FIELDS}) == GAIN
    described = {name: (default, text) for name, default, text in DiagnosisConfig.describe()}
    assert [(name, *described[name]) for name in TEST_FIELDS] == GainTest.describe()
    assert MIN_GAIN == GAIN.min_gain == diagnosis.min_gain == 1.03
    with pytest.raises(InputError, match="min_gain"):
        DiagnosisConfig(min_gain=0.5)
    with pytest.raises(InputError):
        GainTest(min_gain=0.5)


def test_a_remedy_below_the_line_a_finding_must_reach_is_not_offered():
    # ×1.025 with no interval (one step): a cause the diagnosis would not name, so a remedy
    # that buys it is not worth switching on either
    ctx = types.SimpleNamespace(baseline_step_s=1.0)
    below = RemedyBase().priced(ctx, 1 / 1.025, "replay", "", "")
    assert not below.applies and f"below the ×{GAIN.min_gain} worth" in below.why_not
    assert RemedyBase().priced(ctx, 1 / 1.04, "replay", "", "").applies


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
    lo, hi = ratio_interval(base, remedy, DiagnosisConfig())
    assert speedup_interval(base, remedy) == [lo, hi]
    # the seeded percentile bootstrap, written out: 200 resamples of the 12 steps, 5% and 95%
    idx = np.random.default_rng(0).integers(0, 12, (200, 12))
    ref = np.percentile(base[idx].mean(axis=1) / remedy[idx].mean(axis=1), [5, 95])
    assert [lo, hi] == [float(x) for x in ref]
    # steps that cannot be used are left out; fewer than four left: no interval
    assert speedup_interval(np.r_[base, np.nan], np.r_[remedy, 1.0]) == [lo, hi]
    assert speedup_interval(base[:3], remedy[:3]) is None
