"""A compute op written to start before its input could be there (timing._clip_starts): the
dependency structure decides which row is impossible where it can (a receive it waits for
ended later; it began before the op it follows on its stream began; that op's send began at
that op's stated end); where nothing tells, a warning says so."""

from __future__ import annotations

import numpy as np
import pytest

from stragglers.trace.model import OPTYPE_CODES, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.timing import ROWS_CUT, UNDECIDED

BWD = OPTYPE_CODES["backward-compute"]
EARLY = "compute ops starting before their input was there"


def _early(rank: int, by: float) -> Trace:
    """A healthy dp 2 × pp 2 job (S 1.007) with `rank`'s backwards written `by` s early, ends
    kept."""
    trace = generate(dp=2, pp=2, microbatches=4, steps=8, seed=0)
    ops = {k: v.copy() for k, v in trace.ops.items()}
    hit = (ops["rank"] == rank) & (ops["optype"] == BWD)
    ops["start_ts"] = np.where(hit, ops["start_ts"] - by, ops["start_ts"])
    ops["duration"] = np.where(hit, ops["duration"] + by, ops["duration"])
    return Trace(ops, trace.meta)


# rank 1: (dp 1, pp 0), each backward inside the forward before it, whose send began at its
# end (0.02 s) or before it began (0.05 s); rank 3: (dp 1, pp 1), the last stage's backward
# 0.05 s early began before its own microbatch's forward did
@pytest.mark.parametrize("rank, by, before", [(1, 0.02, 1.029), (1, 0.05, 1.176),
                                              (3, 0.05, 1.049)])
def test_a_backward_starting_before_its_input_keeps_no_early_start(rank, by, before):
    """Read with the early start kept (and the forward before it cut where it began), the
    healthy job read S `before`, a host stall and a worker fault; the start moved to where its
    input was there, it is the healthy job and the warning names the rows."""
    result = analyze(_early(rank, by))
    assert result.slowdown < 1.015, (before, result.slowdown)
    assert [f.cause for f in result.diagnosis] == ["none"], result.diagnosis
    cut = [w for w in result.warnings if w.startswith(ROWS_CUT)]
    assert cut and EARLY in cut[0], result.warnings


def test_where_no_dependency_tells_which_row_lies_a_warning_says_so():
    """The last stage's backward 0.02 s early starts inside its own forward: the forward's end
    or the backward's start is wrong, and nothing launched after the forward tells which (it
    feeds only that backward). The warning says so and names the worker."""
    result = analyze(_early(3, 0.02))
    said = [w for w in result.warnings if w.startswith(UNDECIDED)]
    assert len(said) == 1 and said[0].endswith("workers (dp 1, pp 1))"), result.warnings
    assert not result.straggling, result.slowdown
