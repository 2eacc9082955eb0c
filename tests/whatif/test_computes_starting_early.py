"""A compute op written to start before its input could be there (a recorder stamping its
launch, queued behind its stream's work: timing._clip_starts) starts where the dependencies
say, its end kept, so the measured replay stays exact and an honest rank is not named: a
receive or collective it waits for ended later; it began before the op ahead of it on its
stream began; that op's send began at that op's stated end; or the stage's rows that overlap
nothing read the pair's durations so. Where nothing tells, a warning says so."""

from __future__ import annotations

import pytest
from possible_traces import rank0_straggler, started_early

from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.timing import ROWS_CUT, UNDECIDED

EARLY = "compute ops starting before their input was there"
STEPS = 8


def _healthy(dp: int):
    return generate(dp=dp, pp=2, microbatches=4, steps=STEPS, seed=0)


def _moved(result) -> bool:
    return any(w.startswith(ROWS_CUT) and EARLY in w for w in result.warnings)


# dp 2 x pp 2 (S 1.007): rank 1 (dp 1, pp 0), each backward begun inside its receive and the
# forward before it (0.02 s) or before that forward began (0.05 s); rank 3 (dp 1, pp 1), the
# last stage's backward begun inside its own forward (0.02 s: only the peer's rows tell) or
# before it (0.05 s). Read with the early starts kept: S `before`, sim_error 11-60%, and a
# host stall (with a worker fault but at rank 3, 0.02 s) named at the honest rank.
@pytest.mark.parametrize("rank, by, before", [(1, 0.02, 1.029), (1, 0.05, 1.176),
                                              (3, 0.05, 1.049), (3, 0.02, 1.084)])
def test_a_backward_written_early_reads_as_the_healthy_job(rank, by, before):
    clean = analyze(_healthy(2)).slowdown
    result = analyze(started_early(_healthy(2), rank, "backward-compute", by))
    assert abs(result.slowdown - clean) < 1e-3, (before, clean, result.slowdown)
    assert result.sim_error < 1e-9, result.sim_error
    assert [f.cause for f in result.diagnosis] == ["none"], result.diagnosis
    assert _moved(result), result.warnings


@pytest.mark.parametrize("rank", range(6))
def test_backwards_written_early_at_any_rank_of_three_replicas(rank):
    """dp 3 x pp 2, one rank's backwards 0.05 s early: every rank reads the healthy job."""
    clean = analyze(_healthy(3)).slowdown
    result = analyze(started_early(_healthy(3), rank, "backward-compute", 0.05))
    assert abs(result.slowdown - clean) < 1e-3, (clean, result.slowdown)
    assert result.sim_error < 1e-9, result.sim_error
    assert [f.cause for f in result.diagnosis] == ["none"], result.diagnosis


@pytest.mark.parametrize("rank", [1, 2, 3, 4, 5])
def test_an_honest_rank_written_early_beside_a_straggler(rank):
    """Rank 0 computes x3 (S 1.789); an honest rank's backwards 0.05 s early read S 1.706-1.824
    and named it a host stall (ranks 1-3): now the straggler's S and its worker fault alone."""
    trace, clean = rank0_straggler(3, STEPS)
    result = analyze(started_early(trace, rank, "backward-compute", 0.05))
    assert abs(result.slowdown / clean - 1) < 1e-3, (clean, result.slowdown)
    assert [(f.cause, f.where.ranks) for f in result.diagnosis] == [("worker_fault", [0])], \
        result.diagnosis


def test_where_nothing_tells_which_row_is_wrong_a_warning_says_so():
    """Both last-stage workers' backwards 0.02 s early, each inside its own forward, which
    feeds only that backward: no receive, no send and no peer's row overlapping nothing tells
    the early start from a late end. The rows stay as they are (the forward cut) and the
    warning names both workers."""
    trace = started_early(started_early(_healthy(2), 2, "backward-compute", 0.02), 3,
                          "backward-compute", 0.02)
    result = analyze(trace)
    said = [w for w in result.warnings if w.startswith(UNDECIDED)]
    assert len(said) == 1 and said[0].endswith("workers (dp 0, pp 1), (dp 1, pp 1))"), \
        result.warnings
