"""Expert imbalance: the all-to-all exchange that hid behind the early ranks' wait.

An all-to-all rank exchanges its rows with each peer in turn, a piece per peer, and a piece
starts once that peer has arrived. With a hot expert the early ranks do their pieces among
themselves while the hot rank still computes, so after its arrival only their piece with it
is left: their measured transfer is one piece, the hot rank's all three. With balanced
routing everyone arrives together and every rank does all three. The jobs here are written
by that rule (ground truth, no timing), once skewed and once balanced; the rank after the
combine with the longest compute is an early one, so its hidden pieces decide the step.
"""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import OPTYPE_CODES, JobMeta, Trace
from stragglers.whatif import analyze
from stragglers.whatif.grid import build_grid
from stragglers.whatif.metrics import WhatIf

RANKS, STEPS = 4, 6
PIECE = 2e-3          # one rank's exchange with one peer
PER_ROW = 20e-6       # expert compute per row received
ROWS = 512            # rows each rank routes per step
HOT = 2


def _exchange(arrive: np.ndarray) -> np.ndarray:
    """Each rank's end: its pieces one after another, each once its peer has arrived, the
    peers that arrived first first."""
    end = np.empty_like(arrive)
    for r in range(len(arrive)):
        t = arrive[r]
        for peer in sorted((p for p in range(len(arrive)) if p != r), key=lambda p: arrive[p]):
            t = max(t, arrive[peer]) + PIECE
        end[r] = t
    return end


def _job(hot_rows: int | None) -> Trace:
    """The MoE step (attention, dispatch, expert, combine, a compute after it, optimizer) on
    4 ranks: hot_rows sent to rank HOT of the 4·ROWS rows, the rest spread; None: balanced."""
    cols: dict[str, list] = {k: [] for k in ("rank", "dp_rank", "stage", "step", "optype",
                                              "start_ts", "duration", "seq_id", "mb_id", "mc",
                                              "gmc", "tokens")}

    def op(rank, step, seq, name, start, duration, tokens=-1):
        for k, v in zip(cols, (rank, rank, 0, step, name, start, duration, seq, 0, 0, 0, tokens)):
            cols[k].append(v)

    rng = np.random.default_rng(5)
    t0 = 0.0
    after = np.array([8e-3, 5e-3, 5e-3, 5e-3])      # rank 0's compute after the combine
    for step in range(STEPS):
        total = RANKS * ROWS
        if hot_rows is None:
            rows = np.full(RANKS, ROWS)
        else:
            rest = rng.multinomial(total - hot_rows, np.full(RANKS - 1, 1 / (RANKS - 1)))
            rows = np.insert(rest, HOT, hot_rows)
        attention = 4e-3 + 1e-4 * np.arange(RANKS)
        dispatch = np.full(RANKS, t0 + attention.max())     # everyone there: a small transfer
        expert = PER_ROW * rows
        combine_at = dispatch + 1e-4 + expert
        combine_end = _exchange(combine_at)
        post_end = combine_end + after
        for r in range(RANKS):
            op(r, step, 0, "forward-compute", t0, attention[r])
            op(r, step, 1, "all-to-all", t0 + attention[r], dispatch[r] + 1e-4 - t0 - attention[r],
               int(rows[r]))
            op(r, step, 2, "forward-compute", dispatch[r] + 1e-4, expert[r])
            op(r, step, 3, "all-to-all", combine_at[r], combine_end[r] - combine_at[r], ROWS)
            op(r, step, 4, "forward-compute", combine_end[r], after[r])
        sync = post_end.max()
        for r in range(RANKS):
            op(r, step, 5, "optimizer", sync, 1e-3)
        t0 = sync + 1e-3
    meta = JobMeta(name="moe-exchange", dp_size=RANKS, pp_size=1, ep_size=RANKS,
                   world_size=RANKS)
    return Trace.from_rows(cols, meta)


def _step(trace: Trace) -> float:
    return float(WhatIf.build(build_grid(trace)).t_base.mean())


def test_the_exchange_hidden_behind_the_wait_is_priced_at_balanced_routing():
    skewed, balanced = _job(hot_rows=1400), _job(hot_rows=None)
    finding = analyze(skewed, steps="all").diagnosis[0]
    assert finding.cause == "expert_imbalance" and finding.where.ranks == [HOT]
    measured = _step(skewed) / _step(balanced)
    # the ground truth: every rank's three pieces after the common arrival, then rank 0's
    # longer compute; with rank 0's one measured piece kept, the step would be 4 ms shorter
    assert abs(finding.speedup_if_fixed - measured) <= 0.02 * measured
    assert _step(skewed) / finding.speedup_if_fixed > _step(balanced) - 1e-3


def test_only_the_part_a_shorter_wait_no_longer_holds_is_exposed():
    """Measured costs replayed keep every wait: nothing changes. With the expert compute
    balanced the combine's early ranks do their whole exchange after arriving (the hot rank's
    three pieces); the dispatch, where nobody waited, stays as measured."""
    from stragglers.whatif.causes import experts
    from stragglers.whatif.causes.base import Context
    from stragglers.whatif.config import DiagnosisConfig

    trace = _job(hot_rows=1400)
    w = WhatIf.build(build_grid(trace))
    np.testing.assert_allclose(experts.exposed_exchange(w, w.cost), w.cost)
    load = experts.expert_load(Context.build(w, trace, DiagnosisConfig()), w.grid.duration)
    out = experts.exposed_exchange(w, experts.balanced_costs(load, w.cost))
    a2a = np.flatnonzero(w.grid.node_optype == OPTYPE_CODES["all-to-all"])
    dispatch, combine = a2a[np.argsort(np.median(w.grid.start[a2a], axis=(1, 2)))]
    np.testing.assert_allclose(out[dispatch], w.cost[dispatch])
    early = [d for d in range(RANKS) if d != HOT]
    np.testing.assert_allclose(w.cost[combine][early], PIECE, rtol=1e-6)
    np.testing.assert_allclose(out[combine][early], 3 * PIECE, rtol=1e-6)
    np.testing.assert_allclose(out[combine][HOT], w.cost[combine][HOT])
