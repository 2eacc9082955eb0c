"""Causes that sit on individual workers: slow compute (worker fault) and host-side stalls."""

from __future__ import annotations

import math
import warnings
from statistics import NormalDist

import numpy as np

from stragglers.whatif.causes.base import (BUSY, Candidate, Context, Rows, fmt_steps,
                                          per_worker_sum)
from stragglers.whatif.causes.capacity import STEADY_STEPS, group_members
from stragglers.whatif.confidence import mean_interval, robust_z
from stragglers.whatif.grid import BWD, FWD

# Leave-one-out medians are exact up to this many DP ranks; beyond, one worker barely moves
# the median of all, which is much cheaper.
_EXACT_PEERS = 8
# With 2-4 workers, a worker behind every peer in every one of this many steps or more (six
# beside one peer, or a lag clear of the noise) is steadily slow: a sign test, 1 in 32 or less
# by chance (slow_group's too).
_STEADY_STEPS = STEADY_STEPS


def peer_reference(values: np.ndarray, apart: np.ndarray | None = None,
                   norm: np.ndarray | None = None, left: np.ndarray | None = None
                   ) -> np.ndarray:
    """Per worker, the median of its stage peers' values ([D, P, T] → [D, P, T]).

    With one DP rank the peers are the other stages' workers; with none, the worker itself.
    With three, the median of all three, the worker's own value included: the median of its
    two peers is their mean, and one slow peer would lift it (a worker ×2.1 beside two peers
    at 0.64 of theirs was no outlier among six workers, and nothing was named).
    `apart` (bool [D, P]): workers that are no peer's norm (a slow group's members); a worker
    left with no other peer keeps the reference of all. `norm` (bool [D, P]): on a stage that
    holds some, every worker's reference is their median (a slow group's stage: its fast
    group; left to the peers, a slow rank beside the group lifted two healthy workers'
    leave-one-out reference to ×1.24 theirs, and the spread hid the rank). `left` (bool
    [D, P]): workers whose values are not their work (computes left out of the ideal,
    metrics.unexplained), never a reference: a worker with no other peer is its own (rank 3's
    computes timed at 0 read its honest stage peer ×2.5e11, red team round 13, #1).
    """
    if left is not None and left.any():
        kept = np.where(left[:, :, None], np.nan, values)
        ref = _reference(kept, apart, None if norm is None else norm & ~left, np.nanmedian)
        return np.where(np.isnan(ref), np.where(left[:, :, None], 0.0, values), ref)
    return _reference(values, apart, norm, np.median)


def _reference(values: np.ndarray, apart: np.ndarray | None, norm: np.ndarray | None,
               median) -> np.ndarray:
    """peer_reference's medians with `median` (np.nanmedian where workers are left out)."""
    if apart is not None and apart.any():
        kept = np.where(apart[:, :, None], np.nan, values)
        ref = _peer_median(kept, np.nanmedian)
        ref = np.where(np.isnan(ref), _peer_median(values, median), ref)
    else:
        ref = _peer_median(values, median)
    if norm is not None:
        for q in np.flatnonzero(norm.any(axis=0)):
            ref[:, q, :] = np.median(values[norm[:, q], q, :], axis=0)[None, :]
    return ref


def _peer_median(values: np.ndarray, median) -> np.ndarray:
    """peer_reference's medians with `median` (np.nanmedian where some workers are left out)."""
    d, p, _ = values.shape
    with warnings.catch_warnings():
        # a worker whose peers are all left out gets NaN (All-NaN slice), handled by the caller
        warnings.simplefilter("ignore", RuntimeWarning)
        if d == 1:
            if p == 1:
                return values.copy()
            return np.stack([median(np.delete(values, i, axis=1), axis=1) for i in range(p)],
                            axis=1)
        if d == 3 or d > _EXACT_PEERS:
            return np.broadcast_to(median(values, axis=0, keepdims=True), values.shape).copy()
        return np.stack([median(np.delete(values, i, axis=0), axis=0) for i in range(d)])


