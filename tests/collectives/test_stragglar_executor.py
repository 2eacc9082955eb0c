"""StragglAR AllReduce equals dist.all_reduce on real gloo processes (2/4/6/8 ranks)."""

from pathlib import Path

import pytest
from conftest import torchrun

WORKER = Path(__file__).parent / "workers" / "stragglar_correctness_worker.py"


@pytest.mark.distributed
@pytest.mark.parametrize("nproc,paths", [
    (2, "ring/dataflow,library/lockstep"),
    (4, "ring/dataflow,library/dataflow,ring/lockstep"),
    (6, "auto/dataflow"),
    (8, "auto/dataflow,auto/lockstep"),
])
def test_stragglar_matches_all_reduce(nproc, paths):
    proc = torchrun(WORKER, nproc, paths, timeout=240)
    assert proc.stdout.count("cases ok") == nproc
