"""Expert load imbalance in MoE training: the rank holding a hot expert computes longest.

A mixture-of-experts layer sends each token to its experts with an all-to-all (the dispatch),
runs the experts, and sends the results back (the combine). The rows a rank receives at the
dispatch are its experts' load, which the trace carries in the all-to-all's `tokens` column
(our recorder from the split sizes, the Kineto reader from `Out split size`); the rows it
sent are in the optional `sent` column. When routing favours some experts, the ranks holding
them receive more rows, their expert compute takes longer, and every rank of the
expert-parallel group waits at the combine; the all-to-alls also move more rows through the
busiest rank (it receives the dispatch and sends the combine, and backward the same again).

Found when the compute right after a dispatch follows the rows received across the group's
ranks (a pooled linear fit per dispatch, correlation ≥ `expert_corr`) and the rows are uneven
(the busiest rank at least `expert_min_excess` above the group's mean); then every uneven
dispatch whose compute grows with the rows (slope > 0) is balanced at its own slope. Where every
piece of that compute recorded its run delay (our recorder on CPU: `cpu_wait` on the compute
between two collectives), the correlation is that of its own time (duration − run delay): how
long a piece waits for a core is the scheduler's doing (a piece shorter than a time slice often
waits nothing), not its rows'; the slope, and so the prediction, stay the durations' (but on
crowded hosts, below). The prediction gives every rank the group's mean rows at that step's time
per row (its own speed kept; `_step_slopes`: a fit on each step's shares of rows and time, as
the load a step meets scales every rank's time per row in it), and every all-to-all its transfer
at balanced volume: each rank's transfer (from the group's last arrival to its end) is fitted
against the rows it moved (received, plus sent where the trace has them; pooled over the
all-to-alls across the ranks, each one's step mean taken out: seconds per row moved), and each
rank's rows moved go to its group's mean at that slope; the replay makes the group wait for its
slowest member. An early rank exchanges rows with the other early ranks while it waits for the
hot one, so its measured transfer lacks those pieces; where the balanced replay shortens its
wait, the pieces that no longer fit in it are added back (the last arriver's transfer, which
holds them all, less the rank's own, at most its measured
wait). Where ranks outnumber their host's CPUs (the layout's `cpus`) and the expert pieces
recorded their run delay, balanced, every rank computes its experts at once, where the hot rank
computed alone: each expert piece is given its own time at balanced rows (its own time's step
slope) plus the run delay that the ranks computing beside it in the replay imply
(host_cores.py, fitted over the run's compute pieces); and no step is shorter than the CPU its
ranks' processes used in it (`step_cpu`, gloo's threads included) over the CPUs they share:
balancing moves the experts' work, it does not remove it. The all-to-alls' transfers keep their
threads' waits for a core as measured (balanced, the dispatches' grow, which the skewed steps do
not show): there the evidence gives their share. The result: the step time with routing
perfectly balanced, an upper bound. The same fits price capacity factors (rows beyond C × mean
dropped, neither computed nor moved) at the measured routing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stragglers.trace.model import OPTYPE_CODES as C
from stragglers.whatif._replay import replay
from stragglers.whatif.causes.base import Candidate, Context
from stragglers.whatif.causes.host_cores import (Contention, HostCpu, at_least, contended, cpu_share,
                                                 crowded_hosts, host_cpu, rise_bound)
from stragglers.whatif.causes.host_cores import fit as fit_contention
from stragglers.whatif.grid import BWD, BWW, FWD
from stragglers.whatif.result import CapacityOption

A2A = C["all-to-all"]
_COMPUTE = (FWD, BWD, BWW)
# Capacity factors priced in the finding (GShard/Switch use 1.0-2.0; 1.25 is the usual default).
CAPACITY_FACTORS = (1.0, 1.25, 1.5, 2.0)


@dataclass
class ExpertLoad:
    """Dispatches whose following compute follows the rows each rank received."""

    pairs: list[tuple[int, int]]   # (dispatch all-to-all node, expert compute node)
    rows: np.ndarray               # [K, D, T] rows received at each dispatch
    mean: np.ndarray               # [K, D, T] the mean rows of each rank's group that step
    slope: np.ndarray              # [K] seconds per row (the fit's, mean over ranks and steps)
    corr: np.ndarray               # [K] correlation of expert time with rows (shares of a step)
    step_slope: np.ndarray         # [K, D, T] seconds per row of each rank's group that step
    transfer: "Transfer | None" = None
    transfer_corr: float | None = None  # the transfer fit's correlation, priced or not
    host: "HostShare | None" = None     # ranks computing on host CPUs: their waits for a core


@dataclass
class HostShare:
    """Expert compute run on host CPUs (our recorder on CPU): how long its pieces waited for a
    core (their run delay), which the rows fit leaves out (`expert_load`)."""

    wait: np.ndarray               # [K, D, T] s each expert piece was runnable without a core
    share: float                   # the waits' share of the expert compute's time
    own_slope: np.ndarray          # [K, D, T] own time (duration − run delay) per row, as
                                   # step_slope: each rank's group that step
    cpu_share: np.ndarray          # [K, D, T] share of each piece's own time on a CPU
    # ranks outnumbering their host's CPUs: run delay by the ranks computing beside a piece
    contention: Contention | None = None
    # the CPU each crowded host's processes used per step: no step is shorter than that over
    # the host's CPUs
    cpu: HostCpu | None = None
    # crowded hosts: the share of the all-to-alls' transfer their threads spent runnable
    # without a core (`cpu_wait` on their rows), kept as measured by the prediction
    transfer_wait: float | None = None


@dataclass
class Transfer:
    """The all-to-alls' transfer priced by the rows each rank moves."""

    nodes: np.ndarray              # [M] all-to-all nodes with rows on every rank
    moved: np.ndarray              # [M, D, T] rows received, plus sent where recorded
    mean: np.ndarray               # [M, D, T] the mean of `moved` over each rank's group
    slope: float                   # seconds per row moved (pooled fit across ranks)
    corr: float                    # correlation of transfer with rows moved
    with_sent: bool                # whether the rows sent were in the trace


