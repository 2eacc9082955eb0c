"""CPU contention: a slow-looking transfer whose lateness its own threads' waits for a CPU explain.

Recorded traces carry `cpu_wait` on communication rows: seconds the threads carrying the op
(the thread waiting for it, gloo's transport and collective threads) were runnable but had no
CPU while it ran (Linux schedstat). On an idle host those threads sleep until the bytes arrive,
so a slow link leaves the wait near 0; on a busy host they are woken and then wait for a core,
and the transfer looks slow although the network is not. A communication finding whose lateness
lies mostly within those waits is reported as `cpu_contention` instead (whatif/README.md).
A profiler trace records no waits; where its ranks compute on the CPU beside each other on one
host, `taken_beside` bounds them by the time the host's other ranks computed during a transfer
(in pieces begun while a transfer of normal length would still run, where that is given).
"""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import COMPUTE_OPTYPES, OPTYPE_CODES as C
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


def taken_beside(ctx: Context, ids: np.ndarray, length: np.ndarray | None = None
                 ) -> np.ndarray | None:
    """[len(ids), D, T] s: the most each transfer can have waited for a CPU that its host's
    other ranks held, as far as a trace without recorded waits shows: the time during it (its
    measured cost, up to its end) that those ranks computed in the analysed steps, at most its
    own length (one core shared: while another rank computes, the transfer's threads do not
    run; more cores, less); with `length` (s, broadcast to [len(ids), D, T]) only compute
    begun within the first `length` s of the transfer. None where the trace records the waits
    (`cpu_wait`), times compute on GPUs (a kernel holds no CPU), or places no two of its ranks
    on one host."""
    if ctx.cpu_waits is not None or not _computes_on_cpu(ctx.trace.meta.extra):
        return None
    host = _host_of(ctx)
    if not host:
        return None
    g, w = ctx.w.grid, ctx.w
    computing = np.isin(g.node_optype, [C[o] for o in COMPUTE_OPTYPES])
    busy = {}                                   # rank → (starts, ends, busy time before each)
    for (d, p), rank in np.ndenumerate(ctx.ranks):
        if int(rank) in host:
            nodes = computing & (g.node_stage == p)
            cells = g.present[nodes, d]                                   # [n, T]
            start = g.start[nodes, d][cells]
            order = np.argsort(start, kind="stable")
            start = start[order]
            end = np.maximum.accumulate(start + g.duration[nodes, d][cells][order])
            busy[int(rank)] = (start, end, np.concatenate([[0.0], np.cumsum(end - start)]))
    stage = g.node_stage[ids]
    stop = g.start[ids] + g.duration[ids]                                # [n, D, T]
    begin = stop - w.cost[ids]
    # compute that began once a transfer of normal length (`length`) would have ended found
    # it late already: on a slow link, that is the link's lateness drawing compute beside it
    by = None if length is None else begin + np.broadcast_to(length, stop.shape)
    out = np.zeros(stop.shape)
    for (d, p), rank in np.ndenumerate(ctx.ranks):
        mine = stage == p
        if int(rank) not in host or not mine.any():
            continue
        for other in (r for r in busy if r != rank and host[r] == host[int(rank)]):
            out[mine, d] += _busy_within(*busy[other], begin[mine, d], stop[mine, d],
                                         None if by is None else by[mine, d])
    return np.where(g.present[ids], np.minimum(out, w.cost[ids]), 0.0)


def _busy_within(start: np.ndarray, end: np.ndarray, before: np.ndarray, a: np.ndarray,
                 b: np.ndarray, by: np.ndarray | None = None) -> np.ndarray:
    """Seconds of the intervals (sorted starts, ends made non-decreasing; `before`: their
    cumulative lengths) that fall within [a, b], elementwise, of those begun before `by` (all
    where None); overlaps within one worker's compute (none by construction) would count
    twice."""
    def upto(t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(start, t, side="right")            # intervals started by t
        last = np.maximum(i - 1, 0)
        inside = np.where(i > 0, np.clip(t - start[last], 0.0, end[last] - start[last]), 0.0)
        return before[last] * (i > 0) + inside
    with np.errstate(invalid="ignore"):
        within = np.maximum(upto(b) - upto(a), 0.0)
        if by is not None:
            # the intervals begun at `by` or later (all ended before the next begins): their
            # time up to b, counted from the first one's start
            j = np.searchsorted(start, np.maximum(by, a), side="left")
            first = start[np.minimum(j, len(start) - 1)] if len(start) else by
            late = np.where((j < len(start)) & (first < b),
                            upto(b) - before[np.minimum(j, len(before) - 1)], 0.0)
            within = np.maximum(within - np.maximum(late, 0.0), 0.0)
        return np.nan_to_num(within)


def _computes_on_cpu(extra: dict) -> bool:
    """Whether the trace says its ranks compute on the CPU (a profiler trace without GPU rows;
    our recorder timing CPU work)."""
    recorder = extra.get("recorder")
    return extra.get("compute_from") == "cpu ops" or (
        isinstance(recorder, dict) and recorder.get("timer") not in (None, "cuda-events"))


def _host_of(ctx: Context) -> dict[int, str]:
    """Global rank → host, for the ranks that share their host with another of the job's
    ranks: from the layout, or from a profiler trace's clock alignment (ranks whose trace
    names one host share its clock)."""
    hosts = dict(ctx.hosts)
    for rank, q in (ctx.trace.meta.extra.get("clock_alignment") or {}).items():
        if isinstance(q, dict) and isinstance(q.get("host"), str) and str(rank).isdigit() \
                and type(q.get("same_host_as")) is int:
            hosts.setdefault(int(rank), q["host"])
            hosts.setdefault(q["same_host_as"], q["host"])
    ranks = {int(r) for r in ctx.ranks.ravel() if r >= 0}
    count: dict[str, int] = {}
    for r in ranks & hosts.keys():
        count[hosts[r]] = count.get(hosts[r], 0) + 1
    return {r: hosts[r] for r in ranks & hosts.keys() if count[hosts[r]] > 1}
