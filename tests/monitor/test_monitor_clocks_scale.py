"""Rank clock alignment's cost (monitor/clocks.py) is about linear in a window's rows: a job
whose ranks are each on their own clock (hosts without NTP, steps under a second) made one
set per rank, and every set was tried against every set placed, after each placement, one
step's rows each time (sets² x rows: one step of 1,024 ranks 74 s of CPU, a 10-step window
of 256 ranks 36 s, in the one analysis process of every job). Now sets are placed round by
round; the work is counted here (consensus offsets taken, rows compared, sync keys built),
never timed. The offsets found stay those of before."""

from __future__ import annotations

import numpy as np
import pytest

from stragglers.monitor import clocks
from stragglers.monitor.clocks import MAX_ROUNDS, align_step_clocks
from stragglers.trace.kineto import align
from stragglers.trace.model import OPTYPE_CODES
from test_monitor_rank_clocks import healthy, moved

AR, FC = OPTYPE_CODES["grads-all-reduce"], OPTYPE_CODES["forward-compute"]
SEND, RECV = OPTYPE_CODES["forward-send"], OPTYPE_CODES["forward-recv"]


def columns(rows: list[tuple]) -> dict[str, np.ndarray]:
    """Op columns of (rank, step, optype, start, duration, stage, dp_rank, seq_id) rows."""
    a = np.array(rows, dtype=np.float64)
    return {"rank": a[:, 0].astype(np.int64), "step": a[:, 1].astype(np.int64),
            "optype": a[:, 2].astype(np.int16), "start_ts": a[:, 3], "duration": a[:, 4],
            "stage": a[:, 5].astype(np.int64), "dp_rank": a[:, 6].astype(np.int64),
            "seq_id": a[:, 7].astype(np.int64)}


def own_clocks(ranks: int, steps: int = 1) -> dict[str, np.ndarray]:
    """A DP job whose rank r's clock is 1e4 * r s ahead (every rank a set of its own): four
    forward computes and all-reduces a rank a step, ends on one clock equal."""
    rows = []
    for r in range(ranks):
        t = 1e4 * r
        for s in range(steps):
            for i in range(4):
                rows.append((r, s, FC, t, 0.01, 0, r, s * 4 + i))
                rows.append((r, s, AR, t + 0.01, 0.005, 0, r, s * 4 + i))
                t += 0.015
    return columns(rows)


@pytest.fixture
def work(monkeypatch):
    """The alignment's work, counted on the real functions: consensus offsets taken (past
    `limit`, an error at once: the old code took sets²/2), the differences they were given,
    and _sync_keys' calls and rows."""
    n = {"offsets": 0, "diffs": 0, "sync_keys": 0, "sync_rows": 0, "limit": None}
    offset, keys = align.consensus_offset, clocks._sync_keys

    def counted_offset(diffs, *args, **kwargs):
        n["offsets"] += 1
        n["diffs"] += len(diffs)
        if n["limit"] is not None and n["offsets"] > n["limit"]:
            raise AssertionError(f"consensus_offset called more than {n['limit']} times")
        return offset(diffs, *args, **kwargs)

    def counted_keys(ops, rows):
        n["sync_keys"] += 1
        n["sync_rows"] += len(rows)
        return keys(ops, rows)

    monkeypatch.setattr(align, "consensus_offset", counted_offset)
    monkeypatch.setattr(clocks, "_sync_keys", counted_keys)
    return n


def test_1024_ranks_each_on_its_own_clock_cost_one_offset_a_rank(work):
    # one step: each rank's four all-reduce ends against rank 0's, once (before: 523,776
    # consensus offsets at 1,024 ranks, 74 s; 32,640 at 256); the work per rank the same at
    # 256 and 1,024 ranks
    counts = {}
    for k in (256, 1024):
        work.update(offsets=0, diffs=0, sync_keys=0, sync_rows=0, limit=k - 1)
        got = align_step_clocks(own_clocks(k))
        assert got.left_out == {}
        assert got.moved == {(r, 0): pytest.approx(1e4 * r, abs=1e-6) for r in range(1, k)}
        counts[k] = dict(work)
    for k, c in counts.items():
        assert (c["offsets"], c["diffs"], c["sync_keys"], c["sync_rows"]) \
            == (k - 1, 4 * (k - 1), 1, 8 * k), (k, c)
    assert counts[1024]["diffs"] / counts[256]["diffs"] == pytest.approx(1023 / 255)