def expert_load(ctx: Context, durations: np.ndarray) -> ExpertLoad | None:
    """The dispatches with a token-driven expert compute after them, or None."""
    g, ops = ctx.w.grid, ctx.trace.ops
    if "tokens" not in ops or len(g.dp_ranks) < 2:
        return None
    pairs, rows, means, slopes, corrs, steps, own_steps = [], [], [], [], [], [], []
    for n in (int(x) for x in np.flatnonzero(g.node_optype == A2A)):
        tok = _rows_received(g, ops["tokens"], n)
        expert = _next_compute(g, n) if tok is not None else None
        if tok is None or expert is None:
            continue
        mean = _group_mean(g, n, tok)
        fit = _fit(tok, durations[expert])
        if fit is None or relative(tok, mean).max(axis=0).mean() < 1 + ctx.cfg.expert_min_excess:
            continue
        # Where the host recorded how long the piece waited for a core, the rows are judged on
        # the rest (its CPU time): the waits are the scheduler's (a piece shorter than a time
        # slice often waits nothing, a long one on a busy host most of its time). 4 ranks on 2
        # loaded cores: correlation 0.64-0.94 with the waits in, 0.90-0.99 without
        wait = _run_delay(g, ops, expert, durations)
        own_fit = _fit(tok, durations[expert] - wait) if wait is not None else None
        pairs.append((int(n), expert))
        rows.append(tok)
        means.append(mean)
        # priced step by step (`_step_slopes`): the load a step meets sets its time per row
        steps.append(_step_slopes(g, n, tok, durations[expert]))
        slopes.append(float(steps[-1].mean()))
        corrs.append(fit[1] if own_fit is None else own_fit[1])
        own_steps.append(_step_slopes(g, n, tok, durations[expert] - wait) if own_fit is not None
                         else np.zeros_like(tok))
    # Found where one dispatch's compute follows the rows at the bar. The uneven dispatches of
    # a job share its routing and its experts, so then every one whose compute grows with the
    # rows (slope > 0) is balanced at its own slope (noise in the durations scatters a fit, it
    # does not bias its slope): one that a load spike pushed below the bar does not leave its
    # expert compute unexplained, then blamed on the busiest rank as a slow worker.
    if not pairs or max(corrs) < ctx.cfg.expert_corr:
        return None
    keep = [k for k, slope in enumerate(slopes) if slope > 0]
    if not keep:
        return None
    transfer, transfer_corr = _transfer(g, ops, ctx.w.cost, ctx.cfg.expert_corr)
    pairs = [pairs[k] for k in keep]
    return ExpertLoad(pairs, np.array([rows[k] for k in keep]),
                      np.array([means[k] for k in keep]), np.array([slopes[k] for k in keep]),
                      np.array([corrs[k] for k in keep]), np.array([steps[k] for k in keep]),
                      transfer, transfer_corr,
                      _host_share(ctx, pairs, durations, np.array([own_steps[k] for k in keep])))


