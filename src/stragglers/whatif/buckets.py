"""Dependencies taken from what every replica's recorded order agrees on: DDP and FSDP2 bucket producers.

The dependency model (dependencies.py) builds its edges from one replica-step per stage
(`reference_cells`: the first DP rank's first step where most replica-steps share its order).
For gradient collectives launched while backward still runs (DDP buckets, FSDP2 per-unit
reduce-scatters) it links each to the last compute op that ended before it started. On a
healthy rank whose collectives queue behind one that waits for a slow peer, that is a much
later compute op than the one that produced the bucket, and on the slow rank the edge then
points forward in time (a negative launch delay, clamped, so the replay runs late). The
producer that holds on every replica is the last compute op that ends before the collective
starts on every DP rank in every step: `bucket_producers`.
"""

from __future__ import annotations

import numpy as np

_EPS = 5e-5  # seconds of clock error tolerated (as in dependencies.py)


def bucket_producers(grid, grads: list[int], comp: list[int], eps: float = _EPS
                     ) -> dict[int, int]:
    """For each gradient collective, the last compute op (in `comp`'s chain order) that ends
    before it starts on every DP rank and step where both were recorded; none if no op does."""
    if not grads or not comp:
        return {}
    c = np.asarray(comp)
    ends = grid.start[c] + grid.duration[c]                   # [C, D, T]
    c_present = grid.present[c]
    out: dict[int, int] = {}
    for g in grads:
        g_start, g_present = grid.start[g], grid.present[g]   # [D, T]
        both = c_present & g_present[None]
        ok = np.where(both, ends <= g_start[None] + eps, True).all(axis=(1, 2))
        ok &= both.any(axis=(1, 2))
        # compute runs in chain order: producers are a prefix; take its last op
        first_bad = int(np.argmin(ok)) if not ok.all() else len(ok)
        if first_bad > 0:
            out[int(g)] = int(c[first_bad - 1])
    return out
