"""Pipelines with tensor, context and expert parallelism inside each stage (synthetic Kineto
jobs, GPipe): a microbatch's compute cut into pieces by its group's blocking collectives still
pairs each send/recv with its own microbatch, and the wait at those collectives stays theirs.

The first four cases failed before: a recv posted after a microbatch's TP all-reduce (a
send after its CP all-gather) was chained to the compute before the collective, so the wait
for a slow or late group peer showed as the rank's launch delay (a healthy TP/CP peer named
`host_stall`); and with the compute cut at all-to-alls the transfers were paired with the
first pieces in order, so a slow expert group's own ranks were named `host_stall` beside
`communication`. The slow rank of three failed too (see its comment).
"""

from __future__ import annotations

import pytest

from stragglers.trace.load import load_trace
from stragglers.trace.synth.kineto import GpuJob, write_gpu_job
from stragglers.whatif import analyze

CASES = {
    "slow TP rank": dict(ranks=16, tp_size=2, all_to_alls=0, slow_rank=(9, 1.6)),
    "late TP rank": dict(ranks=16, tp_size=2, all_to_alls=0, late_rank=(3, 3000.0)),
    "slow CP rank": dict(ranks=16, cp_size=2, all_to_alls=0, slow_rank=(2, 1.6)),
    "slow EP link": dict(ranks=16, all_to_alls=2, expert_groups=4, slow_link=(9, 8.0)),
    "hot expert beside TP": dict(ranks=16, tp_size=2, all_to_alls=1, expert_groups=2,
                                 hot_expert=(4, 3.0)),
    # three workers a stage: the median of a worker's two peers is their mean, lifted by a
    # slow one (its peers looked fast, and it was no outlier among the six)
    "slow rank of three": dict(ranks=6, all_to_alls=0, slow_rank=(3, 2.1)),
    # the last microbatch's backward cut in two by DDP's buckets: one compute op more than
    # recvs, which the count rule took for an unrecorded first recv (recvs one op late, the
    # first backward unlinked, its wait a launch delay on every rank: the stall unnamed)
    "late host, two buckets": dict(ranks=4, all_to_alls=2, buckets=2, late_rank=(2, 3600.0)),
}


def _named(result) -> set[tuple[str, int]]:
    return {(f.cause, int(w.rank)) for f in result.diagnosis for w in (f.where.workers or [])} \
        or {(f.cause, -1) for f in result.diagnosis}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_injected_rank_is_named_alone_in_a_pipelined_job(tmp_path, case):
    # one clock: no collective spans the stages for the reader to align clocks on
    job = GpuJob(pp_size=2, microbatches=4, steps=5, seed=3, ranks_per_host=CASES[case]["ranks"],
                 **CASES[case])
    truth = write_gpu_job(job, tmp_path)
    trace = load_trace(tmp_path)
    assert trace.meta.pp_size == 2
    assert _named(analyze(trace)) == {(c["cause"], r) for c in truth["causes"]
                                      for r in c["ranks"]}


def test_a_clean_three_dimensional_job_says_none(tmp_path):
    write_gpu_job(GpuJob(ranks=16, pp_size=2, tp_size=2, microbatches=4, steps=5, seed=2,
                         all_to_alls=1, ranks_per_host=16), tmp_path)
    assert _named(analyze(load_trace(tmp_path))) == {("none", -1)}