def _run_delay(g, ops, expert: int, durations: np.ndarray) -> np.ndarray | None:
    """[D, T] s each piece of the compute node waited for a core (at most its duration), or
    None unless every piece recorded it (our recorder on CPU, between two collectives)."""
    if "cpu_wait" not in ops:
        return None
    cells = g.row[expert]
    if (cells < 0).any():
        return None
    wait = ops["cpu_wait"][cells].astype(np.float64)
    return np.minimum(wait, durations[expert]) if np.isfinite(wait).all() else None


def _host_share(ctx: Context, pairs: list[tuple[int, int]], durations: np.ndarray,
                own_slope: np.ndarray) -> HostShare | None:
    """The expert pieces' run delays (None unless every piece recorded one: GPUs, profiler and
    synthetic traces, runs from before the recorder kept it), and where ranks outnumber their
    host's CPUs how the run delay grows with the ranks computing at once."""
    g, ops = ctx.w.grid, ctx.trace.ops
    waits = [_run_delay(g, ops, e, durations) for _, e in pairs]
    if any(w is None for w in waits):
        return None
    wait = np.array(waits)                                                 # [K, D, T]
    total = float(durations[[e for _, e in pairs]].sum())
    host = crowded_hosts(ctx.trace, ctx.ranks)
    experts = [e for _, e in pairs]
    return HostShare(wait, float(wait.sum()) / total if total > 0 else 0.0, own_slope,
                     cpu_share(g, ops, experts, durations[experts] - wait),
                     None if host is None else fit_contention(g, ops, host, ctx.cfg,
                                                                rise_bound(ctx.trace)),
                     None if host is None else host_cpu(ctx.trace, g, ctx.ranks, host),
                     None if host is None else _transfer_wait(g, ops, ctx.w.cost, host))


def _transfer_wait(g, ops, cost: np.ndarray, host: np.ndarray) -> float | None:
    """The share of the all-to-alls' transfer (end − the group's last arrival) on crowded
    hosts' ranks (`host` ≥ 0) that their threads spent runnable without a core: each row's
    `cpu_wait` (gloo's transport threads, over the whole op) at most its transfer. None where
    a row has none (recorded before the recorder kept it) or nothing was transferred."""
    if "cpu_wait" not in ops:
        return None
    nodes = np.flatnonzero(g.node_optype == A2A)
    cells = g.row[nodes][:, host >= 0]                                     # [M, D', T]
    if not len(nodes) or (cells < 0).any():
        return None
    transfer = cost[nodes][:, host >= 0]
    wait = ops["cpu_wait"][cells].astype(np.float64)
    if not np.isfinite(wait).all() or transfer.sum() <= 0:
        return None
    return float(np.minimum(wait, transfer).sum() / transfer.sum())


