"""whatif.buckets: bucket producers that hold on every replica, on a DDP-shaped trace."""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import OPTYPE_CODES, JobMeta, Trace
from stragglers.whatif.grid import build_grid
from stragglers.whatif.buckets import bucket_producers

BWD, AR = OPTYPE_CODES["backward-compute"], OPTYPE_CODES["grads-all-reduce"]


def ddp_step(rows: dict, dp: int, step: int, t0: float, seg: float, ar_starts: list[float]):
    """forward, three backward segments (a bucket ready after each), three bucket all-reduces."""
    def add(optype, start, dur, seq, mb):
        for k, v in (("rank", dp), ("dp_rank", dp), ("stage", 0), ("step", step),
                     ("optype", optype), ("start_ts", start), ("duration", dur), ("seq_id", seq),
                     ("mb_id", mb), ("mc", 0), ("gmc", 0)):
            rows[k].append(v)
    add("forward-compute", t0, seg, 0, 0)
    for i in range(3):
        add("backward-compute", t0 + seg * (1 + i), seg, i, 0)
    for i, s in enumerate(ar_starts):
        add("grads-all-reduce", t0 + s, 0.001, i, -1)


def test_the_producer_is_the_one_every_replica_agrees_on():
    rows = {k: [] for k in ("rank", "dp_rank", "stage", "step", "optype", "start_ts", "duration",
                            "seq_id", "mb_id", "mc", "gmc")}
    # dp 0 is fast (segments of 10 ms) and its buckets 1, 2 queue behind bucket 0, which waits
    # for dp 1: they start after its whole backward. dp 1 is slow (segments of 40 ms) and
    # launches each bucket right when its segment ends.
    for step in range(3):
        t0 = step * 1.0
        ddp_step(rows, 0, step, t0, 0.010, [0.020, 0.0805, 0.1205])
        ddp_step(rows, 1, step, t0, 0.040, [0.080, 0.120, 0.160])
    trace = Trace.from_rows(rows, JobMeta(name="t", dp_size=2, pp_size=1))
    grid = build_grid(trace, None)
    comp = [int(n) for n in np.flatnonzero(np.isin(grid.node_optype,
                                                   (OPTYPE_CODES["forward-compute"], BWD)))]
    comp.sort(key=lambda n: (grid.start[n, 0, 0], grid.node_optype[n]))
    grads = sorted((int(n) for n in np.flatnonzero(grid.node_optype == AR)),
                   key=lambda n: grid.node_seq[n])
    producers = bucket_producers(grid, grads, comp)
    bwd = [n for n in comp if grid.node_optype[n] == BWD]
    # bucket k is produced by backward segment k on both replicas (dp 0 alone would say the
    # last segment for buckets 1 and 2)
    assert [producers[g] for g in grads] == bwd


def test_a_bucket_launched_mid_backward_on_one_replica_only_makes_the_sync_bucketed():
    # Profiler-shaped DDP: one backward op per step. dp 0 launches its single bucket when its
    # backward ends; dp 1's backward goes on for 25 ms after its bucket was ready. Decided on
    # dp 0's first step alone, the all-reduce would wait for the whole backward everywhere and
    # the replay of dp 1 would run 25 ms late (sim_error of 5% on a real profiler run).
    from stragglers.whatif import analyze_with_model

    rows = {k: [] for k in ("rank", "dp_rank", "stage", "step", "optype", "start_ts", "duration",
                            "seq_id", "mb_id", "mc", "gmc")}

    def add(dp, step, optype, start, dur, mb):
        for k, v in (("rank", dp), ("dp_rank", dp), ("stage", 0), ("step", step),
                     ("optype", optype), ("start_ts", start), ("duration", dur), ("seq_id", 0),
                     ("mb_id", mb), ("mc", 0), ("gmc", 0)):
            rows[k].append(v)

    for step in range(4):
        t0 = step * 1.0
        add(0, step, "forward-compute", t0, 0.020, 0)
        add(0, step, "backward-compute", t0 + 0.020, 0.040, 0)
        add(1, step, "forward-compute", t0, 0.020, 0)
        add(1, step, "backward-compute", t0 + 0.020, 0.065, 0)
        # the all-reduce ends together on both (dp 1's launch at 0.060 is the later one)
        add(0, step, "grads-all-reduce", t0 + 0.060, 0.010, -1)
        add(1, step, "grads-all-reduce", t0 + 0.060, 0.010, -1)
        for dp, end in ((0, 0.070), (1, 0.085)):
            add(dp, step, "optimizer", t0 + end, 0.005, -1)
    trace = Trace.from_rows(rows, JobMeta(name="t", dp_size=2, pp_size=1))
    result, w = analyze_with_model(trace, steps="all")
    assert result.sim_error < 1e-6, (w.t_replay, w.t_base)
