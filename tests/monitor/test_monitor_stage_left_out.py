"""A window whose left-out ranks take every rank of a stage says so in one line (no DP replica
is whole), instead of 'analysis failed: ValueError: zero-size array ...' from the engine."""

from __future__ import annotations

import time

from stragglers.monitor.windows import Window, analyse_window
from stragglers.trace.model import Trace
from stragglers.trace.synth import generate


def test_every_rank_of_a_stage_left_out_is_a_clear_window_error():
    # a 2x2 job whose ranks 0 and 3 (other replicas, other stages) write durations /1000:
    # the clock checks leave both stage-1 ranks out (s50-hG's leftovers)
    t = generate(dp=2, pp=2, microbatches=4, steps=5, seed=0)
    o = {k: v.copy() for k, v in t.ops.items()}
    for r in (0, 3):
        o["duration"][o["rank"] == r] /= 1000
    row, _ = analyse_window(Window("j", 0, list(range(5)), Trace(o, t.meta, t.source),
                                   missing_ranks=[], closed_at=time.time()))
    assert row.error is not None and "analysis failed" not in row.error, row.error
    assert row.error.startswith("no DP replica is whole: every rank of stage 1"), row.error