def _transfer(g, ops, cost: np.ndarray, min_corr: float
              ) -> tuple[Transfer | None, float | None]:
    """The all-to-alls' transfer per row moved (None: their transfer does not follow the rows
    moved, slope > 0 and correlation ≥ `min_corr`, the bar the expert compute meets), and the
    fit's correlation (None: no fit)."""
    sent_col = ops["sent"] if "sent" in ops else None
    nodes, moved, means, xs, ys = [], [], [], [], []
    for n in (int(x) for x in np.flatnonzero(g.node_optype == A2A)):
        tok = _rows_received(g, ops["tokens"], n)
        if tok is None:
            continue
        if sent_col is not None:
            sent = _rows_received(g, sent_col, n)
            if sent is None:  # rows sent unknown at this all-to-all: it is not priced
                continue
            tok = tok + sent
        nodes.append(n)
        moved.append(tok)
        means.append(_group_mean(g, n, tok))
        # each step's mean over the ranks taken out: what differs is how many rows each moved
        xs.append((tok - tok.mean(axis=0, keepdims=True)).ravel())
        c = cost[n]
        ys.append((c - c.mean(axis=0, keepdims=True)).ravel())
    if not nodes:
        return None, None
    x, y = np.concatenate(xs), np.concatenate(ys)
    if np.std(x) == 0 or np.std(y) == 0:
        return None, None
    slope, corr = float(np.dot(x, y) / np.dot(x, x)), float(np.corrcoef(x, y)[0, 1])
    if slope <= 0 or corr < min_corr:
        return None, corr
    return Transfer(np.array(nodes), np.array(moved), np.array(means), slope, corr,
                    sent_col is not None), corr


def balanced_costs(load: ExpertLoad, durations: np.ndarray, cap: float | None = None
                   ) -> np.ndarray:
    """[N, D, T] durations with each rank's rows at its group's mean (`cap`: rows beyond
    cap × mean dropped instead, a capacity factor)."""
    out = durations.copy()
    for k, (_, expert) in enumerate(load.pairs):
        target = load.mean[k] if cap is None else np.minimum(load.rows[k], cap * load.mean[k])
        out[expert] = np.maximum(durations[expert] - load.step_slope[k] * (load.rows[k] - target),
                                 0)
    return out


def balanced_own(load: ExpertLoad, durations: np.ndarray, cap: float | None = None
                 ) -> np.ndarray:
    """[K, D, T] the expert pieces' own time (duration − run delay) with each rank's rows at its
    group's mean (`cap`: beyond cap × mean dropped), at the own-time fit's slope."""
    host = load.host
    assert host is not None
    experts = [e for _, e in load.pairs]
    target = load.mean if cap is None else np.minimum(load.rows, cap * load.mean)
    own = durations[experts] - host.wait
    return np.maximum(own - host.own_slope * (load.rows - target), 0)


def balanced(w, load: ExpertLoad, cap: float | None = None) -> np.ndarray:
    """[N, D, T] costs with routing balanced (`cap`: a capacity factor instead): expert
    compute and all-to-all transfer at balanced rows, and where ranks outnumber their host's
    CPUs the expert pieces' run delay at the ranks computing beside them in the replay (in
    the skewed steps the hot rank computes alone while the others wait; balanced, all at once)."""
    cost = balanced_transfer(load, balanced_costs(load, w.cost, cap), cap)
    host = load.host
    if host is not None and host.contention is not None:
        cost = contended(w, host.contention, cost, [e for _, e in load.pairs],
                         balanced_own(load, w.cost, cap), host.cpu_share)
    cost = exposed_exchange(w, cost)
    if host is not None and host.cpu is not None:
        # balancing moves the experts' CPU work between the host's ranks, it does not remove
        # it: no step can be shorter than its processes' CPU over their CPUs (less the rows
        # a capacity factor drops)
        # (never past the step measured: a floor above it says the CPU was counted outside
        # the step, not that balancing would slow it)
        floor = np.minimum(host.cpu.floor(_dropped_cpu(load, cap)), w.t_base)
        cost = at_least(w, cost, floor)
    return cost


def _dropped_cpu(load: ExpertLoad, cap: float | None) -> np.ndarray | float:
    """[H, T] the CPU s each crowded host no longer spends in a step on the rows a capacity
    factor drops (0 with routing balanced: no row is dropped)."""
    host = load.host
    if cap is None or host is None or host.cpu is None:
        return 0.0
    dropped = np.maximum(load.rows - cap * load.mean, 0)                   # [K, D, T]
    cpu = (host.own_slope * dropped * host.cpu_share).sum(axis=0)                  # [D, T]
    return np.stack([cpu[host.cpu.host == h].sum(axis=0) for h in range(len(host.cpu.cpus))])