def test_a_ten_step_window_builds_its_sync_keys_once(work):
    # (before: a scan of every row and a sync-key sort per step, and sets² offsets per step)
    work["limit"] = 63 * 10
    got = align_step_clocks(own_clocks(64, steps=10))
    assert len(got.moved) == 63 * 10 and got.left_out == {}
    assert (work["offsets"], work["sync_keys"], work["sync_rows"]) == (630, 1, 64 * 80)
    assert got.start_ts is not None
    ops = own_clocks(64, steps=10)
    # every rank's starts now on rank 0's clock: each rank's step s begins where rank 0's does
    first = {(int(r), int(s)): t for r, s, t in zip(ops["rank"][::-1], ops["step"][::-1],
                                                    got.start_ts[::-1])}
    assert all(first[(r, s)] == pytest.approx(first[(0, s)], abs=1e-6)
               for r in range(64) for s in range(10))


def dp_pp(dp: int, pp: int, offset) -> dict[str, np.ndarray]:
    """A dp x pp job of one step, rank stage * dp + d on a clock `offset(rank)` s ahead: each
    stage's DP all-reduces (their own seq_ids), a forward transfer between neighbours, ends on
    one clock equal."""
    rows = []
    for st in range(pp):
        for d in range(dp):
            r, t = st * dp + d, offset(st * dp + d) + 0.1 * st
            rows.append((r, 0, FC, t, 0.05, st, d, 0))
            if st:
                rows.append((r, 0, RECV, t - 0.1, 0.1, st, d, 0))   # the sender's end
            if st < pp - 1:
                rows.append((r, 0, SEND, t + 0.05, 0.05, st, d, 0))
            for i in range(3):
                rows.append((r, 0, AR, t + 0.01 * i, 0.005, st, d, 100 * st + i))
    return columns(rows)


def test_known_offsets_of_a_dp_pp_job_on_sixteen_clocks_are_found_exactly(work):
    # dp4 x pp4, every rank on its own clock: rank 0's DP peers and its next stage in the
    # first round, the others in later ones; each offset the one applied (as before), and
    # one consensus offset a rank (before: 120)
    def offset(r):
        return 1e4 * r + 0.125 * (r % 3)
    work["limit"] = 15
    got = align_step_clocks(dp_pp(4, 4, offset))
    assert got.left_out == {}
    assert got.moved == {(r, 0): pytest.approx(offset(r) - offset(0), abs=1e-6)
                         for r in range(1, 16)}


def test_four_clocks_in_the_synthetic_pipeline_job_are_found_within_their_ends_spread():
    # dp2 x pp2, every rank on its own clock: rank 3 shares only a few of rank 0's collectives
    # and their ends disagree, so it is placed once ranks 1 and 2 are (as before, when it
    # was tried last; in the first round it was left out); each offset within the spread of
    # the ends it is read from (an offset is a median of differences of ends of one sync key;
    # this generator's keys, without process groups, hold ends up to 46 ms apart on one clock)
    offsets = {1: 100.0, 2: 7e3, 3: -5e5}
    o = healthy()
    for r, seconds in offsets.items():
        o = moved(o, seconds, ranks=(r,))
    got = align_step_clocks(o.ops)
    assert got.left_out == {}
    h = healthy().ops
    _, key, end, _ = clocks._sync_keys(h, np.arange(len(h["rank"])))
    order = np.argsort(key, kind="stable")
    head = np.flatnonzero(np.r_[True, np.diff(key[order]) != 0])
    spread = float((np.maximum.reduceat(end[order], head)
                    - np.minimum.reduceat(end[order], head)).max())
    assert got.moved == {(r, s): pytest.approx(seconds, abs=spread)
                         for r, seconds in offsets.items() for s in range(20)}


