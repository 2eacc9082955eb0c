"""The StragglAR DDP hook trains like plain DDP while the straggler moves (real gloo, torchrun)."""

from pathlib import Path

import pytest
from conftest import torchrun

WORKER = Path(__file__).parent / "workers" / "stragglar_ddp_worker.py"


@pytest.mark.distributed
def test_ddp_hook_matches_plain_ddp_with_moving_straggler():
    proc = torchrun(WORKER, 4, timeout=240)
    assert proc.stdout.count("ddp ok") == 4
    assert "persistent=" in proc.stdout