def balanced_transfer(load: ExpertLoad, cost: np.ndarray, cap: float | None = None
                      ) -> np.ndarray:
    """[N, D, T] costs with each all-to-all's transfer at balanced volume: each rank's moved
    rows at its group's mean, at the fitted time per row (`cap`: rows beyond cap × mean
    dropped instead). The replay then makes the group wait for its slowest member, as the
    measured transfer did for the busiest one."""
    t = load.transfer
    if t is None:
        return cost
    out = cost.copy()
    for k, n in enumerate(t.nodes):
        target = t.mean[k] if cap is None else np.minimum(t.moved[k], cap * t.mean[k])
        out[n] = np.maximum(cost[n] - t.slope * (t.moved[k] - target), 0)
    return out


def exposed_exchange(w, cost: np.ndarray, passes: int = 2) -> np.ndarray:
    """[N, D, T] costs with each all-to-all's exchange that hid behind a rank's wait exposed
    where the replay of `cost` shortens that wait.

    An all-to-all rank that arrives early exchanges its rows with the other early ranks while
    it waits for the late one, so its measured transfer (from the group's last arrival) holds
    only the rest; the last arriver did its whole exchange after arriving. A rank's hidden part
    is the last arriver's transfer less its own, at most its measured wait; where the replay
    leaves it a shorter wait, the part that no longer fits in the wait is added back.
    """
    g = w.grid
    nodes = [int(n) for n in np.flatnonzero(g.node_optype == A2A)]
    if not nodes:
        return cost
    start = g.start[nodes]                                                  # [M, D, T]
    last = np.stack([_group_max(g, n, start[k]) for k, n in enumerate(nodes)])
    measured_wait = last - start
    # the transfer of each group's last arriver, on every rank of the group
    arrived_last = start >= last
    full = np.stack([_group_max(g, n, np.where(arrived_last[k], cost[n], -np.inf))
                     for k, n in enumerate(nodes)])
    hidden = np.clip(full - cost[nodes], 0, measured_wait)
    out = cost
    for _ in range(passes):  # the exposed exchanges move later arrivals a little: once more
        _, begin, _ = replay(w.plan, out, w.step_start, keep_timeline=True)
        arrive = begin[nodes]
        wait = np.stack([_group_max(g, n, arrive[k]) for k, n in enumerate(nodes)]) - arrive
        out = cost.copy()
        out[nodes] = cost[nodes] + np.maximum(hidden - wait, 0)
    return out


def _group_max(g, n: int, values: np.ndarray) -> np.ndarray:
    """[D, T] the max of values over each rank's process group at node n."""
    return _over_groups(g, n, values, np.max)


def expert_imbalance(ctx: Context) -> list[Candidate]:
    """MoE expert-parallel groups whose ranks receive uneven rows and compute accordingly."""
    w = ctx.w
    load = ctx.expert_load
    if load is None:
        return []
    rel = relative(load.rows, load.mean).mean(axis=(0, 2))               # [D]
    hot = [d for d in np.argsort(-rel) if rel[d] >= 1 + ctx.cfg.expert_min_excess]
    stages = {int(w.grid.node_stage[n]) for n, _ in load.pairs}
    workers = [(int(d), p) for d in hot for p in sorted(stages)]
    cost = balanced(w, load)
    base = w.mean_step_time(w.cost)
    capacity = {}
    for cap in CAPACITY_FACTORS:
        t = w.mean_step_time(balanced(w, load, cap))
        dropped = float(np.maximum(load.rows - cap * load.mean, 0).sum() / load.rows.sum())
        capacity[f"{cap:g}"] = CapacityOption(base / t if t > 0 else 1.0, dropped)
    shown = ", ".join(f"{ctx.name(d, p)} {rel[d]:.2f}×" for d, p in workers[:6])
    priced = "; ".join(f"C={c}: ×{v.speedup:.2f}, {100 * v.dropped:.1f}% of rows dropped"
                       for c, v in capacity.items())
    evidence = (f"the compute after {len(load.pairs)} all-to-all dispatch(es) follows the rows "
                f"each rank receives (correlation {float(load.corr.mean()):.2f}, "
                f"{1e6 * float(load.slope.mean()):.2f} µs per row); ranks holding hot experts "
                f"receive more than their group's mean: {shown}; the prediction balances the "
                f"rows across each expert-parallel group{_transfer_text(load, ctx.cfg.expert_corr)}, and "
                f"gives the early ranks back the all-to-all exchange they did while waiting for "
                f"the late one{_host_text(load)} (an "
                f"upper bound: what perfect routing, or an auxiliary load-balancing loss at its "
                f"best, buys); capacity factors at the measured routing: {priced}")
    # established like sequence_imbalance: the pattern test (compute follows the rows across
    # the group's ranks, step by step) tells routing from noise, which follows no rows; the
    # bootstrap over ten steps of 4 ranks beside CPU hogs put a ×1.07 gain's lower end at
    # 1.017 (noise floor S = 1.68) and the hot expert went unnamed
    return [Candidate("expert_imbalance", ctx.where_workers(workers), evidence, cost=cost,
                      upper_bound=True, capacity_factor=capacity, established=True)]


