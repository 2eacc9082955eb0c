"""End to end: real torchrun DDP ranks on gloo, profiled by torch.profiler, read and analysed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import torchrun

from stragglers.trace.kineto import looks_like_kineto, read_kineto
from stragglers.whatif import analyze

WORKER = Path(__file__).parent / "workers" / "kineto_profile_ddp.py"
SLOW_RANK, FACTOR = 1, 60


@pytest.fixture(scope="module")
def profiled_run(tmp_path_factory) -> Path:
    """Two DDP ranks; rank 1 does FACTOR× the forward work (a compute straggler)."""
    out = tmp_path_factory.mktemp("kineto-ddp")
    pytest.importorskip("torch")
    torchrun(WORKER, 2, str(out), str(SLOW_RANK), str(FACTOR), timeout=240)
    return out


@pytest.mark.distributed
def test_profiled_ddp_ranks_read_as_one_job(profiled_run):
    assert looks_like_kineto(profiled_run)
    trace = read_kineto(profiled_run)
    names = trace.optype_names()
    assert sorted(set(trace.ops["rank"])) == [0, 1] and trace.meta.world_size == 2
    assert sorted(set(trace.ops["step"])) == [2, 3, 4]   # the schedule's active steps
    for rank in (0, 1):
        mine = names[trace.ops["rank"] == rank]
        for optype in ("forward-compute", "backward-compute", "grads-all-reduce", "optimizer"):
            assert optype in mine, (rank, optype)
        # One gloo all-reduce bucket per step (the model is small).
        assert (mine == "grads-all-reduce").sum() == 3
    # Both traces name the same host, so they share one clock and are not shifted (gloo's
    # all-reduce ends jitter by milliseconds on a busy CPU: aligning on them would add error).
    assert trace.meta.extra["clock_offsets_s"]["1"] == 0.0
    assert trace.meta.extra["clock_alignment"]["1"]["same_host_as"] == 0
    # The straggler's forward is visibly longer.
    fwd = names == "forward-compute"
    slow = np.median(trace.ops["duration"][fwd & (trace.ops["rank"] == SLOW_RANK)])
    fast = np.median(trace.ops["duration"][fwd & (trace.ops["rank"] != SLOW_RANK)])
    assert slow > 3 * fast


@pytest.mark.distributed
def test_what_if_blames_the_slow_rank(profiled_run):
    result = analyze(read_kineto(profiled_run))
    assert result.slowdown > 1.1
    scores = {w.dp: w.score for w in result.worker_scores}
    assert max(scores, key=scores.get) == SLOW_RANK
    assert np.isfinite(result.sim_error)
