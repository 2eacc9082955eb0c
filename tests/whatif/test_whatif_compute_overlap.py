"""Compute ops stated longer than their worker's own compute stream holds (timing.
_clip_computes): red team round 13, finding 6."""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import OPTYPE_CODES, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze

COMPUTE = [OPTYPE_CODES[o] for o in ("forward-compute", "backward-compute", "optimizer")]
BWD = OPTYPE_CODES["backward-compute"]
PAST = "compute ops running past their rank's next compute or send"


def _cut(result) -> list[str]:
    return [w for w in result.warnings if w.startswith("rows cut to their worker's own")]


def _rank3(trace: Trace, change) -> Trace:
    ops = {k: v.copy() for k, v in trace.ops.items()}
    change(ops, ops["rank"] == 3)
    return Trace(ops, trace.meta)


def test_computes_stated_three_times_long_over_their_own_next_ops_read_healthy():
    """Rank 3 (dp 1, pp 1) of a healthy job writes its computes ×3, starts kept: each runs on
    through its rank's next compute and the send it feeds (S 1.73 and worker_fault at face
    value). Cut at those starts, the job reads healthy (S 1.05, none; 1.007 unchanged) and
    the warning names the rank."""
    def longer(ops, mine):
        hit = mine & np.isin(ops["optype"], COMPUTE)
        ops["duration"] = np.where(hit, ops["duration"] * 3, ops["duration"])

    result = analyze(_rank3(generate(dp=2, pp=2, microbatches=4, steps=8, seed=0), longer))
    assert result.slowdown < 1.1, result.slowdown
    assert [f.cause for f in result.diagnosis] == ["none"], result.diagnosis
    assert PAST in _cut(result)[0] and "workers (dp 1, pp 1)" in _cut(result)[0], \
        result.warnings


def test_backward_computes_starting_inside_the_forward_before_them_make_no_straggler():
    """The other side: rank 3's backward computes written 0.02 s early, ends kept (each starts
    inside the forward before it; S 1.16 and worker_fault at face value). No dependency tells
    which of the two rows lied; the peer's rows, which overlap nothing, read the durations as
    an early start (the forward cut where the backward began read S 1.08 and a host stall):
    the backward starts where the forward ended, and the job reads healthy (1.007)
    (tests/whatif/test_computes_starting_early.py)."""
    def earlier(ops, mine):
        hit = mine & (ops["optype"] == BWD)
        ops["start_ts"] = np.where(hit, ops["start_ts"] - 0.02, ops["start_ts"])
        ops["duration"] = np.where(hit, ops["duration"] + 0.02, ops["duration"])

    result = analyze(_rank3(generate(dp=2, pp=2, microbatches=4, steps=8, seed=0), earlier))
    assert result.slowdown < 1.01 and not result.straggling, result.slowdown
    assert [f.cause for f in result.diagnosis] == ["none"], result.diagnosis
    assert "starting before their input was there" in _cut(result)[0], result.warnings


def test_a_slow_worker_whose_later_ops_moved_is_not_cut():
    """A ×3 worker as a real one runs (its later ops and its peers' waits moved, the
    generator's slow_worker): its computes fit its timeline, none is cut, and it is found."""
    result = analyze(generate(dp=2, pp=2, microbatches=4, steps=8, seed=0,
                              slow_worker=(1, 1, 3.0)))
    assert not any(PAST in w for w in result.warnings), result.warnings
    top = result.diagnosis[0]
    assert top.cause == "worker_fault" and top.where.dp == [1] and top.where.pp == [1], top
