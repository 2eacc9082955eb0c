"""The dependency model on traces recorded per pipeline action (split backward, looped stages)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from stragglers.trace.model import OPTYPE_CODES as C
from stragglers.trace.synth import generate
from stragglers.trace.synth.actions import action_trace, looped_orders, single_orders
from stragglers.whatif import analyze
from stragglers.whatif.dependencies import build_dependencies, recorded_per_action
from stragglers.whatif.grid import build_grid
from stragglers.whatif.metrics import WhatIf

SAMPLES = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "ndtimeline-samples"
CASES = {"gpipe": lambda: single_orders(3, 4, "gpipe"), "1f1b": lambda: single_orders(3, 5, "1f1b"),
         "zb": lambda: single_orders(3, 5, "zb"), "looped": lambda: looped_orders(2, 3)}


@pytest.mark.parametrize("case", sorted(CASES))
def test_replay_with_launch_delays_reproduces_every_step(case):
    trace = action_trace(CASES[case](), steps=4, gap=0.002, seed=3)
    grid = build_grid(trace)
    assert recorded_per_action(grid)
    w = WhatIf.build(grid)
    np.testing.assert_allclose(w.t_replay, w.t_base, rtol=1e-6)
    assert w.sim_error <= 1e-6


def _node(grid, stage, optype, seq):
    return int(np.flatnonzero((grid.node_stage == stage) & (grid.node_optype == C[optype])
                              & (grid.node_seq == seq))[0])


def test_split_backward_edges_and_pairs():
    """I sends the input gradient, W depends only on the compute stream; pairs by stage and order."""
    grid = build_grid(action_trace(single_orders(2, 3, "zb"), steps=2))
    model = build_dependencies(grid)
    w_nodes = np.flatnonzero(grid.node_optype == C["backward-weight-compute"])
    assert len(w_nodes) == 6  # 3 microbatches × 2 stages
    p2p = {C[n] for n in ("forward-send", "forward-recv", "backward-send", "backward-recv")}
    sends = {C["forward-send"], C["backward-send"]}
    for w in w_nodes:  # a W sends nothing and waits for no transfer (a recv may be posted after it)
        assert not any(grid.node_optype[d] in p2p for d in model.deps[w])
        assert not any(w in model.deps[n] for n in range(len(model.deps))
                       if grid.node_optype[n] in sends)
    # stage 1's k-th backward (I) feeds its k-th backward-send, which pairs with stage 0's k-th
    # backward-recv, which feeds stage 0's k-th I.
    for k in range(3):
        i1, send = _node(grid, 1, "backward-compute", k), _node(grid, 1, "backward-send", k)
        recv, i0 = _node(grid, 0, "backward-recv", k), _node(grid, 0, "backward-compute", k)
        assert i1 in model.deps[send] and recv in model.deps[i0]
        assert model.group_of[send] == model.group_of[recv] >= 0
    assert not model.no_op.any()


def test_looped_stages_pair_by_peer_stage():
    """Two stages per rank: the send of stage 1 (rank 1) pairs with stage 2's recv (rank 0)."""
    grid = build_grid(action_trace(looped_orders(2, 3), steps=2))
    model = build_dependencies(grid)
    for g in model.groups:
        if len(g) != 2:
            continue
        a, b = g
        send, recv = (a, b) if "send" in grid.node_name(a) else (b, a)
        own_send = grid.node_gmc[send] + (-1 if grid.node_optype[send] == C["forward-send"] else 1)
        assert grid.node_gmc[recv] == own_send  # the recv names the sender's stage
    assert sum(len(g) == 2 for g in model.groups) == 3 * 3 * 2  # 3 links × 3 mbs × 2 directions


def test_heavy_stage_found_and_clean_job_none():
    clean = analyze(action_trace(single_orders(3, 6, "zb"), steps=6, seed=1))
    assert [f.cause for f in clean.diagnosis] == ["none"]
    heavy = analyze(action_trace(single_orders(3, 6, "zb"), steps=6, seed=1, slow={1: 3.0}))
    top = heavy.diagnosis[0]
    assert top.cause == "stage_imbalance" and top.where.pp == [1]


def test_other_sources_keep_the_megatron_model():
    assert not recorded_per_action(build_grid(generate(dp=2, pp=4, microbatches=4, steps=3)))
    from stragglers.trace.load import load_trace

    st = SAMPLES / "trace-ST.parquet"
    if st.exists():
        assert not recorded_per_action(build_grid(load_trace(st)))


def test_deadlocking_action_lists_refused():
    orders = single_orders(2, 2, "1f1b")
    orders[0] = [("B", 0, 0), ("F", 0, 0)] + orders[0][2:]  # waits for a gradient before sending
    with pytest.raises(ValueError, match="deadlock"):
        action_trace(orders, steps=1)


