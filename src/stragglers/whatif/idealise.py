"""Idealised (straggler-free) op costs, spec §6: mean for compute, median transfer for comm."""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import COMPUTE_OPTYPES, OPTYPE_CODES, OPTYPES
from stragglers.whatif.grid import GC, OpGrid

_COMPUTE = {OPTYPE_CODES[o] for o in COMPUTE_OPTYPES}


def ideal_costs(grid: OpGrid, cost: np.ndarray, no_op: np.ndarray | None = None
                ) -> tuple[np.ndarray, dict[str, float]]:
    """One cost per template op ([N, 1, 1]) and the per-optype ideal values.

    p2p no-ops (recorded, never launched) cost nothing and do not count in the statistics.
    """
    no_op = np.zeros(len(grid.node_optype), bool) if no_op is None else no_op
    ideal = np.zeros((len(grid.node_optype), 1, 1))
    values: dict[str, float] = {}
    for code in np.unique(grid.node_optype):
        nodes = (grid.node_optype == code) & ~no_op
        if not nodes.any():
            continue
        sample = cost[nodes]
        if code == GC:
            # Every gc slot counts (zero where no pause happened): the same total pause time,
            # spread evenly, is what a perfectly balanced job would see.
            v = float(sample.mean())
        else:
            present = grid.present[nodes]
            v = float(sample[present].mean() if code in _COMPUTE else np.median(sample[present]))
        ideal[nodes] = v
        values[OPTYPES[code]] = v
    return ideal, values  # no-op nodes keep 0