def _host_text(load: ExpertLoad) -> str:
    """The evidence's words on expert compute that waited for host cores (empty elsewhere)."""
    if load.host is None:
        return ""
    text = (f"; the expert compute ran on host CPUs and waited for a core "
            f"{100 * load.host.share:.0f}% of its time (the rows are fitted to its CPU time, "
            f"the waits left out")
    fit = load.host.contention
    if fit is None:
        text += "; where ranks share busy cores balancing buys less than this)"
    else:
        text += (f"); its ranks outnumber their host's CPUs: balanced, each expert piece waits "
                 f"for a core as the ranks computing beside it in the replay imply "
                 f"({fit.base:.2f} + {fit.per_rank:.2f} per other rank computing, s per s of "
                 f"its CPU time, fitted over {fit.pieces} compute pieces of the run)")
    return text + _transfer_wait_text(load.host.transfer_wait)


def _transfer_wait_text(share: float | None) -> str:
    """Why the gain is an upper bound beyond perfect routing where ranks share their host's
    cores: the all-to-alls' waits for a core, which the prediction keeps as measured."""
    if share is None:
        return ""
    # Balanced, every rank computes a larger expert share at once, beside the others' dispatch
    # transfers: on 4 ranks sharing 2 cores the dispatches' waits doubled (8.3 → 15.6 ms a
    # step) while the ranks computing beside them barely moved (0.57 → 0.58 in the replay), and
    # no fit on that overlap over the skewed steps prices it (tests/whatif/
    # test_expert_transfer_waits.py; whatif/README.md, limitations)
    return (f"; its all-to-alls' transfers waited for a core {100 * share:.0f}% of their time "
            f"(their threads' run delay), kept at the skewed steps' in the prediction: "
            f"balanced, they run beside every rank's larger expert share and wait longer, "
            f"which the skewed steps do not show, so on ranks sharing cores the gain is an "
            f"upper bound beyond perfect routing")


def _transfer_text(load: ExpertLoad, bar: float) -> str:
    """The evidence's words on the all-to-all transfer priced (or why it is not)."""
    t = load.transfer
    if t is None:
        # a fit below the bar: its correlation (with a positive bar, slope ≤ 0 is below it)
        reached = ("" if load.transfer_corr is None
                   else f", correlation {load.transfer_corr:.2f} < expert_corr {bar:.2f}")
        return (" (the all-to-alls' transfer kept as measured: it does not follow the rows "
                f"each rank moves{reached})")
    moved = "received and sent" if t.with_sent else "received (the trace has no rows sent)"
    return (f" and the {len(t.nodes)} all-to-alls' transfer at balanced volume "
            f"({1e6 * t.slope:.2f} µs per row {moved}, correlation {t.corr:.2f})")