def _fsdp_replicas(trace, dp: int = 2):
    """The per-action trace laid out as FSDP2 over `dp` replicas records it (3-D without TP):
    every worker gathers its stage's parameters inside the first microbatch's forward only, so
    that forward is three compute pieces with two params-all-gather rows between, the other
    forwards one piece; replica d runs the same times, d ms later."""
    from stragglers.trace.model import JobMeta, OPTYPES, Trace

    ops = trace.ops
    rows = []
    for i in range(len(ops["step"])):
        r, step, code = int(ops["rank"][i]), int(ops["step"][i]), int(ops["optype"][i])
        t, d, mb = float(ops["start_ts"][i]), float(ops["duration"][i]), int(ops["mb_id"][i])
        mc, gmc = int(ops["mc"][i]), int(ops["gmc"][i])
        if OPTYPES[code] == "forward-compute" and mb == 0:
            for name, a, b in (("forward-compute", 0.0, 0.2), ("params-all-gather", 0.2, 0.3),
                               ("forward-compute", 0.3, 0.5), ("params-all-gather", 0.5, 0.6),
                               ("forward-compute", 0.6, 1.0)):
                piece = mb if name == "forward-compute" else -1
                rows.append((r, step, name, t + a * d, (b - a) * d, piece, mc, gmc))
        else:
            rows.append((r, step, OPTYPES[code], t, d, mb, mc, gmc))
    pp = trace.meta.pp_size
    cols: dict[str, list] = {k: [] for k in ("rank", "dp_rank", "stage", "step", "optype",
                                             "start_ts", "duration", "seq_id", "mb_id", "mc",
                                             "gmc")}
    for rep in range(dp):
        seq: dict[tuple, int] = {}
        for r, step, name, t, d, mb, mc, gmc in sorted(rows, key=lambda x: (x[0], x[1], x[3])):
            k = (r, step, name)
            seq[k] = seq.get(k, -1) + 1
            for col, v in zip(cols, (rep * pp + r, rep, r, step, name, t + rep * 1e-3, d, seq[k],
                                     mb, mc, gmc)):
                cols[col].append(v)
    meta = JobMeta(name="fsdp-replicas", dp_size=dp, pp_size=pp, vpp_size=1)
    return Trace.from_rows(cols, meta)


def test_transfers_feed_their_own_microbatch_where_compute_is_cut_unevenly():
    """dp 2 × pp 2 (1F1B), the first forward cut by FSDP2's gathers: stage 1's second receive
    feeds the second microbatch's forward, not a piece of the first (which made a cycle:
    that receive is posted after the first backward, which follows the first forward)."""
    grid = build_grid(_fsdp_replicas(action_trace(single_orders(2, 2, "1f1b"), steps=3, seed=2)))
    assert recorded_per_action(grid) and len(grid.dp_ranks) == 2
    model = build_dependencies(grid)
    fwd1 = _node(grid, 1, "forward-compute", 3)       # microbatch 1's only piece
    recv1 = _node(grid, 1, "forward-recv", 1)
    assert recv1 in model.deps[fwd1]
    assert recv1 not in model.deps[_node(grid, 1, "forward-compute", 2)]
    # a send follows the last piece of its action; a receive feeds the first
    assert _node(grid, 0, "forward-compute", 2) in model.deps[_node(grid, 0, "forward-send", 0)]
    assert _node(grid, 1, "forward-recv", 0) in model.deps[_node(grid, 1, "forward-compute", 0)]
    w = WhatIf.build(grid)  # every edge holds in time: the replay reproduces each step
    np.testing.assert_allclose(w.t_replay, w.t_base, rtol=1e-6)


def test_replica_steps_missing_an_actions_pieces_have_no_say_in_how_it_is_cut():
    """The first forward's cut pieces and gathers missing in 6 of the 10 replica-steps (rows
    lost): the 4 that hold them still join them into one action; counted as "not cut", the
    missing ones split it, and the second receive fed a piece of the first forward (a cycle)."""
    import dataclasses

    grid = build_grid(_fsdp_replicas(action_trace(single_orders(2, 2, "1f1b"), steps=5, seed=2)))
    gone = np.zeros(grid.shape[1:], bool)
    gone[1, :] = gone[0, 4] = True
    start, duration, present = grid.start.copy(), grid.duration.copy(), grid.present.copy()
    for n in (_node(grid, 1, "forward-compute", 1), _node(grid, 1, "forward-compute", 2),
              _node(grid, 1, "params-all-gather", 0), _node(grid, 1, "params-all-gather", 1)):
        start[n][gone], duration[n][gone], present[n][gone] = np.nan, 0.0, False
    holed = dataclasses.replace(grid, start=start, duration=duration, present=present)
    for g in (grid, holed):
        model = build_dependencies(g)
        fwd1, recv1 = _node(g, 1, "forward-compute", 3), _node(g, 1, "forward-recv", 1)
        assert recv1 in model.deps[fwd1]
        assert recv1 not in model.deps[_node(g, 1, "forward-compute", 2)]


def test_waiting_for_a_collective_is_one_majority_vote_a_tie_is_no():
    """The compute after a collective waited for it where it did in more than half the
    replica-steps holding both (the model's one vote, `_most`): a tie is no, whatever the sizes
    of the gaps (the median of the gaps once decided a tie by them); missing cells have no say."""
    from types import SimpleNamespace

    from stragglers.whatif.dependencies import _mostly_waited

    def grid(gaps):  # node 0 the collective (1 s long at t = 0), node 1 the compute after it
        gaps = np.array(gaps, float).reshape(1, -1)
        start = np.stack([np.zeros_like(gaps), 1.0 + gaps])
        return SimpleNamespace(start=start, duration=np.stack([np.ones_like(gaps)] * 2),
                               present=~np.isnan(start))

    assert not _mostly_waited(grid([0.5, 0.5, -1e-3, -1e-3]), 0, 1)   # tie, big waits
    assert not _mostly_waited(grid([1e-6, 1e-6, -0.5, -0.5]), 0, 1)   # tie, big overlaps
    assert _mostly_waited(grid([1e-6, 1e-6, 1e-6, -0.5]), 0, 1)
    assert _mostly_waited(grid([1e-6, 1e-6, np.nan, -0.5]), 0, 1)     # 2 of the 3 that ran
    assert not _mostly_waited(grid([np.nan] * 4), 0, 1)