def pipeline(stages: int) -> dict[str, np.ndarray]:
    """One DP replica of `stages` stages, stage i rank i on a clock 1e4 * i s ahead: each
    stage meets only its neighbours (a forward transfer each way), so the sets chain."""
    rows = []
    for i in range(stages):
        t = 1e4 * i + 0.02 * i
        rows.append((i, 0, FC, t, 0.01, i, 0, 0))
        if i:
            rows.append((i, 0, RECV, t - 0.005, 0.005, i, 0, 0))
        if i < stages - 1:
            rows.append((i, 0, SEND, t + 0.01, 0.01, i, 0, 0))
    return columns(rows)


def test_a_chain_of_clocks_past_max_rounds_is_left_out_named(work):
    # each round places one more stage; those MAX_ROUNDS + 2 links away are left out with
    # the bound named, not followed (a 65,536-stage chain would be as many rounds)
    got = align_step_clocks(pipeline(MAX_ROUNDS + 3))
    assert got.moved == {(i, 0): pytest.approx(1e4 * i, abs=1e-6)
                         for i in range(1, MAX_ROUNDS + 1)}
    assert set(got.left_out) == {(MAX_ROUNDS + 1, 0), (MAX_ROUNDS + 2, 0)}
    why = got.left_out[(MAX_ROUNDS + 1, 0)]
    assert why.startswith("step 0: ") and f"{MAX_ROUNDS} rounds" in why and "\n" not in why
    assert work["offsets"] == MAX_ROUNDS


def test_past_the_bound_on_rows_read_a_step_is_left_out_named(monkeypatch):
    # a bound of one read a row: the first round reads the step's all-reduce rows more than
    # once (rank 0's, then every rank's of them), so every rank but the base set's is left out
    monkeypatch.setattr(clocks, "MAX_ROWS_READ", 1)
    got = align_step_clocks(own_clocks(16))
    assert got.moved == {} and got.start_ts is None
    assert set(got.left_out) == {(r, 0) for r in range(1, 16)}
    assert "1 reads of each row" in got.left_out[(1, 0)]


def test_ranks_apart_that_share_no_collective_are_left_out_as_before():
    # forward computes only (no end is shared): every set but the base one left out, named
    ops = own_clocks(8)
    keep = ops["optype"] == FC
    got = align_step_clocks({k: v[keep] for k, v in ops.items()})
    assert got.moved == {} and set(got.left_out) == {(r, 0) for r in range(1, 8)}
    assert "shares no collective whose ends agree" in got.left_out[(7, 0)]


def test_a_set_whose_ends_disagree_is_tried_again_only_as_its_matches_double(work):
    # a pipeline of 64 stages on their own clocks, and 64 more ranks on theirs whose ends of
    # every stage's all-reduce (three a stage, 10 ms apart) never agree: each stage placed
    # adds three matches to every such rank; trying them every round would take 64 x 63
    # offsets, once their matches double 64 x 7 (3, 6, ..., 192 matched)
    stages, noisy = 64, 64
    o = pipeline(stages)
    rows = [(i, 0, AR, 1e4 * i + 0.02 * i, 0.001, i, 0, i) for i in range(stages)]
    for j in range(noisy):
        r = stages + j
        rows += [(r, 0, AR, 1e4 * r + 0.02 * i + d, 0.001, 0, 1 + j, i)
                 for i in range(stages) for d in (0.0, 0.01, 0.02)]
    extra = columns(rows)
    got = align_step_clocks({k: np.concatenate([o[k], extra[k]]) for k in o})
    assert got.moved == {(i, 0): pytest.approx(1e4 * i, abs=1e-6) for i in range(1, stages)}
    assert set(got.left_out) == {(stages + j, 0) for j in range(noisy)}
    assert "shares no collective whose ends agree" in got.left_out[(stages, 0)]
    assert work["offsets"] <= (stages - 1) + noisy * (1 + int(np.log2(stages))), work