def _rows_received(g, tokens: np.ndarray, n: int) -> np.ndarray | None:
    """[D, T] rows each rank received (or sent: that column) at all-to-all node n (None
    unless every cell has them, or none moved a row). Zero rows are rows (−1: not recorded):
    a router may send an expert no token in a step, and a learned one over 400 steps of our
    example did; such a dispatch was dropped, its expert compute left to `worker_fault`."""
    rows = g.row[n]
    if (rows < 0).any():
        return None
    tok = tokens[rows].astype(np.float64)
    return tok if (tok >= 0).all() and tok.any() else None


def relative(rows: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """rows / their group's mean (1 where the group moved none)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean > 0, rows / np.where(mean > 0, mean, 1), 1.0)


def _next_compute(g, n: int) -> int | None:
    """The compute node that starts right after node n ends on the same stage (median gap)."""
    cands = np.flatnonzero((g.node_stage == g.node_stage[n]) & np.isin(g.node_optype, _COMPUTE))
    if not len(cands):
        return None
    end = g.start[n] + g.duration[n]                                      # [D, T]
    gap = g.start[cands] - end[None]                                      # [C, D, T]
    gap = np.where(gap >= -1e-9, gap, np.inf)
    med = np.median(gap.reshape(len(cands), -1), axis=1)
    best = int(np.argmin(med))
    return int(cands[best]) if np.isfinite(med[best]) else None


def _group_mean(g, n: int, tok: np.ndarray) -> np.ndarray:
    """[D, T] the mean rows of each rank's process group at node n (all ranks without groups)."""
    return _over_groups(g, n, tok, np.mean)


def _over_groups(g, n: int, values: np.ndarray, reduce) -> np.ndarray:
    """[D, T] reduce(values) over each rank's process group at node n (one group without)."""
    groups = g.node_pg[n] if g.node_pg is not None else np.full(len(g.dp_ranks), -1)
    out = np.empty_like(values)
    for pg in np.unique(groups):
        sel = groups == pg
        out[sel] = reduce(values[sel], axis=0, keepdims=True)
    return out


def _fit(tok: np.ndarray, dur: np.ndarray) -> tuple[float, float] | None:
    """(slope, correlation) of duration on rows across ranks, each step's mean taken out."""
    x = (tok - tok.mean(axis=0, keepdims=True)).ravel()
    y = (dur - dur.mean(axis=0, keepdims=True)).ravel()
    if np.std(x) == 0 or np.std(y) == 0:
        return None
    return float(np.dot(x, y) / np.dot(x, x)), float(np.corrcoef(x, y)[0, 1])


def _step_slopes(g, n: int, tok: np.ndarray, dur: np.ndarray) -> np.ndarray:
    """[D, T] seconds per row of the compute `dur` after dispatch n, for each rank's group and
    step: a fit on shares (each rank's rows and time over its group's mean that step, pooled
    over ranks and steps: b), times the step's mean time over its mean rows.

    Shares, not seconds: the load a step meets (CPU hogs, the scheduler, a shared core's other
    thread) scales every rank's time per row in it. A fit of seconds pooled over steps mixes
    those costs (a hot expert beside CPU hogs: 4.4-23 µs per row on the hot rank from step to
    step, one slope 8.5) and, applied to a fast step, priced the hot rank's balanced rows at
    nothing (its piece cut to 0) and the others' above what that step's rows cost, so the
    balanced step came out slower than the measured one and the gain's interval reached 1.
    From time = a + c × rows the share fit gives c in every step, whatever scales a and c
    alike; pooled, it is as steady as the seconds' fit."""
    x = relative(tok, _group_mean(g, n, tok)) - 1
    mean_dur = _group_mean(g, n, dur)
    y = relative(dur, mean_dur) - 1
    xx = float(np.dot(x.ravel(), x.ravel()))
    share = float(np.dot(x.ravel(), y.ravel())) / xx if xx > 0 else 0.0
    return share * _per_row(g, n, tok, mean_dur)


def _per_row(g, n: int, tok: np.ndarray, mean_dur: np.ndarray) -> np.ndarray:
    """[D, T] each rank's group's mean time over its mean rows at node n, that step (0 where the
    group received no rows)."""
    mean_tok = _group_mean(g, n, tok)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(mean_tok > 0, mean_dur / np.where(mean_tok > 0, mean_tok, 1), 0.0)
