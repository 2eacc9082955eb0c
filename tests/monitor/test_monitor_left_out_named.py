"""Ranks a window leaves out before the engine sees them are named in its notes and hold
`ranks_left_out` (round 13, finding 8): a rank whose every step the clock check left out, and
the replica peers whole_replicas drops with a rank that sent nothing."""

from __future__ import annotations

import sys
import time

import numpy as np

from conftest import REPO
from stragglers.monitor.alerts import LEFT_OUT_NOTE, AlertEngine, parse_rules
from stragglers.monitor.store import Store
from stragglers.monitor.windows import Window, analyse_window
from stragglers.trace.model import OPTYPE_CODES, Trace

sys.path.insert(0, str(REPO / "tests" / "monitor"))
from monitor_jobs import rank_of, slow_job  # noqa: E402

GRADIENT = [OPTYPE_CODES[n] for n in ("params-all-gather", "grads-reduce-scatter",
                                      "layernorm-grads-all-reduce",
                                      "embedding-grads-all-reduce", "optimizer-clip-main-grad")]


def _window(trace: Trace, keep: np.ndarray, missing: list[int]) -> Window:
    o = trace.ops
    return Window("j", 0, list(range(5)), Trace({k: v[keep] for k, v in o.items()}, trace.meta,
                                                "monitor:j#0"),
                  missing_ranks=missing, closed_at=time.time(), reason="complete")


def _left_out(tmp_path, row) -> list[str]:
    """The ranks_left_out alerts a window holds (their descriptions)."""
    store = Store(tmp_path / "a.db")
    store.register_job("j", str(tmp_path), "http", None)
    rows, _, _ = AlertEngine(parse_rules(None), store, 3600).on_window("j", row, now=1.0)
    store.close()
    return [a.annotations.description for a in rows if a.rule == "ranks_left_out"]


def test_a_rank_whose_every_step_the_clock_check_left_out_is_named(tmp_path):
    # the 3x straggler (dp 1, pp 1) jitters its gradient collectives' starts +-0.03 s: no one
    # offset explains its ends, every step of it is left out, and its replica with it
    trace = slow_job(steps=5, slow=(1, 1, 3.0))
    o = trace.ops
    straggler, peer = rank_of(trace, 1, 1), rank_of(trace, 1, 0)
    sel = (o["rank"] == straggler) & np.isin(o["optype"], GRADIENT)
    sign = np.where(np.arange(len(o["step"])) % 2 == 0, 1.0, -1.0)
    o["start_ts"] = np.where(sel, o["start_ts"] + 0.03 * sign, o["start_ts"])
    row, _ = analyse_window(_window(trace, np.ones(len(o["step"]), bool), []))
    said = [n for n in row.notes if n.startswith(LEFT_OUT_NOTE)]
    assert straggler in row.missing_ranks and len(said) == 2, row.notes
    assert f"rank(s) {straggler}: every step" in said[0], said
    assert f"rank(s) {peer} of DP replica(s) 1" in said[1], said
    assert _left_out(tmp_path, row) == ["; ".join(said)]


def test_replica_peers_of_a_rank_that_sent_nothing_are_named(tmp_path):
    trace = slow_job(steps=5, dp=2, pp=2)
    o = trace.ops
    lost, peer = rank_of(trace, 0, 1), rank_of(trace, 0, 0)
    row, _ = analyse_window(_window(trace, o["rank"] != lost, [lost]))
    assert row.error is None and row.missing_ranks == [lost]
    said = [n for n in row.notes if n.startswith(LEFT_OUT_NOTE)]
    assert len(said) == 1 and f"rank(s) {peer} of DP replica(s) 0" in said[0], row.notes
    assert len(_left_out(tmp_path, row)) == 1