def _stands_out(ctx: Context, score: np.ndarray, lo: np.ndarray, threshold: float,
                floor: float | None = None, norm: np.ndarray | None = None,
                scale_floor: float | None = None) -> np.ndarray:
    """bool [D, P]: a robust outlier among all workers (`norm`, bool [D, P]: among those only)
    with the lower end of its interval above `floor`, or, where that test is impossible (it
    needs five workers to mean anything), at least `threshold`. `floor` None: at least
    `threshold` in both cases. `scale_floor`: the robust spread floor (default
    `outlier_scale_floor`)."""
    among = score if norm is None else score[norm]
    if among.size < 5:
        return lo >= threshold
    spread = ctx.cfg.outlier_scale_floor if scale_floor is None else scale_floor
    z = robust_z(score, spread, norm)
    outlier = z >= ctx.cfg.outlier_z
    return outlier & ((lo >= threshold) if floor is None else (lo > floor))


def _worst_first(named: np.ndarray, severity: np.ndarray) -> list[tuple[int, int]]:
    """The named (dp index, stage) workers, the most severe first."""
    workers = [(int(d), int(p)) for d, p in zip(*np.nonzero(named))]
    return sorted(workers, key=lambda dp: -float(severity[dp]))


def worker_fault(ctx: Context, scores: dict[tuple[int, int], float] | None = None
                 ) -> list[Candidate]:
    """Workers whose own compute per step stands out from their stage peers'."""
    w, g, cfg = ctx.w, ctx.w.grid, ctx.cfg
    if len(g.dp_ranks) < 2:
        return []  # one worker per stage: a slow worker is a heavy stage (stage_imbalance)
    busy_nodes = np.isin(g.node_optype, BUSY)
    # Where the trace carries Σs², a worker is judged on the compute its sequences do not
    # explain: a DP rank that drew a step's longest sequences is no slow worker, and peers
    # whose compute follows their sequences would hide a slow one among them.
    own = ctx.own_durations
    busy = per_worker_sum(own, g.node_stage, busy_nodes, g.pp_size)              # [D, P, T]
    # A slow group is slow_group's (capacity.py), and no norm for the others: a member among
    # a worker's peers lifts its reference (its stage's healthy workers read ×0.5), and the
    # members' and those peers' ratios widen the outlier test's spread, so a rank ×1.25 on
    # a stage of a pp 3 job holding no member stood 1.3 deviations out, and was not named
    members, fast = group_members(ctx, busy)
    named, reference, ratio, mean, lo, hi = _slower(ctx, busy, members, fast)
    if named.any():
        # A slow device stretches every microbatch it computes; one microbatch of a few steps
        # far longer than the worker's others is that microbatch's (a GC pause on its
        # forward and backward alike, which the pause test takes for a long sequence, or a
        # long sequence itself), and no property of the worker: judged again with those
        # steps' longest microbatch discounted, a worker no longer slower is not named (dp
        # 64 × pp 1 without Σs²: a rank whose microbatch 2 was paused in 2 of 8 steps read
        # ×1.28 "in steps 1, 6"). A long microbatch in most steps is the worker's own
        # (a microbatch ×2 in every step was no longer named when every step's was taken off)
        named &= _slower(ctx, _without_longest_microbatch(ctx, own, busy), members, fast)[0]
    workers = _worst_first(named, mean)
    if not workers:
        return []
    # only the rows of the named workers' stages change: the fix holds those, not the grid
    cost = Rows.on(w.cost, busy_nodes & np.isin(g.node_stage, [p for _, p in workers]))
    per_step = np.zeros(ctx.steps)
    for d, p in workers:
        sel = cost.at(busy_nodes & (g.node_stage == p))
        # Fixed = computes like its stage's median peer, step by step (noise elsewhere kept).
        cost.values[sel, d, :] /= np.maximum(ratio[d, p], 1e-12)[None, :]
        per_step = np.maximum(per_step, ratio[d, p] - 1)
    steps = ctx.steps_where(per_step)
    healthy = mean[~named & ~ctx.left_out]     # (a left-out worker's computes are not its own)
    parts = [f"{ctx.name(d, p)} computes {mean[d, p]:.2f}×{ctx.spread(lo[d, p], hi[d, p])} as "
             f"long per step as its stage's median peer"
             + (f", S_w = {scores[(int(g.dp_ranks[d]), p)]:.3f}" if scores else "")
             for d, p in workers[:8]]
    evidence = "; ".join(parts) + (f" (+{len(workers) - 8} more)" if len(workers) > 8 else "")
    if len(healthy):
        evidence += (f"; the other {len(healthy)} workers are within "
                     f"{np.min(healthy):.2f}–{np.max(healthy):.2f}×")
    if steps:
        evidence += f"; only in steps {fmt_steps(steps)}"
    return [Candidate("worker_fault", ctx.where_workers(workers, steps), evidence, cost=cost,
                      strata=ctx.step_mask(steps),
                      # _stands_out's outlier test
                      established=int((~members & ~ctx.left_out).sum()) >= 5)]


