"""A worker whose op set per step differs from its stage peers' (a collective lost by its
profiler or another recorder version, one extra all-reduce/barrier/broadcast no peer ran, its
pipeline transfers numbered from 1) made every step incomplete: the analysis was an error, naming
the honest peer where the odd worker had the extra op. The engine now judges each worker against
its stage's majority and, where no step is complete, rebuilds or leaves out the collectives
that differ (every worker analysed: round 12, a replica left out hid the straggler in it) or,
where that cannot settle it, leaves the odd workers' DP replicas out, named in
`result.left_out` (whatif/README.md "Steps with ops missing, and workers whose ops differ")."""

from __future__ import annotations

import numpy as np
import pytest

from stragglers.trace.model import OPTYPE_CODES, P2P_OPTYPES, Trace
from stragglers.trace.runformat import write_run
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.grid import OPS_LEFT_OUT
from stragglers.whatif.partitioned import analyze_run
from stragglers.whatif.result import AnalysisResult


def job(dp: int, pp: int = 2, steps: int = 5) -> Trace:
    """A synthetic dp × pp job whose rank 0 is a real straggler (3× slower)."""
    return generate(dp=dp, pp=pp, microbatches=4, steps=steps, seed=0, slow_worker=(0, 0, 3.0))


def with_extra(trace: Trace, rank: int, optype: str, steps=None, seq: int = 0) -> Trace:
    """`rank` runs one `optype` (`seq`, 0.1 ms, after its last op) a step that no peer ran (in
    `steps`: those only)."""
    o = trace.ops
    rows = np.flatnonzero(o["rank"] == rank)
    rows = rows[np.lexsort((o["start_ts"][rows], o["step"][rows]))]
    last = rows[np.r_[o["step"][rows][1:] != o["step"][rows][:-1], True]]   # each step's last
    if steps is not None:
        last = last[np.isin(o["step"][last], steps)]
    add = {k: v[last].copy() for k, v in o.items()}
    add["optype"][:] = OPTYPE_CODES[optype]
    add["seq_id"][:] = seq
    add["mb_id"][:] = -1
    add["gmc"][:] = -1
    add["start_ts"] = add["start_ts"] + add["duration"]
    add["duration"][:] = 1e-4
    return Trace({k: np.concatenate([o[k], add[k]]) for k in o}, trace.meta, trace.source)


def without(trace: Trace, rank: int, optype: str) -> Trace:
    """`rank`'s rows of `optype` lost."""
    o = trace.ops
    return trace.select(~((o["rank"] == rank) & (o["optype"] == OPTYPE_CODES[optype])))


def one_based(trace: Trace, rank: int) -> Trace:
    """`rank` numbers its pipeline transfers' seq_ids from 1 (another recorder's convention)."""
    o = {k: v.copy() for k, v in trace.ops.items()}
    p2p = np.isin(o["optype"], [OPTYPE_CODES[x] for x in P2P_OPTYPES])
    o["seq_id"][(o["rank"] == rank) & p2p] += 1
    return Trace(o, trace.meta, trace.source)


def odd(result) -> list[tuple]:
    """(dp, pp, rank, missing, extra) of each worker left out for its own ops."""
    return [(w.dp, w.pp, w.rank, w.missing, w.extra) for w in result.left_out
            if w.reason == "ops_differ"]


def test_a_worker_lacking_a_collective_is_left_out_with_its_replica_and_the_rest_analysed():
    # dp 3: rank 5 (dp 2, pp 1) lost most of its stage's collectives in every step (a
    # recorder of another schedule); before, every step was incomplete and analyze raised.
    # Now its replica (ranks 2, 5) is left out, named, and the rest analysed exactly as a
    # trace without that replica (partial). (One lost collective is rebuilt instead: below.)
    trace = job(3)
    lost = ["params-all-gather", "grads-reduce-scatter", "layernorm-grads-all-reduce"]
    odd_trace = trace
    for optype in lost:
        odd_trace = without(odd_trace, 5, optype)
    r = analyze(odd_trace, steps="all")
    assert odd(r) == [(2, 1, 5, ["params-all-gather #0", "grads-reduce-scatter #0",
                                 "layernorm-grads-all-reduce #0"], [])], odd(r)
    assert [(w.dp, w.pp, w.rank, w.reason) for w in r.left_out] == [
        (2, 0, 2, "replica"), (2, 1, 5, "ops_differ")]
    assert r.left_out[1].steps == [0, 1, 2, 3, 4]
    assert r.partial and r.straggling is None and r.job.missing_workers == [(2, 0), (2, 1)]
    assert "left out with their DP replicas" in r.warnings[0], r.warnings
    alone = analyze(trace.select(trace.ops["dp_rank"] != 2), steps="all")
    assert r.slowdown == alone.slowdown > 1.3
    assert [f.cause for f in r.diagnosis] == [f.cause for f in alone.diagnosis]
    assert r.diagnosis[0].evidence.startswith("among the 4 analysed ranks of 6 only: "), \
        r.diagnosis[0].evidence
    back = AnalysisResult.from_json(r.to_json())
    assert back.left_out == r.left_out


