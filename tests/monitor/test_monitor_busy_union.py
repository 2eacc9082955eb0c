"""The fast detector's busy time is what one compute stream can hold: computes stated to
overlap (round 13, finding 7) count their overlap once, in memory and read from a part file."""

from __future__ import annotations

import sys

import numpy as np

from conftest import REPO
from stragglers.monitor.changes import busy_per_step, is_compute, read_busy
from stragglers.trace.model import OPTYPE_CODES

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import slow_job  # noqa: E402

FWD, SEND, GC = (OPTYPE_CODES[n] for n in ("forward-compute", "forward-send", "gc"))


def test_overlapping_computes_count_their_overlap_once():
    # step 0: [0, 1] and [0.5, 1.5] (overlap 0.5) and a send through both: the stream was busy
    # 1.5 s (the sum said 2.0). Step 1: [2, 3] and [2.2, 2.4]: the stream's second compute
    # started at 2.2, so the first ended by then: 0.4 s (the sum said 1.2). Step 2: a compute
    # [4, 5] with a GC pause [4.2, 4.5] of the host beside it: both counted, 1.3 s
    step = np.array([0, 0, 0, 1, 1, 2, 2])
    optype = np.array([FWD, FWD, SEND, FWD, FWD, FWD, GC])
    start = np.array([0.0, 0.5, 0.0, 2.0, 2.2, 4.0, 4.2])
    duration = np.array([1.0, 1.0, 5.0, 1.0, 0.2, 1.0, 0.3])
    steps, busy = busy_per_step(step, is_compute(optype), start, duration, optype == GC)
    assert steps.tolist() == [0, 1, 2] and np.allclose(busy, [1.5, 0.4, 1.3])
    # rows out of start order give the same (a recorder's own order is not relied on)
    order = np.array([4, 2, 6, 0, 3, 5, 1])
    again = busy_per_step(step[order], is_compute(optype[order]), start[order], duration[order],
                          optype[order] == GC)
    assert np.allclose(again[1], busy)


def _per_step(o, rank):
    sel = o["rank"] == rank
    return busy_per_step(o["step"][sel], is_compute(o["optype"][sel]), o["start_ts"][sel],
                         o["duration"][sel])[1]


def test_computes_stated_long_over_their_own_ops_move_the_busy_time_less_than_a_real_slowdown(
        tmp_path):
    from stragglers.trace.runformat import write_rank

    healthy = slow_job(steps=6, dp=4, pp=1, slow=None, seed=2).ops
    slowed = slow_job(steps=6, dp=4, pp=1, slow=(3, 0, 1.5), seed=2).ops
    base = _per_step(healthy, 3)
    # rank 3's compute durations x3, starts kept: the sum read ~3x; one stream holds ~1.16x
    # (the overlap counted once; the last compute of a step runs past its stated slot)
    longer = dict(healthy)
    longer["duration"] = np.where((healthy["rank"] == 3) & is_compute(healthy["optype"]),
                                  healthy["duration"] * 3, healthy["duration"])
    stated = _per_step(longer, 3) / base
    assert (stated < 1.2).all(), stated
    # a rank really 1.5x slower (its computes longer, everything after them later) is read so
    real = _per_step(slowed, 3) / base
    assert (real > 1.4).all(), real
    # the same read from the part file, whole and as a part of one step
    sel = longer["rank"] == 3
    path = write_rank(tmp_path, 3, {k: v[sel] for k, v in longer.items()}, part=0)
    assert np.allclose(read_busy(path)[1] / base, stated)
    one = sel & (longer["step"] == 2)
    path = write_rank(tmp_path, 3, {k: v[one] for k, v in longer.items()}, part=1)
    steps, busy = read_busy(path, 2)
    # (its last compute is not cut by the next step's first, which another part holds)
    alone = busy_per_step(longer["step"][one], is_compute(longer["optype"][one]),
                          longer["start_ts"][one], longer["duration"][one])[1]
    assert steps.tolist() == [2] and np.allclose(busy, alone) and busy[0] / base[2] < 1.2