def _slower(ctx: Context, busy: np.ndarray, members: np.ndarray, fast: np.ndarray):
    """(named bool [D, P], reference, ratio [D, P, T], mean, lo, hi [D, P]): the workers whose
    busy compute ([D, P, T]) stands out from their stage peers', less a slow group's members
    (`group_members`: members, fast)."""
    cfg = ctx.cfg
    left = ctx.left_out
    reference = peer_reference(busy, members, fast, left)
    ratio = busy / np.maximum(reference, 1e-12)
    mean = ratio.mean(axis=-1)
    lo, hi = mean_interval(ratio, cfg)
    # With five workers or more the outlier test decides, among workers surely slower than
    # their peers (interval above 1): its scale floor already asks for outlier_z ×
    # outlier_scale_floor (6%) over identical peers, and the gain gate asks for a relevant
    # gain. worker_min_excess is the margin where no such test is possible: with 2-4 workers
    # a rank slowed by its host's load would otherwise be named (a x1.15 worker among 32,
    # costing its job x1.04-1.11, was missed under it).
    named = _stands_out(ctx, mean, lo, 1 + cfg.worker_min_excess, floor=1.0,
                        norm=~members & ~left)
    if (~members & ~left).sum() < 5 and ratio.shape[-1] >= _STEADY_STEPS and (
            ctx.seq_pattern is None or ctx.seq_balanced is not None):
        # ... or, behind every peer in every step (a sign test: 1 in 32 or less by chance,
        # `_behind_every_peer`), the outlier test with the spread at its floor, the spread
        # that 2-4 workers cannot measure. A slow device slows every step alike, while the
        # CPU that ranks of a clean run share slows each step's ranks at random: none of 44
        # ranks of 11 clean runs on one CPU was behind in every step, though one averaged
        # x1.19 (7 of 9 steps).
        # Not where the sequences' pattern is there without Σs²: a DP rank that drew the
        # heavier sequences can be behind in every step (x1.24 in 8 of 8, dp 2 x pp 2)
        steady = _behind_every_peer(busy, members, left) & (lo > 1)
        named |= steady & (mean - 1 >= cfg.outlier_z * cfg.outlier_scale_floor)
    named &= ~members & ~left
    if ctx.arrivals is not None:
        # a worker that reaches the collectives ahead of its peers by more than its extra
        # compute is not what the job waits for (its host started it early: it waits there)
        extra = (busy - reference).mean(axis=-1)
        named &= ctx.arrivals.lateness + extra > 0
    return named, reference, ratio, mean, lo, hi


def _steady_steps(workers: int) -> int:
    """Steps a worker must be behind each of its stage's `workers` - 1 peers in, for the sign
    test's 1 in 32 or less by chance: any of n workers the slowest of its stage in every one of
    T steps is n^-(T-1) (one of two: six steps; three or four: STEADY_STEPS)."""
    return max(_STEADY_STEPS, 1 + math.ceil(math.log(32) / math.log(workers) - 1e-9))