def test_one_lost_collective_is_rebuilt_at_its_worker_and_every_worker_analysed():
    # dp 3: rank 5 lost only its grads-reduce-scatter: rebuilt there from its group's ends
    # (whatif/rebuild.py), nobody left out, the job read as the whole trace reads it
    trace = job(3)
    r = analyze(without(trace, 5, "grads-reduce-scatter"), steps="all")
    whole = analyze(trace, steps="all")
    assert r.left_out == [] and not r.partial
    assert r.warnings[0].startswith(OPS_LEFT_OUT) and "Rebuilt at the workers that lack them" \
        in r.warnings[0] and "grads-reduce-scatter #0 on stage 1 (run by DP rank(s) 0-1, " \
        "not by 2)" in r.warnings[0], r.warnings
    assert abs(r.slowdown - whole.slowdown) < 1e-3 and r.slowdown > 1.3
    assert [(f.cause, f.where.workers) for f in r.diagnosis] == \
        [(f.cause, f.where.workers) for f in whole.diagnosis]


@pytest.mark.parametrize("optype", ["all-reduce", "barrier", "broadcast"])
def test_an_extra_collective_is_left_out_not_the_honest_peer(optype):
    # 2 × 2 (red team round 11, finding 5): rank 3 (dp 1, pp 1) runs one op a step that no peer
    # ran. Before: an error naming the honest rank 2 (dp 0, pp 1) as missing ops; then rank
    # 3's replica left out. Now the extra op alone is left out, every worker analysed
    r = analyze(with_extra(job(2), 3, optype), steps="all")
    assert r.left_out == [] and not r.partial
    assert "Left out at every worker of their stage" in r.warnings[0] and f"never as " \
        f"compute): {optype} #0 on stage 1 (run by DP rank(s) 1, not by 0)" in r.warnings[0], \
        r.warnings
    assert r.slowdown > 1.15


def test_a_collective_lost_by_one_of_two_workers_is_rebuilt_even_with_one_stage():
    # 2 × 2 (finding 4): rank 3 lacks grads-reduce-scatter, which rank 2 and every worker of
    # stage 0 ran: rebuilt at rank 3, the straggler's replica 0 analysed with every worker
    r = analyze(without(job(2), 3, "grads-reduce-scatter"), steps="all")
    assert r.left_out == [] and r.slowdown > 1.15
    # a job of one stage has nothing to tell which of its two workers is odd (red team round
    # 12, finding 3: every window an error): the op fits as lost at rank 1, rebuilt there
    lone = without(generate(dp=2, pp=1, microbatches=4, steps=5, seed=0), 1,
                   "grads-reduce-scatter")
    r = analyze(lone, steps="all")
    assert r.left_out == [] and r.slowdown < 1.1 and "Rebuilt" in r.warnings[0], r.warnings


def test_transfers_numbered_from_one_are_left_out_where_a_majority_tells():
    # dp 3: rank 5 numbers its forward-recv / backward-send from 1: it lacks #0 and ran #4
    r = analyze(one_based(job(3), 5), steps="all")
    assert odd(r) == [(2, 1, 5, ["forward-recv #0", "backward-send #0"],
                       ["forward-recv #4", "backward-send #4"])]
    # a middle stage of a pp 4 job: #0 is what the neighbouring stages' majority ran
    r = analyze(one_based(job(2, pp=4), 5), steps="all")
    assert [w[:3] for w in odd(r)] == [(1, 2, 5)]
    # the last stage of two workers: no majority there, but each transfer's other end tells
    # (test_whatif_odd_op_pairs.py): rank 3's forward-recv #0 was sent, its #4 was not
    assert [w[:3] for w in odd(analyze(one_based(job(2), 3), steps="all"))] == [(1, 1, 3)]


def test_steps_left_complete_are_analysed_whole_and_the_warning_names_the_odd_worker():
    # dp 3: the last stage's workers (ranks 3-5) run a barrier in steps 0, 2 and 4, and rank 5
    # in steps 1 and 3 too: those two steps are left out as before (the others analysed with
    # every replica), and the warning names rank 5's worker, not the two honest ones (it said
    # "ops missing from workers (dp 0, pp 1), (dp 1, pp 1)")
    trace = with_extra(job(3), 5, "barrier")
    for rank in (3, 4):
        trace = with_extra(trace, rank, "barrier", steps=[0, 2, 4])
    r = analyze(trace, steps="all")
    assert r.warnings[0].endswith("ops that no majority of their stage's workers ran, at "
                                  "workers (dp 2, pp 1)"), r.warnings
    assert r.steps_analysed == [0, 2, 4] and r.left_out == [] and not r.partial


def test_a_run_directory_read_by_partitions_leaves_out_the_same_ops(tmp_path):
    # `stragglers analyze RUN` assembles the grid from step partitions: the same judgement
    trace = with_extra(job(3, steps=6), 5, "all-reduce")
    write_run(tmp_path / "run", trace)
    whole = analyze(trace, steps="all")
    for partitions in (1, 3):
        r = analyze_run(tmp_path / "run", steps="all", partitions=partitions)[0]
        assert r.left_out == whole.left_out == [] and r.slowdown == whole.slowdown
        assert r.warnings[0] == whole.warnings[0] and r.warnings[0].startswith(OPS_LEFT_OUT)
