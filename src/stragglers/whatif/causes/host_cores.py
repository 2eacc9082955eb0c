"""Ranks that outnumber their host's CPUs: how long a compute piece waits for a core, by how
many of its host's other ranks compute beside it, fitted from the run's own pieces.

Our recorder on CPU gives each compute piece between two collectives its run delay (`cpu_wait`:
runnable without a core), its CPU time (`cpu_time`), and the layout each rank's host and CPU
affinity (`cpus`). Where a host's ranks outnumber the CPUs they may use together, a piece waits
longer when more of them compute at once: a hot expert's rank computes alone while the others
wait at the combine, but with routing balanced every rank computes its experts at the same
time. The fit: each piece's run delay per second of its CPU time (its own time, duration − run
delay, where the CPU time is not recorded; a piece that sleeps on a device waits for a core only
while it runs) = a + b × the mean number of the host's other ranks computing during it (their
compute pieces, on the trace's clock): the run delays' least squares on CPU time and CPU time ×
others, over every compute piece that recorded a run delay. A fix then gives its pieces the run
delay its replay's overlap implies (`contended`). Nothing applies on hosts with a core per rank,
nor where no piece recorded its run delay (GPUs, profiler and synthetic traces) or the run delay
is not shown to grow with the overlap (b's interval over resampled steps reaching 0: on a loaded
host the waits follow its other work too), nor to pipelines (one stage only: a worker per DP
rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stragglers.trace.model import OPTYPE_CODES as C
from stragglers.trace.runformat import crowded
from stragglers.whatif._replay import replay
from stragglers.whatif.confidence import Bootstrap, step_resamples
from stragglers.whatif.grid import BWD, BWW, FWD

_COMPUTE = (FWD, BWD, BWW, C["optimizer"])


@dataclass
class Contention:
    """Run delay per second of CPU time = base + per_rank × others computing beside a piece."""

    host: np.ndarray       # [D] host group of each DP rank (-1: a host with a core per rank)
    base: float            # run delay per s of CPU time with no other rank computing
    per_rank: float        # added per other rank of the host computing at the same time
    pieces: int            # compute pieces the fit used

    def rate(self, others: np.ndarray) -> np.ndarray:
        """Run delay per second of CPU time at `others` ranks computing beside a piece."""
        return self.base + self.per_rank * others


def crowded_hosts(trace, ranks: np.ndarray) -> np.ndarray | None:
    """[D] host group of each DP rank whose host holds more ranks than CPUs (-1 elsewhere), or
    None where no host is crowded or the layout has no CPU affinities (a GPU recorder's, or
    before `cpus`). `ranks`: [D, P] global rank of each worker; one stage only (P = 1: the
    grid's D axis is then one process per DP rank, which the overlap counts)."""
    if ranks.shape[1] != 1:
        return None
    hosts = crowded(trace.meta)
    if not hosts:
        return None
    crowded_ = list(hosts)
    host_of = {rank: host for host, (members, _) in hosts.items() for rank in members}
    out = np.full(len(ranks), -1)
    for d, row in enumerate(ranks):
        host = host_of.get(int(row[0]))
        if host is not None:
            out[d] = crowded_.index(host)
    return out if (out >= 0).any() else None


def fit(g, ops, host: np.ndarray, cfg: Bootstrap, most: float | None = None
        ) -> Contention | None:
    """The run delay's fit over the compute pieces of crowded hosts' ranks (None: no piece
    recorded one, or its rise with the ranks computing beside a piece is not established: the
    lower end of its interval over steps, `cfg`, at or below 0); the rise at most `most`
    (`rise_bound`)."""
    if "cpu_wait" not in ops:
        return None
    nodes = np.flatnonzero(np.isin(g.node_optype, _COMPUTE))
    dur = g.duration[nodes]                                                 # [K, D, T]
    wait = np.minimum(_column(g, ops, "cpu_wait", nodes), dur)
    others = overlap(g.start[nodes], dur, g.start[nodes], dur, host)
    use = np.isfinite(wait) & np.isfinite(others) & (host >= 0)[None, :, None] & (dur > 0)
    if use.sum() < 3:
        return None
    busy = np.where(use, cpu_share(g, ops, nodes, dur - wait) * (dur - wait), 0.0)
    x = np.stack([busy, busy * np.where(use, others, 0.0)])                 # [2, K, D, T]
    y = np.where(use, wait, 0.0)
    # each step's sums of the least squares (x'x, x'y): a fit over any resample of the steps
    xx = np.einsum("ikdt,jkdt->tij", x, x)                                  # [T, 2, 2]
    xy = np.einsum("ikdt,kdt->ti", x, y)                                    # [T, 2]
    solved = _solve(xx.sum(axis=0), xy.sum(axis=0))
    if solved is None or solved[1] <= 0:
        return None
    # The waits of a loaded host follow its other work, not only the job's ranks: a piece
    # stretched by other processes' load overlaps more of its peers' pieces too. Over steps
    # (which meet different loads) the rise must hold, as a gain's must: 4 ranks of one job
    # on 2 cores at load 9-12 fitted +1.05, +0.33, and none (slope ≤ 0) in runs a minute
    # apart, and the +1.05 predicted ×1.04 for balanced routing where the rows alone gave ×1.19
    idx = step_resamples(xx.shape[0], cfg)
    rises = [r[1] for r in (_solve(xx[i].sum(axis=0), xy[i].sum(axis=0)) for i in idx)
             if r is not None]
    tail = 100 * (1 - cfg.confidence) / 2
    if not rises or float(np.percentile(rises, tail)) <= 0:
        return None
    base, per_rank = solved
    if most is not None and per_rank > most:
        # a fit above what fair sharing allows took the host's other load for the ranks'
        # (pieces a busy host stretches overlap more of their peers): 4 single-thread ranks
        # on 2 cores beside 4 CPU hogs fitted +1.05 per rank, where a rank can add 0.5; the
        # base is fitted again under the bound (the least squares with the rise held)
        xx_all, xy_all = xx.sum(axis=0), xy.sum(axis=0)
        per_rank = most
        base = float((xy_all[0] - most * xx_all[0, 1]) / xx_all[0, 0])
    return Contention(host, max(float(base), 0.0), float(per_rank), int(use.sum()))


def rise_bound(trace) -> float | None:
    """The most a rank computing beside a piece can add to its run delay per s of CPU time:
    its compute threads (the layout's `threads`) over its host's CPUs, the largest over the
    crowded hosts (a fair scheduler gives R runnable threads on C CPUs a run delay of R/C − 1
    per s on a CPU: each thread more adds 1/C); None where a crowded rank's threads are not in
    the layout (recorded before it kept them)."""
    threads = {e.get("rank"): e.get("threads") for e in trace.meta.extra.get("layout") or []
               if isinstance(e, dict)}
    bounds = []
    for ranks, cpus in crowded(trace.meta).values():
        counts = [c for c in (threads.get(r) for r in ranks) if isinstance(c, int) and c >= 1]
        if len(counts) < len(ranks):
            return None
        bounds.append(max(counts) / cpus)
    return max(bounds) if bounds else None


def _solve(xx: np.ndarray, xy: np.ndarray) -> tuple[float, float] | None:
    """(base, per_rank) of the 2-column least squares from its sums (None: singular)."""
    if abs(float(np.linalg.det(xx))) <= 1e-12 * max(float(np.abs(xx).max()), 1e-300) ** 2:
        return None
    base, per_rank = np.linalg.solve(xx, xy)
    return float(base), float(per_rank)


def cpu_share(g, ops, nodes, own: np.ndarray) -> np.ndarray:
    """[K, D, T] the share of each piece's own time (duration − run delay) it ran on a CPU
    (`cpu_time`; 1 where not recorded: on a CPU all its own time)."""
    cpu = _column(g, ops, "cpu_time", nodes) if "cpu_time" in ops else np.full(own.shape, np.nan)
    with np.errstate(invalid="ignore", divide="ignore"):
        share = np.clip(cpu / own, 0, 1)
    return np.where(np.isfinite(share), share, 1.0)


def _column(g, ops, name: str, nodes) -> np.ndarray:
    """[K, D, T] the op table's column `name` at the grid's cells of `nodes` (NaN: none)."""
    cells = g.row[nodes]
    return np.where(cells >= 0, ops[name][np.maximum(cells, 0)].astype(np.float64), np.nan)


def overlap(start: np.ndarray, dur: np.ndarray, all_start: np.ndarray, all_dur: np.ndarray,
            host: np.ndarray) -> np.ndarray:
    """[K, D, T] the mean number of the host's other ranks computing during each piece
    (`start`/`dur` [K, D, T]) of the compute pieces `all_start`/`all_dur` [M, D, T], step by
    step (NaN for ranks of hosts with a core per rank, or pieces without a time)."""
    out = np.full(start.shape, np.nan)
    end, all_end = start + dur, all_start + all_dur
    for h in np.unique(host[host >= 0]):
        ranks = np.flatnonzero(host == h)
        for t in range(start.shape[2]):
            a, b = start[:, ranks, t], end[:, ranks, t]                     # [K, R]
            shared = np.zeros(a.shape)
            # each other rank's busy time between a piece's start and end, read off that
            # rank's cumulative busy time (memory [K, R], not every pair of pieces: a CPU job
            # of 64 ranks per host and 500 pieces would need 8 GB for the pairs)
            for j, q in enumerate(ranks):
                busy = _busy_until(all_start[:, q, t], all_end[:, q, t])
                if busy is None:
                    continue
                got = np.interp(b, *busy) - np.interp(a, *busy)
                got[:, j] = 0                                               # not its own rank
                shared += np.nan_to_num(got)
            length = b - a
            with np.errstate(invalid="ignore", divide="ignore"):
                out[:, ranks, t] = np.where(length > 0, shared / length, 0.0)
    return out


def _busy_until(start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(x, busy): a rank's time computing before x, at the corners of its pieces [start, end)
    (None: no piece with a time), for np.interp; pieces that overlap count once."""
    ok = np.isfinite(start) & np.isfinite(end) & (end > start)
    if not ok.any():
        return None
    order = np.argsort(start[ok], kind="stable")
    s, e = start[ok][order], np.maximum.accumulate(end[ok][order])
    first = np.flatnonzero(np.r_[True, s[1:] > e[:-1]])                    # merged pieces
    s, e = s[first], np.maximum.reduceat(e, first)
    done = np.cumsum(e - s)
    x = np.column_stack([s, e]).ravel()
    busy = np.column_stack([done - (e - s), done]).ravel()
    return x, busy


def contended(w, fit_: Contention, cost: np.ndarray, nodes: list[int], own: np.ndarray,
              share: np.ndarray, passes: int = 3) -> np.ndarray:
    """[N, D, T] `cost` with the pieces `nodes` given own time `own` [K, D, T] plus the run
    delay the fit gives its CPU time (`share` of it) at the overlap of the replay of `cost`
    (the overlap moves the replay: a few passes). Ranks of hosts with a core per rank keep
    their costs."""
    g = w.grid
    compute = np.flatnonzero(np.isin(g.node_optype, _COMPUTE))
    crowded = (fit_.host >= 0)[None, :, None]
    out = cost
    for _ in range(passes):
        _, begin, _ = replay(w.plan, out, w.step_start, keep_timeline=True)
        others = overlap(begin[nodes], out[nodes], begin[compute], out[compute], fit_.host)
        new = out.copy()
        new[nodes] = np.where(crowded, own * (1 + share * fit_.rate(np.nan_to_num(others))),
                              cost[nodes])
        out = new
    return out


@dataclass
class HostCpu:
    """What a step's crowded hosts' processes used of their CPUs: no step can be shorter than
    a host's CPU work over its CPUs. A fix that moves work between ranks (balanced routing)
    keeps it: on 4 ranks sharing 2 cores the processes' CPU per step was 218 ms skewed, 222 ms
    balanced."""

    work: np.ndarray       # [H, T] CPU s of each crowded host's processes in each step (NaN)
    cpus: np.ndarray       # [H] the CPUs each host's ranks may use together
    host: np.ndarray       # [D] host group of each DP rank (-1: a host with a core per rank)

    def floor(self, removed: np.ndarray | float = 0.0) -> np.ndarray:
        """[T] the shortest each step can take (`removed` [H, T]: CPU s a fix takes away)."""
        per_host = (self.work - removed) / self.cpus[:, None]
        return np.nan_to_num(np.nanmax(np.where(np.isnan(per_host), -np.inf, per_host), axis=0),
                             neginf=0.0)


def host_cpu(trace, g, ranks: np.ndarray, host: np.ndarray) -> HostCpu | None:
    """The CPU of each crowded host's processes per step (`step_cpu`: every thread's, gloo's
    included, which no op row holds), host groups as `crowded_hosts` numbers them (`host` [D]);
    None without step_cpu. A host with a rank outside the analysis is left out (NaN)."""
    if "step_cpu" not in trace.ops:
        return None
    hosts = crowded(trace.meta)
    ops = trace.ops
    # each row's DP rank and step column, looked up with arrays (a row a Python call cost
    # seconds on a trace of millions of ops)
    d_idx = _positions(ranks[:, 0], ops["rank"])
    t_idx = _positions(g.steps, ops["step"])
    keep = (d_idx >= 0) & (t_idx >= 0)
    cpu = np.full((len(ranks), len(g.steps)), np.nan)                     # [D, T]
    cpu[d_idx[keep], t_idx[keep]] = ops["step_cpu"][keep]                  # one value a step
    groups = list(hosts.values())
    work = np.full((len(groups), len(g.steps)), np.nan)
    for h, (members, _) in enumerate(groups):
        if np.sum(host == h) == len(members):
            work[h] = cpu[host == h].sum(axis=0)                           # NaN: unknown
    if np.isnan(work).all():
        return None
    return HostCpu(work, np.array([n for _, n in groups], dtype=np.float64), host)


def _positions(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The index of each value in `keys` (distinct; negative keys stand for none), -1 where
    it is not there."""
    keys = np.asarray(keys, dtype=np.int64)
    order = np.argsort(keys, kind="stable")
    sorted_keys = keys[order]
    at = np.minimum(np.searchsorted(sorted_keys, values), len(keys) - 1)
    found = (sorted_keys[at] == values) & (sorted_keys[at] >= 0) if len(keys) else \
        np.zeros(len(values), dtype=bool)
    return np.where(found, order[at] if len(keys) else -1, -1)


def at_least(w, cost: np.ndarray, floor: np.ndarray, passes: int = 3) -> np.ndarray:
    """[N, D, T] `cost` with each step made to last at least floor[t]: where the replay is
    shorter, every rank's last compute piece of the step takes the shortfall (the host's CPUs
    owe that work; where in the step it falls does not change the step's length)."""
    g = w.grid
    compute = np.flatnonzero(np.isin(g.node_optype, _COMPUTE))
    if not len(compute):
        return cost
    out = cost
    for _ in range(passes):
        times, _, ends = replay(w.plan, out, w.step_start, keep_timeline=True)
        short = np.maximum(floor - times, 0)
        if not (short > 1e-9).any():
            break
        end = ends[compute]                                                 # [K, D, T]
        last = compute[np.argmax(np.nan_to_num(end, nan=-np.inf), axis=0)]  # [D, T]
        out = out.copy()
        d, t = np.indices(last.shape)
        out[last, d, t] += short[None, :]
    return out