def _behind_every_peer(busy: np.ndarray, members: np.ndarray,
                       left_out: np.ndarray | None = None) -> np.ndarray:
    """bool [D, P]: workers behind every peer of their stage ([D, P, T] busy compute; a slow
    group's members are no peers) in every step, over `_steady_steps` of the n workers it is
    so behind and itself (a slow group's members it is behind too count), or, over fewer,
    with its mean lag clear of the steps' noise (`_clear_of_noise`).

    Every peer, not the peers' median: the worker is chosen from the data, so "behind the
    median peer in every step of five" held by chance for some worker of n up to n/32 (19 of
    6,000 noise-only jobs of 2-4 workers a stage named a worker fault). One of two is behind
    its peer in five steps 1 in 16 by chance: that alone would leave a fault ×1.25 beside one
    fast worker (a slow group's members the rest of its stage) unnamed over five steps of
    0.5% jitter. Step-down: a worker so found is no peer of the rest, which are asked the
    same among themselves while two peers are left (faults ×1.3 and ×1.6 of four: both).
    `left_out` (bool [D, P]): workers whose computes are not their work, neither peers nor
    counted (peer_reference)."""
    d, p, t = busy.shape
    out = np.zeros((d, p), dtype=bool)
    logs = np.log(np.maximum(busy, 1e-12))
    # a worker's step-to-step spread, pooled over all workers (each less its own mean: a
    # steady fault adds nothing to it, an intermittent cause widens it)
    spread = float(np.sqrt(((logs - logs.mean(axis=-1, keepdims=True)) ** 2).sum()
                           / max(d * p * (t - 1), 1)))
    for q in range(p):
        out_q = np.zeros(d, dtype=bool) if left_out is None else left_out[:, q]
        left = list(np.flatnonzero(~members[:, q] & ~out_q))
        while len(left) >= 2:
            behind = [i for i in left
                      if (busy[i, q] > busy[[j for j in left if j != i], q].max(axis=0)).all()]
            if not behind:
                break
            i = behind[0]               # at most one: it is behind the others in every step
            n = len(left) + int((members[:, q] & ~out_q
                                 & (busy[i, q] > busy[:, q]).all(axis=-1)).sum())
            lag = logs[i, q] - logs[[j for j in left if j != i], q].max(axis=0)        # [T]
            if t < _steady_steps(n) and not _clear_of_noise(lag, spread, n):
                break
            out[i, q] = True
            left.remove(i)
            if len(left) < 3:
                break   # the next would be judged against one peer: one of two again
    return out


def _clear_of_noise(lag: np.ndarray, spread: float, workers: int) -> bool:
    """Whether a worker's mean log lag behind its slowest peer ([T]) is beyond what steps of
    `spread` give by chance: a one-sided z-test at 1 in 32 × `workers` (any of them could
    have been picked), the lag's spread √2 × a worker's."""
    z = float(lag.mean()) / max(math.sqrt(2.0 / len(lag)) * spread, 1e-12)
    return z >= NormalDist().inv_cdf(1 - 1 / (32 * workers))


def _without_longest_microbatch(ctx: Context, own: np.ndarray, busy: np.ndarray) -> np.ndarray:
    """[D, P, T] busy compute with each worker-step's longest microbatch (its forward and
    backward ops on the stage) counted no further beyond the worker-step's median microbatch
    than it typically is in the worker's steps (their median: what recurs in most steps
    stays); `busy` where a stage has fewer than three microbatches (no median apart from the
    longest)."""
    from stragglers.whatif.causes.sequence import microbatch_nodes, microbatch_rows

    g, trace = ctx.w.grid, ctx.trace
    out = busy.copy()
    for p in range(g.pp_size):
        nodes = np.concatenate([microbatch_nodes(ctx.w, trace, p, code) for code in (FWD, BWD)])
        if not len(nodes):
            continue
        # each worker-step's own microbatch ids: a rank numbering its microbatches otherwise
        # holds another microbatch at a template op than the replica-step the model read
        rows = g.row[nodes]
        mb = np.where(rows >= 0, trace.ops["mb_id"][np.maximum(rows, 0)], -1)   # [n, D, T]
        ids = np.unique(trace.ops["mb_id"][microbatch_rows(ctx.w, nodes)])
        if len(ids) < 3:
            continue
        per_mb = np.stack([np.where(mb == m, own[nodes], 0.0).sum(axis=0) for m in ids])
        excess = per_mb.max(axis=0) - np.median(per_mb, axis=0)                 # [D, T]
        # sporadic = beyond the worker's own median step: a majority of its steps decide
        out[:, p, :] -= np.maximum(excess - np.median(excess, axis=-1, keepdims=True), 0.0)
    return out


