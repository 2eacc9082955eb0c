"""Batched p2p calls (Megatron's batch_isend_irecv): transfer is measured per call, not per row."""

import numpy as np
import pytest

from stragglers.trace.model import OPTYPE_CODES as C, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze_with_model


def batched(trace: Trace, stage: int, first: str, second: str, shift: int) -> Trace:
    """On one stage, row k of `first` and row k+shift of `second` become one call: both start
    when the later is posted and end when the later completes (what a batched call records)."""
    ops = {k: v.copy() for k, v in trace.ops.items()}
    on_stage = ops["stage"] == stage
    for d in np.unique(ops["dp_rank"]):
        for s in np.unique(ops["step"]):
            sel = on_stage & (ops["dp_rank"] == d) & (ops["step"] == s)
            a_rows = np.flatnonzero(sel & (ops["optype"] == C[first]))
            b_rows = np.flatnonzero(sel & (ops["optype"] == C[second]))
            a_rows = a_rows[np.argsort(ops["seq_id"][a_rows])]
            b_rows = b_rows[np.argsort(ops["seq_id"][b_rows])]
            for k, a in enumerate(a_rows):
                if not 0 <= k + shift < len(b_rows):
                    continue
                b = b_rows[k + shift]
                start = max(ops["start_ts"][a], ops["start_ts"][b])
                end = max(ops["start_ts"][a] + ops["duration"][a],
                          ops["start_ts"][b] + ops["duration"][b])
                for r in (a, b):
                    ops["start_ts"][r], ops["duration"][r] = start, end - start
    return Trace(ops, trace.meta, trace.source)


@pytest.mark.parametrize("vpp", [1, 2])
def test_slow_worker_behind_a_batched_call_is_a_worker_fault(vpp):
    # stage 2 sends forward to stage 3 in the same call as it receives from stage 1, whose
    # worker on DP rank 1 is slow: the wait for stage 1 must not count as transfer to stage 3
    trace = generate(dp=4, pp=4, vpp=vpp, microbatches=8, steps=6, seed=3,
                     slow_worker=(1, 1, 2.0))
    truth = trace.meta.extra["ground_truth"][0]["impact"]
    result, w = analyze_with_model(batched(trace, 2, "forward-send", "forward-recv", 1))
    causes = [d.cause for d in result.diagnosis]
    assert causes == ["worker_fault"], result.diagnosis
    top = result.diagnosis[0]
    assert sorted((x.dp, x.pp) for x in top.where.workers) == [(1, 1)]
    assert abs(top.speedup_if_fixed / truth - 1) < 0.05
    # the forward-send rows on stage 2 of the batched call keep their own (small) transfer
    g = w.grid
    sends = (g.node_stage == 2) & (g.node_optype == C["forward-send"])
    assert np.median(w.cost[sends]) < 0.01
