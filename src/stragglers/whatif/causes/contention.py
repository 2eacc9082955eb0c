"""CPU contention: a slow-looking transfer whose lateness its own threads' waits for a CPU explain.

Recorded traces carry `cpu_wait` on communication rows: seconds the threads carrying the op
(the thread waiting for it, gloo's transport and collective threads) were runnable but had no
CPU while it ran (Linux schedstat). On an idle host those threads sleep until the bytes arrive,
so a slow link leaves the wait near 0; on a busy host they are woken and then wait for a core,
and the transfer looks slow although the network is not. A communication finding whose lateness
lies mostly within those waits is reported as `cpu_contention` instead (whatif/README.md).
"""

from __future__ import annotations

import numpy as np

from stragglers.whatif.causes.base import Candidate, Context


def cpu_wait(ctx: Context) -> np.ndarray | None:
    """[N, D, T] s the threads at both ends of each transfer waited for a CPU during it (0 where
    not measured); None if the trace measured none."""
    col = ctx.trace.ops.get("cpu_wait")
    if col is None or not np.isfinite(col).any():
        return None
    rows = ctx.w.grid.row                                            # [N, D, T], -1 where absent
    vals = np.nan_to_num(np.where(rows >= 0, col[np.maximum(rows, 0)], np.nan), nan=0.0)
    # A transfer is late when either end's threads wait: a send and its receive (one comm
    # group of one DP rank) each get the waits of both ends.
    model = ctx.w.model
    out = vals.copy()
    for members, dp_sync in zip(model.groups, model.group_dp_sync):
        if len(members) > 1 and not dp_sync:
            out[members] = vals[members].sum(axis=0)
    return out


def as_contention(ctx: Context, cand: Candidate, ids: np.ndarray, late: np.ndarray,
                  instead_of: str) -> Candidate:
    """`cand`, re-labelled cpu_contention when its ops' CPU waits hold at least
    `contention_explains` of their lateness `late` ([len(ids), D, T] s, 0 outside the finding);
    the evidence gives the waits either way."""
    waits = ctx.cpu_waits
    total = float(late.sum())
    if waits is None or total <= 0:
        return cand
    waited = np.where(late > 0, waits[ids], 0.0)
    share = float(np.minimum(late, waited).sum()) / total
    per_step = float(waited.sum()) / max(ctx.steps, 1)
    cand.evidence += (f"; the threads carrying these transfers waited {1e3 * per_step:.1f} ms "
                      "per step for a CPU during them (runnable, not running: Linux schedstat), "
                      f"{100 * share:.0f}% of their lateness")
    if share >= ctx.cfg.contention_explains:
        hosts = cand.where.hosts
        on = (f"host {hosts[0]} is" if len(hosts) == 1 else f"hosts {', '.join(hosts)} are") \
            if hosts else "hosts are"
        cand.evidence += (f": the {on} too busy to run them promptly (more busy threads than "
                          f"cores), so this is CPU contention, not {instead_of}")
        cand.cause = "cpu_contention"
    return cand
