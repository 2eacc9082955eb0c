"""Analysing a subset of steps names the same workers, ranks and microbatches as the whole."""

from __future__ import annotations

import numpy as np

import stragglers as st


def test_a_step_subset_names_the_slow_workers_global_rank():
    trace = st.synth(dp=4, pp=2, microbatches=4, steps=12, seed=3, slow_worker=(2, 1, 2.0))
    ops = trace.ops
    true_rank = int(np.unique(ops["rank"][(ops["dp_rank"] == 2) & (ops["stage"] == 1)])[0])
    for steps in (None, "all", [6, 7, 8, 9, 10, 11]):
        top = st.analyze(trace, steps=steps).diagnosis[0]
        assert top.cause == "worker_fault", (steps, top)
        assert top.where.ranks == [true_rank], (steps, top.where)
        assert f"rank {true_rank}" in top.evidence or top.where.workers[0].rank == true_rank