def host_stall(ctx: Context) -> list[Candidate]:
    """Workers that launch their work late (data loader, host-side work) beyond their peers.

    Launch delay (docs/whatif.md §4) is the gap between an op's dependencies ending and the op starting;
    a worker whose gaps exceed its peers' makes everyone that syncs with it wait.
    """
    w, g, cfg = ctx.w, ctx.w.grid, ctx.cfg
    if len(g.dp_ranks) * g.pp_size < 2:
        return []
    # Ops without dependencies all wait for the step's start: a late start delays each of
    # them by the same time, so they count once (their largest delay); the others add up.
    free = np.array([not deps for deps in w.model.deps])
    # a rare row's wait on its guessed place is no gap of its worker (timing.host_gaps, read
    # once beside the launch delays)
    gaps = w.host_gap
    delay = per_worker_sum(gaps, g.node_stage, ~free, g.pp_size)                  # [D, P, T]
    for p in range(g.pp_size):
        sel = free & (g.node_stage == p)
        if sel.any():
            delay[:, p, :] += gaps[sel].max(axis=0)
    # ... less what the worker's own previous step explains: steps are replayed from the
    # job's first start, and a worker whose last step ended late (it waited for a slow peer
    # at the end of it) starts this one late without any host-side work of its own
    delay = np.maximum(delay - _carried_over(g, w.step_start), 0.0)
    # A worker whose computes were left out of the ideal has gaps nobody waits on: its own
    # work timed short, not host-side work (metrics.unexplained); no stall, and no peer's norm
    left = ctx.left_out
    excess = delay - peer_reference(delay, left=left)
    excess[left] = 0.0
    mean = excess.mean(axis=-1)
    lo, hi = mean_interval(excess, cfg)
    threshold = max(cfg.stall_min_seconds, cfg.stall_min_fraction * float(np.median(w.t_base)))
    # the outlier test compares fractions of the step, as worker_fault compares ratios (the
    # spread floor is a ratio: in seconds it would hide any stall under ~0.1 s)
    step_time = max(float(np.median(w.t_base)), 1e-12)
    # ... but the floor of a ratio's spread (outlier_scale_floor) read as a fraction of the
    # step asked a stall among identical peers for outlier_z of it (6%), twice the threshold
    # that decides with fewer than five workers: a rank starting every step 5% late (x1.05
    # on the job) was named among four ranks and not among six. The floor is no stricter
    # than the threshold: a stall of threshold's size stands out from identical peers.
    spread = min(cfg.outlier_scale_floor, threshold / step_time / cfg.outlier_z)
    named = _stands_out(ctx, mean / step_time, lo, threshold, scale_floor=spread)
    late = ctx.arrivals
    gating = np.zeros_like(mean)
    if late is not None:
        # Who is late, not who waits: a worker that reaches the collectives ahead of its
        # peers waits there, whatever its gaps; and the worker that arrives last holds the
        # group up even where its gaps look like its peers' (they all wait for something).
        # only the hold-up its own extra gaps account for: a worker that computes slowly
        # arrives last too (a worker fault), and so does one whose pipeline peer is slow
        held = np.minimum(late.gating, np.maximum(excess, 0.0))
        gating = held.mean(axis=-1)
        g_lo, _ = mean_interval(held, cfg)
        named &= late.lateness + mean > 0
        if mean.size >= 5:
            # With five workers or more the outlier test tells a hold-up from chance
            named |= _stands_out(ctx, gating / step_time, g_lo, threshold,
                                  scale_floor=spread)
        else:
            # With fewer only the threshold can, and a hold-up counted from the steps a rank
            # happened to be last (its gaps clipped at zero elsewhere) is positive under
            # noise alone (on a clean 2-rank run one rank was named so): the hold-up must
            # exceed its peers' own, which carry the same clipping, in the typical step
            # (median: a peer's rare pause does not hide it) and in more steps than chance
            # gives (a one-sided sign test at 5%). Not asked to be late on the mean, as
            # neither is the route above: the hold-up is measured where it arrived last, and
            # beside a slow peer of its stage a stalled worker is early at most collectives
            # (it waits for the peer) yet holds the group up at the one its stall delays
            beyond = held - peer_reference(held)
            named |= (np.median(beyond, axis=-1) >= threshold) & _mostly_positive(beyond)
    workers = _worst_first(named, np.maximum(mean, gating))
    if not workers:
        return []
    fixed = Rows.on(w.launch_delay, np.isin(g.node_stage, [p for _, p in workers]))
    per_step = np.zeros(ctx.steps)
    for d, p in workers:
        sel = fixed.at(g.node_stage == p)
        # Fixed = no gap longer than a peer's typical one; the worker's usual gaps stay.
        typical = _typical_peer_gap(w, named, p)
        fixed.values[sel, d, :] = np.minimum(fixed.values[sel, d, :], typical[None, :])
        per_step = np.maximum(per_step, excess[d, p])
    steps = ctx.steps_where(per_step)
    evidence = "; ".join(_stall_words(ctx, d, p, mean, lo, hi, gating, step_time)
                         for d, p in workers[:8])
    evidence += ("; the gaps are launch delays (host-side work between ops or before the step, "
                 "e.g. a slow data loader) that the others wait for at the next collective")
    if steps:
        evidence += f"; only in steps {fmt_steps(steps)}"
    return [Candidate("host_stall", ctx.where_workers(workers, steps), evidence, delay=fixed,
                      strata=ctx.step_mask(steps))]


