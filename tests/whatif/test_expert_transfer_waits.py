"""Expert imbalance on ranks sharing their host's cores: the all-to-alls' transfers there mostly
wait for a core (their gloo threads' run delay, `cpu_wait` on the rows), which the prediction
keeps at the skewed steps' value; balanced, they wait longer, which the skewed steps do not show
(whatif/README.md, limitations). The finding says so, with the trace's own share, as the reason
its gain is an upper bound beyond perfect routing.

Recorded run: `examples/train_moe.py --alternate`, 4 gloo ranks on a quiet 2-core machine
(tests/data/recorded/README.md); its skewed (even) steps are analysed.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np

from stragglers.trace.load import load_trace
from stragglers.trace.model import OPTYPE_CODES
from stragglers.whatif.causes.base import Context
from stragglers.whatif.causes.experts import expert_imbalance
from stragglers.whatif.config import DiagnosisConfig
from stragglers.whatif.grid import build_grid
from stragglers.whatif.metrics import WhatIf

RUN = Path(__file__).resolve().parents[1] / "data" / "recorded" / "moe-alternating-routing-quiet-1"
CLAUSE = "all-to-alls' transfers waited for a core"


def _context(trace) -> Context:
    skewed = sorted(int(s) for s in set(trace.ops["step"].tolist()) if s >= 2 and s % 2 == 0)
    return Context.build(WhatIf.build(build_grid(trace, skewed)), trace, DiagnosisConfig())


def test_the_finding_gives_the_transfers_waits_for_a_core_as_its_bound():
    trace = load_trace(RUN)
    ctx = _context(trace)
    (finding,) = expert_imbalance(ctx)
    # the share read off the op table: every all-to-all row's run delay, at most its transfer
    g = ctx.w.grid
    nodes = np.flatnonzero(g.node_optype == OPTYPE_CODES["all-to-all"])
    transfer = ctx.w.cost[nodes]
    wait = np.minimum(trace.ops["cpu_wait"][g.row[nodes]].astype(np.float64), transfer)
    share = float(wait.sum() / transfer.sum())
    assert 0 < share < 1
    assert f"{CLAUSE} {100 * share:.0f}% of their time" in finding.evidence, finding.evidence
    assert finding.upper_bound


def test_a_core_per_rank_leaves_the_transfers_waits_unsaid():
    trace = load_trace(RUN)
    roomy = copy.copy(trace)
    roomy.meta = copy.deepcopy(trace.meta)
    for entry in roomy.meta.extra["layout"]:
        entry["cpus"] = "0-3"                     # four CPUs for four ranks: no crowded host
    (finding,) = expert_imbalance(_context(roomy))
    assert CLAUSE not in finding.evidence
