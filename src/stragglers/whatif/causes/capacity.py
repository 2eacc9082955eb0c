"""Heterogeneous capacity: a group of workers slower than the rest, not one outlier among many.

Production clusters mix device generations and shared hosts: half of a job's workers may run
3× slower than the other half. The outlier test of `worker_fault` cannot see that (the slow
half moves the median), so this detector splits the workers of a stage into a fast and a slow
group at the widest gap between their per-step compute, and names every worker of the slow
group with its speed relative to the fast ones; a group over several pipeline stages (a slow
node or rack holding workers of each) is one group, however few of its workers a stage holds
(`_groups`). The fix is the one that such capacity allows, work re-split in proportion to speed
(AntDT's DD policy, `stragglers advise`): its prediction gives every worker the time the stage's
total speed needs for the whole work, an upper bound.
"""

from __future__ import annotations

import numpy as np

from stragglers.whatif.causes.base import BUSY, Candidate, Context, per_worker_sum
from stragglers.whatif.confidence import MAD_TO_SIGMA, mean_interval, robust_z

# The two groups' closest workers differ by at least this fraction of the faster one's time.
MIN_GAP = 0.05


def slow_group(ctx: Context) -> list[Candidate]:
    """A group of two or more workers, on one stage or over several, whose compute stands apart
    from their stages' other workers alike."""
    w, g, cfg = ctx.w, ctx.w.grid, ctx.cfg
    if len(g.dp_ranks) < 3:
        return []  # two workers: one of them is a worker fault or nothing
    busy_nodes = np.isin(g.node_optype, BUSY)
    own = ctx.own_durations
    busy = per_worker_sum(own, g.node_stage, busy_nodes, g.pp_size)              # [D, P, T]
    cost: np.ndarray | None = None      # a copy of the costs once a group is found
    named: list[tuple[int, int]] = []
    parts: list[str] = []
    for p, (slow, ratio) in sorted(_groups(busy, cfg).items()):
        sel = busy_nodes & (g.node_stage == p)
        # Re-split in proportion to speed: every worker then needs what the stage's summed
        # speed needs for the whole work of the step, the harmonic mean of their times.
        times = np.maximum(busy[:, p, :], 1e-12)                                  # [D, T]
        balanced = len(times) / (1.0 / times).sum(axis=0)                         # [T]
        if cost is None:
            cost = w.cost.copy()
        cost[sel] *= (balanced[None, :] / times)[None, :, :]
        workers = sorted(((int(d), p) for d in np.flatnonzero(slow)),
                         key=lambda dp: -float(ratio[dp[0]]))
        named += workers
        point, lo, hi = _group_interval(busy[:, p, :], slow, cfg)
        shown = ", ".join(f"{ctx.name(d, q)} {ratio[d]:.2f}×" for d, q in workers[:8])
        more = f" (+{len(workers) - 8} more)" if len(workers) > 8 else ""
        parts.append(f"{len(workers)} of {len(slow)} workers of stage {p} compute "
                     f"{point:.2f}×{ctx.spread(lo, hi)} as long per step (the groups' medians) "
                     f"as the other {int((~slow).sum())}: {shown}{more}")
    if not named or cost is None:
        return []
    evidence = ("; ".join(parts) + "; a slow group, not one outlier (heterogeneous devices or "
                "shared hosts): re-splitting each step's work in proportion to speed gives "
                "every worker the same time")
    return [Candidate("slow_group", ctx.where_workers(named), evidence, cost=cost,
                      upper_bound=True)]


def group_members(ctx: Context, busy: np.ndarray) -> np.ndarray:
    """bool [D, P]: the workers this detector names as a slow group (worker_fault leaves them)."""
    out = np.zeros(busy.shape[:2], dtype=bool)
    if busy.shape[0] < 3:
        return out
    for p, (slow, _) in _groups(busy, ctx.cfg).items():
        out[:, p] = slow
    return out


