"""The comm-hook completion thread: DDP-exact averages, no Python on gloo's threads, joined on stop."""

from pathlib import Path

import pytest
from conftest import torchrun

WORKER = Path(__file__).parent / "workers" / "completion_ddp_worker.py"


@pytest.mark.distributed
def test_completion_hook_trains_like_ddp_and_runs_only_on_its_thread():
    proc = torchrun(WORKER, 2, timeout=240)
    assert proc.stdout.count("completion ok") == 2