def _carried_over(g, step_start: np.ndarray) -> np.ndarray:
    """[D, P, T] the part of a worker's late start in each step that its previous step (the
    step before, where the grid holds it) explains: it still ran past the step's start."""
    out = np.zeros((len(g.dp_ranks), g.pp_size, len(g.steps)))
    follows = np.zeros(len(g.steps), dtype=bool)
    follows[1:] = np.diff(g.steps) == 1
    for p in range(g.pp_size):
        # a stage's rows at a time: the temporaries are a stage's, not the job's grid
        sel = g.node_stage == p
        present, start = g.present[sel], g.start[sel]
        last = np.where(present, start + g.duration[sel], -np.inf).max(axis=0)   # [D, T]
        lead = np.where(present, start, np.inf).min(axis=0) - step_start[None, :]  # [D, T]
        late = np.minimum(last[:, :-1] - step_start[None, 1:], lead[:, 1:])
        out[:, p, 1:] = np.where(follows[None, 1:] & np.isfinite(late), np.maximum(late, 0), 0)
    return out


def _mostly_positive(values: np.ndarray, alpha: float = 0.05) -> np.ndarray:
    """bool [D, P]: positive in more steps than a fair coin gives at level alpha (sign test)."""
    n = values.shape[-1]
    k = (values > 0).sum(axis=-1)
    # P(X >= k) for X ~ Binomial(n, 1/2)
    tail = np.array([sum(math.comb(n, j) for j in range(int(x), n + 1)) / 2 ** n
                     for x in k.ravel()]).reshape(k.shape)
    return tail <= alpha


def _stall_words(ctx: Context, d: int, p: int, mean, lo, hi, gating, step_time: float) -> str:
    """One worker's stall in words: its extra gaps, and how long it held the others up."""
    text = f"{ctx.name(d, p)} "
    if mean[d, p] > 0:
        text += (f"starts its work {1e3 * mean[d, p]:.1f} ms"
                 f"{ctx.spread(lo[d, p], hi[d, p], '.1f', 1e3)} per step later than its peers "
                 f"({100 * mean[d, p] / step_time:.0f}% of the step)")
    if gating[d, p] > 0:
        text += ("; " if mean[d, p] > 0 else "") + (
            f"arrives last at the collectives, holding the others up {1e3 * gating[d, p]:.1f} "
            f"ms per step ({100 * gating[d, p] / step_time:.0f}% of the step)")
    return text


def _typical_peer_gap(w, named: np.ndarray, stage: int) -> np.ndarray:
    """Median launch delay per step [T] over the ops of the healthy peers of a stage's workers
    (with one DP rank: of the other stages' workers)."""
    g = w.grid
    if len(g.dp_ranks) > 1:
        rows = w.launch_delay[g.node_stage == stage][:, ~named[:, stage], :]
        samples = rows.reshape(-1, rows.shape[-1])
    else:
        samples = np.concatenate([w.launch_delay[g.node_stage == q][:, 0, :]
                                  for q in range(g.pp_size) if q != stage and not named[0, q]]
                                 or [np.zeros((1, g.shape[2]))])
    return np.median(samples, axis=0) if len(samples) else np.zeros(g.shape[2])