def _groups(busy: np.ndarray, cfg) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{stage: (slow mask [D], time relative to the stage's fast group [D])} of the slow group
    of a job's busy compute ([D, P, T]), over its stages.

    A slow node or rack slows its workers alike whatever stage they hold, and it may hold one
    worker of a stage only: alone on its stage that worker is an outlier, a worker fault by
    itself. So a stage's lone slow worker joins the group where it is slowed like the other
    stages' group members (the levels' spread within half the smallest gap between a stage's
    groups, the rule that keeps a stage's group tight), and lone slow workers of two stages or
    more form one when alike; a lone slow worker unlike the rest stays a worker fault (in
    hand-made ring-attention × PP jobs 18 of 69 groups over two stages were named slow_group on
    one and worker_fault on the other).
    """
    found: dict[int, tuple[np.ndarray, np.ndarray, float]] = {}
    sure: set[int] = set()
    for p in range(busy.shape[1]):
        split = _split(busy[:, p, :], cfg)
        if split is not None:
            found[p] = split[:3]
            if split[3]:
                sure.add(p)
    groups = {p: f for p, f in found.items() if f[0].sum() >= 2}
    # a lone slow worker is held to the test of the halves as well, where it can be made (its
    # 15% alone let two GC-paused workers' chance level on one stage take in a third's)
    lone = {p: f for p, f in found.items() if f[0].sum() == 1 and p in sure}

    def alike(parts: list[tuple[np.ndarray, np.ndarray, float]]) -> bool:
        # over all steps and on the even and odd steps each alone: a slow device slows its
        # steps alike, chance (GC pauses in a few steps) does not
        levels = np.concatenate([np.log(ratio[:, slow]) for slow, ratio, _ in parts], axis=1)
        return bool((np.ptp(levels, axis=1) <= min(gap for _, _, gap in parts) / 2).all())

    # A lone worker joins a stage's group only where two fast workers or more measure the
    # group's level: beside one fast worker, that one may be the odd one (a faster device;
    # without Σs², the mirror of a slow pipeline peer: its DP rank's load is estimated from
    # that peer's stage, so a slow worker on stage 0 made its stage-1 peer read ×0.44 and the
    # other 7 of stage 1 a "group" at the slow worker's level, which then took it in)
    anchors = [f for f in groups.values() if (~f[0]).sum() >= 2]
    if anchors:
        lone = {p: f for p, f in lone.items() if alike([*anchors, f])}
    else:
        # the most lone workers alike (consecutive in speed), the slowest such set on a tie:
        # the others stay worker faults
        order = sorted(lone, key=lambda p: float(lone[p][1][0][lone[p][0]][0]))
        best: list[int] = []
        for i in range(len(order)):
            for j in range(i + 2, len(order) + 1):
                if j - i >= len(best) and alike([lone[p] for p in order[i:j]]):
                    best = order[i:j]
        lone = {p: lone[p] for p in best}
    return {p: (slow, ratio[0]) for p, (slow, ratio, _) in {**groups, **lone}.items()}


def _split(times: np.ndarray, cfg) -> tuple[np.ndarray, np.ndarray, float, bool] | None:
    """(slow mask [D], time relative to the fast group's median [3, D]: over all steps, the
    even ones and the odd ones, the log gap between the groups, whether the split holds on the even and odd steps alone where the outlier test can
    tell (five workers or more)) of one stage's workers ([D, T] busy seconds), or None when
    they do not fall into two separate groups. The slow group may be one worker: `_groups`
    decides what it is."""
    # Each worker's typical speed: its median over steps of its time relative to the step's
    # median worker. A median, not a mean: a worker slow for a stretch of the run (PAI's
    # job_3, four workers a quarter slower in its last tenth) stays in the group it belongs
    # to the rest of the time, and does not blur the gap between the groups.
    ref = np.median(times, axis=0)                                            # [T]
    steps = ref > 0
    if not steps.any():
        return None
    kept = times[:, steps] / ref[steps]                                       # [D, T']
    mean = np.median(kept, axis=1)                                            # [D]
    if not np.all(mean > 0):
        return None
    x = np.log(mean)
    order = np.argsort(x)
    gaps = np.diff(x[order])
    k = int(np.argmax(gaps))                      # the widest gap: fast = order[:k+1]
    slow = np.zeros(len(x), dtype=bool)
    slow[order[k + 1:]] = True
    if (~slow).sum() < 1:
        return None
    # Two groups apart where they meet; noise alone leaves per-worker means within a few
    # percent of each other, and the group test below asks for a persistent 15%.
    if gaps[k] < np.log1p(MIN_GAP):
        return None
    # Slow workers of different speeds that the outlier test finds one by one are faults of
    # their own (worker_fault's to name); a tight group of alike ones is a group, however few.
    tight = float(np.ptp(x[slow])) <= gaps[k] / 2
    if not tight and (robust_z(mean, cfg.outlier_scale_floor)[slow] >= cfg.outlier_z).all():
        return None
    ratio = _relative(mean, slow)
    _, lo, _ = _group_interval(times, slow, cfg)
    # Closer groups, from five workers on: the outlier test with the fast group as the norm
    # (the whole stage's median sits between the groups when half of it is slow): every slow
    # worker lies `outlier_z` robust deviations (the workers' spread about their own group's
    # median) above the fast group's median, and the slow group is slower in (nearly) every
    # step; what fixing it buys is the gain test's. A slow half of a job 10% slower was named
    # as nothing, while a slow 40% of it was named by the outlier test worker by worker.
    held = len(x) >= 5 and lo > 1 and _holds_in_halves(kept, slow, cfg)
    if lo >= 1 + cfg.worker_min_excess or held:     # persistently 15% slower, or apart
        halves = (np.stack([_relative(np.median(kept[:, h::2], axis=1), slow) for h in (0, 1)])
                  if kept.shape[1] >= 2 else np.stack([ratio, ratio]))
        return slow, np.vstack([ratio, halves]), float(gaps[k]), held or len(x) < 5
    return None


def _relative(mean: np.ndarray, slow: np.ndarray) -> np.ndarray:
    """Each worker's level over the fast group's median level."""
    return mean / max(float(np.median(mean[~slow])), 1e-12)


def _holds_in_halves(kept: np.ndarray, slow: np.ndarray, cfg) -> bool:
    """The outlier test with the fast group as the norm on the even steps and on the odd ones
    each alone ([D, T] times relative to the step's median worker). The split was chosen on
    all of them: chance per-step loads that favoured some workers (random sequence lengths
    over 8 steps, GC pauses) make groups that do not hold in each half."""
    halves = (kept[:, 0::2], kept[:, 1::2])
    if min(h.shape[1] for h in halves) < 2:
        return False
    return all(_stands_apart(np.log(np.median(half, axis=1)), slow, cfg) for half in halves)


def _stands_apart(x: np.ndarray, slow: np.ndarray, cfg) -> bool:
    """The outlier test with the fast group as the norm: every slow worker's log level lies
    `outlier_z` robust deviations (the workers' spread about their own group's median) above
    the fast group's median."""
    if not np.all(np.isfinite(x)):
        return False
    fast = float(np.median(x[~slow]))
    centre = np.where(slow, np.median(x[slow]), fast)
    spread = max(MAD_TO_SIGMA * float(np.median(np.abs(x - centre))), cfg.outlier_scale_floor)
    return float(x[slow].min()) - fast >= cfg.outlier_z * spread


def _group_interval(times: np.ndarray, slow: np.ndarray, cfg) -> tuple[float, float, float]:
    """Mean over steps of the slow group's median time over the fast group's, with its
    interval."""
    per_step = np.median(times[slow], axis=0) / np.maximum(np.median(times[~slow], axis=0), 1e-12)
    lo, hi = mean_interval(per_step[None, :], cfg)
    return float(per_step.mean()), float(np.ravel(lo)[0]), float(np.ravel(hi)[0])
