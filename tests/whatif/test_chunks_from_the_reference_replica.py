"""A template op's model chunk (and global chunk) is read from its stage's reference replica-step,
where the model reads its order, not from whichever row of it came last: in an interleaved
schedule (vpp 2) a rank numbering two microbatches the other way round holds another chunk at
a template op, and read from the last DP replica's rows its chunk decided every replica's
transfers (dp 3 × pp 2 × vpp 2, rank 0 ×3: S 1.969 read 1.928, 1.904 or 1.995, sim_error up
to 3.9%)."""

from __future__ import annotations

import numpy as np
import pytest
from possible_traces import lying, slowed

from stragglers.trace.model import Trace
from stragglers.trace.runformat import write_run
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.grid import build_grid
from stragglers.whatif.partitioned import analyze_run

STEPS = 8


@pytest.fixture(scope="module")
def interleaved() -> tuple[Trace, float]:
    """dp 3 × pp 2 × vpp 2, rank 0 (dp 0, pp 0) computing 3× as long; its S."""
    trace = slowed(generate(dp=3, pp=2, vpp=2, microbatches=4, steps=STEPS, seed=0),
                   {0: [3.0] * STEPS})
    return trace, analyze(trace).slowdown


# ranks 2 (dp 2, pp 0) and 5 (dp 2, pp 1): the last DP replica, whose rows came last
@pytest.mark.parametrize("rank, optype", [
    (2, "forward-compute"), (2, "backward-compute"), (5, "forward-compute"),
    (5, "backward-compute")])
def test_a_replica_numbering_its_chunks_otherwise_does_not_define_them(interleaved, rank,
                                                                         optype):
    trace, clean = interleaved
    odd = lying(trace, rank, optype, "swap")
    whole, honest = build_grid(odd), build_grid(trace)
    assert np.array_equal(whole.node_mc, honest.node_mc)
    assert np.array_equal(whole.node_gmc, honest.node_gmc)
    result = analyze(odd)
    assert abs(result.slowdown / clean - 1) < 1e-3, (clean, result.slowdown)
    assert result.sim_error < 1e-9, result.sim_error
    assert [f.cause for f in result.diagnosis][:1] == ["worker_fault"], result.diagnosis
    assert result.diagnosis[0].where.ranks == [0]


def test_a_run_directory_read_by_partitions_reads_the_same_chunks(interleaved, tmp_path):
    trace = lying(interleaved[0], 2, "forward-compute", "swap")
    write_run(tmp_path / "run", trace)
    whole = analyze(trace)
    for partitions in (1, 3):
        r = analyze_run(tmp_path / "run", partitions=partitions)[0]
        assert r.slowdown == whole.slowdown
        assert [(f.cause, f.where.ranks) for f in r.diagnosis] == \
            [(f.cause, f.where.ranks) for f in whole.diagnosis]
