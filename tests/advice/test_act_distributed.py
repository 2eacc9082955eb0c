"""The act loop in a real torchrun job (gloo, CPU): it rolls back a harmful remedy, and an exact
remedy switched on by the loop (StragglAR) leaves the parameters those of the plain run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, torchrun

EXAMPLE = REPO / "examples" / "train_advised.py"


@pytest.mark.distributed
def test_act_loop_rolls_back_a_forced_harmful_remedy(tmp_path: Path):
    # A collection on every step over a 150 MB live heap costs far more than the ~0.1 s step:
    # the loop must measure that and switch it off again.
    summary = tmp_path / "summary.json"
    torchrun(EXAMPLE, 2, "--force", "planned-gc:1", "--gc-heap-mb", "150", "--steps", "16",
             "--window", "5", "--settle", "1", "--summary", str(summary), timeout=400)
    decisions = json.loads(summary.read_text())["decisions"]
    assert [(d["kind"], d["remedy"]) for d in decisions[:2]] == \
        [("apply", "planned-gc"), ("rollback", "planned-gc")], decisions
    assert decisions[0]["params"] == {"every": 1}
    assert decisions[1]["measured_speedup"] < 0.7


@pytest.mark.distributed
def test_stragglar_switched_on_by_the_loop_changes_no_parameters(tmp_path: Path):
    common = ["--slow-rank", "3", "--slow-factor", "3", "--steps", "16", "--window", "4",
              "--settle", "1", "--width", "128"]
    plain, switched = tmp_path / "plain.npy", tmp_path / "switched.npy"
    summary = tmp_path / "summary.json"
    torchrun(EXAMPLE, 4, *common, "--no-act", "--params-out", str(plain), timeout=400)
    torchrun(EXAMPLE, 4, *common, "--force", "stragglar", "--params-out", str(switched),
             "--summary", str(summary), timeout=400)
    out = json.loads(summary.read_text())
    assert out["decisions"][0]["kind"] == "apply" and out["decisions"][0]["remedy"] == "stragglar"
    assert out["stragglar_calls"] > 0, "the hook never ran StragglAR"
    a, b = np.load(plain), np.load(switched)
    assert a.shape == b.shape
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
