"""Idealised (straggler-free) op costs, docs/whatif.md §6: mean for compute, median transfer for comm,
each taken over the ops of the same identity (the same kind of work), not the same op type."""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import (BLOCKING_COLLECTIVES, COMPUTE_OPTYPES, OPTYPE_CODES,
                                    OPTYPES, P2P_OPTYPES)
from stragglers.whatif.grid import GC, OpGrid

_COMPUTE = {OPTYPE_CODES[o] for o in COMPUTE_OPTYPES}
_P2P = {OPTYPE_CODES[o] for o in P2P_OPTYPES}
_BLOCKING = [OPTYPE_CODES[o] for o in BLOCKING_COLLECTIVES]


def identities(grid: OpGrid) -> np.ndarray:
    """[N] identity of every template op: ops of one identity do the same work.

    An op type is one identity where its ops are alike: one gradient collective per step
    (NDTimeline), microbatches of a pipeline or of gradient accumulation, a pipeline's sends.
    It lumps unlike work in two cases, and there the op's index in its step joins the key:
    collectives of which a worker runs several per step (DDP's buckets of very different
    sizes, a model's several all-to-alls), and compute cut into pieces by blocking
    collectives (the work between two all-to-alls is not the work between the next two; a
    profiler trace's backward cut at DDP's bucket all-reduces, `grid.compute_by_index`).
    The stage is not part of the key: stage imbalance counts as straggling (docs/whatif.md §6).
    """
    code = grid.node_optype.astype(np.int64)
    seq = grid.node_seq.astype(np.int64)
    several = np.zeros(len(code), dtype=bool)
    for c in np.unique(code):
        if c in _COMPUTE or c in _P2P:
            continue
        nodes = code == c
        several[nodes] = seq[nodes].max() > 0
    work = np.isin(code, [c for c in _COMPUTE if c != GC])
    blocked_stages = np.unique(grid.node_stage[np.isin(code, _BLOCKING)])
    pieces = work & (np.isin(grid.node_stage, blocked_stages) | grid.compute_by_index)
    return np.where(several | pieces, code * (1 << 24) + seq + 1, code * (1 << 24))


def ideal_costs(grid: OpGrid, cost: np.ndarray, no_op: np.ndarray | None = None,
                left_out: np.ndarray | None = None) -> tuple[np.ndarray, dict[str, float]]:
    """One cost per template op ([N, 1, 1]) and the per-optype ideal values.

    The per-optype value is the mean of its identities' ideals over the op type's nodes (what
    reports show); p2p no-ops (recorded, never launched) cost nothing and do not count in the
    statistics, nor do the cells of `left_out` (bool [N, D]: computes whose stated durations
    cannot be their worker's work, metrics.unexplained) while any other cell of the identity
    is left.
    """
    no_op = np.zeros(len(grid.node_optype), bool) if no_op is None else no_op
    ideal = np.zeros((len(grid.node_optype), 1, 1))
    ident = identities(grid)
    # A compute op most replica-steps lack (a spurious row of one rank, a run some traces cut
    # once more) is not a slot of its kind's work: spread into it, the work of the slots every
    # worker runs went short (a 0.1 ms forward row after one rank's optimizer took a fifth of
    # every forward's ideal: a straggler's S 1.60 → 1.76). It keeps its own cells' mean. GC
    # pauses are rare by nature: every slot of theirs counts.
    work = np.isin(grid.node_optype, [c for c in _COMPUTE if c != GC])
    rare = work & ~grid.held()
    ident = np.where(rare, -1 - np.arange(len(ident)), ident)
    for key in np.unique(ident):
        nodes = (ident == key) & ~no_op
        if not nodes.any():
            continue
        code = int(grid.node_optype[nodes][0])
        sample = cost[nodes]
        if code == GC or code in _COMPUTE:
            # Every slot counts (zero where no pause happened, or where a worker's trace has
            # no such compute run): the same total time, spread evenly, is what a perfectly
            # balanced job would see.
            if left_out is not None and left_out[nodes].any() and not left_out[nodes].all():
                sample = sample[~left_out[nodes]]       # [cells, T]: every step of the others
            v = float(sample.mean())
        else:
            present = grid.present[nodes]
            if not present.any():
                continue
            v = float(np.median(sample[present]))
        ideal[nodes] = v
    values: dict[str, float] = {}
    for code in np.unique(grid.node_optype):
        nodes = (grid.node_optype == code) & ~no_op
        if nodes.any():
            values[OPTYPES[code]] = float(ideal[nodes].mean())
    return ideal, values  # no-op nodes keep 0
