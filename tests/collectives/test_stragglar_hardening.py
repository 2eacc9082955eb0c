"""Issue 13 items 7–9 on real gloo processes: the hook next to a model's own collectives in
backward, the arrival clock of later buckets, and bad inputs that error instead of hanging."""

from pathlib import Path

import pytest
from conftest import torchrun

WORKERS = Path(__file__).parent / "workers"


@pytest.mark.distributed
def test_hook_survives_a_model_with_its_own_collective_in_backward():
    proc = torchrun(WORKERS / "stragglar_backward_collective_worker.py", 3, timeout=400)
    assert proc.stdout.count("backward-collective ok") == 3, proc.stdout


@pytest.mark.distributed
def test_bad_inputs_raise_on_every_rank_and_groups_stay_in_step():
    proc = torchrun(WORKERS / "stragglar_bad_input_worker.py", 4, timeout=400)
    assert proc.stdout.count("bad input ok") == 4, proc.stdout
    assert "every rank must pass the same value" in proc.stdout
