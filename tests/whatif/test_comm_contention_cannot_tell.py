"""A slow link beside a shared CPU's compute is named; what the contention rule withholds is said.

The fixture is tests/whatif/test_comm_contention_beside_compute.py's clean dp 2 × pp 2 run on
one CPU (a profiler trace: no CPU waits recorded), where the last stage's all-reduce (ranks 1
and 3) runs beside the first stage's next forward. A slower link between ranks 1 and 3 is
modelled to first order as their all-reduce lengthened by a multiple of the family's median in
every step, their later ops shifted by as much (the review of 6d04e09, /tmp/h/hR_comm2.py).
The compute beside a transfer on one CPU grows with the transfer's own length; only the
compute begun while a transfer of the other carriers' length would still run can have made it
late. Before: +3× and +10× the median were silenced (no finding, no word of it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stragglers.trace.load import load_trace
from stragglers.trace.model import OPTYPE_CODES, Trace
from stragglers.whatif import analyze

RUN = Path(__file__).parents[1] / "data" / "recorded" / "pp2-clean-profiler-one-cpu-beside-hogs"
ALL_REDUCE = OPTYPE_CODES["grads-all-reduce"]


@pytest.fixture(scope="module")
def trace() -> Trace:
    return load_trace(RUN)


def _slower_link(trace: Trace, times_median: float) -> Trace:
    """`trace` with ranks 1 and 3's all-reduce longer by `times_median` × its median."""
    ops = {k: np.array(v, copy=True) for k, v in trace.ops.items()}
    mine = ops["optype"] == ALL_REDUCE
    extra = times_median * float(np.median(ops["duration"][mine]))
    start = ops["start_ts"].astype(np.float64)
    duration = ops["duration"].astype(np.float64)
    for rank in (1, 3):
        for i in sorted(np.flatnonzero((ops["rank"] == rank) & mine), key=lambda i: -start[i]):
            start[(ops["rank"] == rank) & (start > start[i])] += extra
            duration[i] += extra
    ops["start_ts"] = start.astype(trace.ops["start_ts"].dtype)
    ops["duration"] = duration.astype(trace.ops["duration"].dtype)
    return Trace(ops, trace.meta, trace.source)


def _named(result) -> list[tuple[str, list[int]]]:
    return [(f.cause, sorted(int(r) for r in f.where.ranks or [])) for f in result.diagnosis]


@pytest.mark.parametrize("times_median", [1.0, 3.0, 10.0])
def test_a_slower_link_beside_the_first_stages_compute_is_named(trace, times_median):
    result = analyze(_slower_link(trace, times_median))
    assert ("communication", [1, 3]) in _named(result), (_named(result), result.warnings)


def test_the_clean_run_names_nobody_and_says_what_it_cannot_tell(trace):
    result = analyze(trace)
    assert not [n for n in _named(result) if n[0] == "communication"], _named(result)
    said = [w for w in result.warnings if "cannot tell CPU contention from a slow link" in w]
    assert len(said) == 1, result.warnings
    assert "grads-all-reduce" in said[0] and "rank 1" in said[0] and "rank 3" in said[0], said
