"""p2p ops recorded but never launched (no peer) must not change the analysis."""

import numpy as np

from stragglers.trace.model import OPTYPE_CODES, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze


def with_noop_recvs(trace: Trace) -> Trace:
    """Add a zero-length forward-recv before every first-chunk forward on stage 0, as profilers do."""
    ops = trace.ops
    fwd = (ops["optype"] == OPTYPE_CODES["forward-compute"]) & (ops["stage"] == 0) & (ops["gmc"] == 0)
    extra = {k: v[fwd].copy() for k, v in ops.items()}
    extra["optype"][:] = OPTYPE_CODES["forward-recv"]
    extra["duration"][:] = 0.0
    extra["mb_id"][:] = -1
    extra["gmc"][:] = -1
    merged = {k: np.concatenate([ops[k], extra[k]]) for k in ops}
    # Renumber forward-recv seq_id on each (dp, stage 0, step) by start time.
    recv = np.flatnonzero(merged["optype"] == OPTYPE_CODES["forward-recv"])
    order = recv[np.lexsort((merged["start_ts"][recv], merged["step"][recv],
                             merged["stage"][recv], merged["dp_rank"][recv]))]
    key = np.stack([merged["dp_rank"][order], merged["stage"][order], merged["step"][order]])
    new = np.ones(len(order), bool)
    new[1:] = np.any(key[:, 1:] != key[:, :-1], axis=0)
    idx = np.arange(len(order))
    merged["seq_id"][order] = idx - np.maximum.accumulate(np.where(new, idx, 0))
    return Trace(merged, trace.meta, trace.source)


def test_noop_recvs_are_detected_in_interleaved_pipelines():
    trace = generate(dp=2, pp=4, vpp=2, microbatches=8, steps=4, seed=5, heavy_last_stage=1.3)
    plain = analyze(trace)
    noisy = analyze(with_noop_recvs(trace))
    assert noisy.sim_error < 1e-6
    assert abs(noisy.slowdown - plain.slowdown) < 1e-6
    assert noisy.diagnosis[0].cause == plain.diagnosis[0].cause == "stage_imbalance"
