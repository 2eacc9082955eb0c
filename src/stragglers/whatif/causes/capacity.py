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

from typing import NamedTuple

import numpy as np

from stragglers.whatif.causes.base import BUSY, Candidate, Context, per_worker_sum
from stragglers.whatif.confidence import MAD_TO_SIGMA, mean_interval, robust_z

# The two groups' closest workers differ by at least this fraction of the faster one's time.
MIN_GAP = 0.05
# With 2-4 workers, a worker behind its peers in every one of this many steps or more is
# steadily slow: a one-sided sign test, (1/2)^5 = 1/32 by chance (a group: `_behind_every_step`).
STEADY_STEPS = 5


def slow_group(ctx: Context) -> list[Candidate]:
    """A group of two or more workers, on one stage or over several, whose compute stands apart
    from their stages' other workers alike."""
    w, g, cfg = ctx.w, ctx.w.grid, ctx.cfg
    if not _enough(len(g.dp_ranks), g.pp_size):
        return []  # two workers: one of them is a worker fault or nothing
    busy_nodes = np.isin(g.node_optype, BUSY)
    own = ctx.own_durations
    busy = per_worker_sum(own, g.node_stage, busy_nodes, g.pp_size)              # [D, P, T]
    cost: np.ndarray | None = None      # a copy of the costs once a group is found
    cleared: np.ndarray | None = None   # ... and with the members as fast as the fast group
    named: list[tuple[int, int]] = []
    parts: list[str] = []
    for p, part in sorted(_group_parts(busy, cfg, _measured(ctx), _steady(ctx)).items()):
        slow, ratio = part.slow, part.ratio[0]
        sel = busy_nodes & (g.node_stage == p)
        # Re-split in proportion to speed: every worker then needs what the stage's summed
        # speed needs for the whole work of the step, the harmonic mean of their times. The
        # group's and the fast group's work only: a slow rank of the stage that is neither
        # (slowed unlike the group) is a fault of its own, and its own fix's share (in the
        # re-split its time lifted every healthy worker's, so after its own fix the group's
        # fix slowed them, and a group ×1.17 was dropped as explained by the rank)
        times = np.maximum(busy[:, p, :], 1e-12)                                  # [D, T]
        among = part.slow | part.fast
        balanced = among.sum() / (1.0 / times[among]).sum(axis=0)                 # [T]
        if cost is None or cleared is None:
            cost, cleared = w.cost.copy(), w.cost.copy()
        cost[sel] *= np.where(among[:, None], balanced[None, :] / times, 1.0)[None, :, :]
        fast = np.median(times[part.fast], axis=0)                                # [T]
        for d in np.flatnonzero(slow):
            rows = np.flatnonzero(sel)
            cleared[rows, d, :] *= (fast / times[d])[None, :]
        workers = sorted(((int(d), p) for d in np.flatnonzero(slow)),
                         key=lambda dp: -float(ratio[dp[0]]))
        named += workers
        point, lo, hi = _group_interval(busy[:, p, :], slow, cfg, part.fast)
        shown = ", ".join(f"{ctx.name(d, q)} {ratio[d]:.2f}×" for d, q in workers[:8])
        more = f" (+{len(workers) - 8} more)" if len(workers) > 8 else ""
        parts.append(f"{len(workers)} of {len(slow)} workers of stage {p} compute "
                     f"{point:.2f}×{ctx.spread(lo, hi)} as long per step (the groups' medians) "
                     f"as the {int(part.fast.sum())} fast: {shown}{more}")
    if not named or cost is None:
        return []
    evidence = ("; ".join(parts) + "; a slow group, not one outlier (heterogeneous devices or "
                "shared hosts): re-splitting each step's work in proportion to speed gives "
                "every worker the same time")
    # The re-split leaves each stage at its workers' summed speed, slower than the fast
    # group's: a cause hidden behind the group (a slow rank of a stage after the group's) is
    # priced with that slowness gone, as moving the group onto fast hardware would leave it
    return [Candidate("slow_group", ctx.where_workers(named), evidence, cost=cost,
                      upper_bound=True, cleared=cleared)]


def group_members(ctx: Context, busy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(members, fast), bool [D, P]: the workers this detector names as a slow group
    (worker_fault leaves them), and the fast group of each stage that holds members (the
    norm of that stage's other workers)."""
    members = np.zeros(busy.shape[:2], dtype=bool)
    fast = np.zeros(busy.shape[:2], dtype=bool)
    if not _enough(*busy.shape[:2]):
        return members, fast
    for p, part in _group_parts(busy, ctx.cfg, _measured(ctx), _steady(ctx)).items():
        members[:, p], fast[:, p] = part.slow, part.fast
    return members, fast


def group_factors(ctx: Context) -> dict[int, float]:
    """{stage: the slow group's median time there over the stage's fast group} (empty: none)."""
    g = ctx.w.grid
    if not _enough(len(g.dp_ranks), g.pp_size):
        return {}
    busy = per_worker_sum(ctx.own_durations, g.node_stage, np.isin(g.node_optype, BUSY),
                          g.pp_size)
    return {p: float(np.median(ratio[slow]))
            for p, (slow, ratio) in _groups(busy, ctx.cfg, _measured(ctx), _steady(ctx)).items()}


def _enough(workers: int, stages: int) -> bool:
    """Whether a slow group can be told: three workers a stage, or two over several stages
    (each stage's slower worker, alike over the stages: a slow node holding one worker of
    each; in dp 2 × pp 2 GPU jobs such groups of two were named as two worker faults)."""
    return workers >= 3 or (workers == 2 and stages >= 2)


def _measured(ctx: Context) -> np.ndarray | None:
    """[D, P, T] busy compute without the sequences' load read from other stages (None where
    none was read: the busy compute judged is the measured one)."""
    own = ctx.own_measured
    if own is None:
        return None
    g = ctx.w.grid
    return per_worker_sum(own, g.node_stage, np.isin(g.node_optype, BUSY), g.pp_size)


def _groups(busy: np.ndarray, cfg, measured: np.ndarray | None = None, steady: bool = False
            ) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{stage: (slow mask [D], time relative to the stage's fast group [D])} of the slow group
    of a job's busy compute ([D, P, T]), over its stages (`_group_parts`)."""
    return {p: (f.slow, f.ratio[0]) for p, f in _group_parts(busy, cfg, measured, steady).items()}


def _group_parts(busy: np.ndarray, cfg, measured: np.ndarray | None = None,
                 steady: bool = False) -> dict[int, "Part"]:
    """{stage: its Part} of the slow group of a job's busy compute ([D, P, T]), over its
    stages; `measured`: the same before the sequences' load read from other stages was
    divided out (None where none was); `steady`: whether a group of a stage of fewer than
    five workers may be told by its steadiness (`_part`).

    A slow node or rack slows its workers alike whatever stage they hold, and it may hold one
    worker of a stage only: alone on its stage that worker is an outlier, a worker fault by
    itself. So a stage's lone slow worker joins the group where it is slowed like the other
    stages' group members (the levels' spread within half the smallest gap between a stage's
    groups, the rule that keeps a stage's group tight), and lone slow workers of two stages or
    more form one when alike; a lone slow worker unlike the rest stays a worker fault (in
    hand-made ring-attention × PP jobs 18 of 69 groups over two stages were named slow_group on
    one and worker_fault on the other).
    """
    groups: dict[int, Part] = {}
    lone: list[tuple[int, Part]] = []        # (stage, a lone slow worker's part)
    for p in range(busy.shape[1]):
        parts = _split(busy[:, p, :], cfg, steady)
        several = [f for f in parts if f.slow.sum() >= 2]
        if several:
            groups[p] = several[0]    # a lone slow worker beside it is unlike it
        else:
            # a lone slow worker is held to the test of the halves as well, where it can be
            # made (its 15% alone let two GC-paused workers' chance level on one stage take in
            # a third's)
            lone += [(p, f) for f in parts if f.sure]

    def alike(parts: list[Part]) -> bool:
        # over all steps and on the even and odd steps each alone: a slow device slows its
        # steps alike, chance (GC pauses in a few steps) does not
        levels = np.concatenate([np.log(f.ratio[:, f.slow]) for f in parts], axis=1)
        return bool((np.ptp(levels, axis=1) <= min(f.gap for f in parts) / 2).all())

    # A lone worker joins a stage's group where its fast workers measure the group's level.
    # One fast worker does as well as two, unless the load estimate made it fast: without
    # Σs² a DP rank's load is read from its other stages, so a slow worker on stage 0 made
    # its stage-1 peer read ×0.44 and the other 7 of stage 1 a "group" at the slow worker's
    # level, which then took it in (the mirror). So a stage's fast worker alone anchors where
    # the split is the same in the measured compute: the mirror's peer is no faster there.
    # (Asking two fast workers of every anchor left the groups holding all but one worker of
    # a stage split: 8 of 138 over 300 jobs of diagnosis_slow_group_stages seed 1.)
    def measured_alike(p: int, slow: np.ndarray) -> bool:
        if measured is None:
            return True
        return any(np.array_equal(f.slow, slow) for f in _split(measured[:, p, :], cfg, steady))

    anchors = [f for p, f in groups.items() if f.fast.sum() >= 2 or measured_alike(p, f.slow)]
    chosen: dict[int, Part] = {}
    if anchors:
        for p, f in lone:           # one per stage: two slow workers of a stage are unlike
            if p not in chosen and alike([*anchors, f]):
                chosen[p] = f
    else:
        # the most lone workers alike (consecutive in speed, one per stage), the slowest such
        # set on a tie: the others stay worker faults
        order = sorted(lone, key=lambda pf: float(pf[1].ratio[0][pf[1].slow][0]))
        best: list[tuple[int, Part]] = []
        for i in range(len(order)):
            for j in range(i + 2, len(order) + 1):
                window = order[i:j]
                if (j - i >= len(best) and len({p for p, _ in window}) == len(window)
                        and alike([f for _, f in window])):
                    best = window
        chosen = dict(best)
    found = _unlike_stage_mates({**groups, **chosen}, cfg)
    # a majority behind one fast worker in every step is that worker ahead of its stage in
    # every step, the mirror of worker_fault's question, which says nothing of the majority
    # (noise-only dp 3 jobs of 5-6 steps: 1 in 81 by chance, and named); other stages'
    # members slowed alike do (a node holding three of a stage's four workers and one of the
    # next's, x1.1-1.4, diagnosis_slow_group_stages seed 11)
    return found if len(found) >= 2 else {p: f for p, f in found.items() if not f.company}


def _unlike_stage_mates(parts: dict[int, "Part"], cfg) -> dict[int, "Part"]:
    """`parts` less the members that stand apart from the group over all its stages (the
    outlier test of `_apart` on the members' levels), each where a member of its own stage
    stays: on one stage two slow workers are alike within half the gap below them (×1.85 and
    ×2.41 over ×1, one group), but the other stages' members side with one of them (×1.85),
    and the other is a slow rank of its own beside the group (seed 2 job 211). Without a
    stage-mate that stays, a member is kept: stages differ in their work, and a group's
    factor with them."""
    owner = [(p, int(d)) for p, f in sorted(parts.items()) for d in np.flatnonzero(f.slow)]
    if len(owner) < 3 or len(parts) < 2:
        return parts
    x = np.log(np.array([parts[p].ratio[0][d] for p, d in owner]))
    peeled = _apart(x, np.ones(len(x), dtype=bool), cfg)
    out = dict(parts)
    for i in np.flatnonzero(peeled):
        p, d = owner[i]
        mates = [j for j, (q, e) in enumerate(owner) if q == p and e != d and not peeled[j]]
        if mates:
            slow = out[p].slow.copy()
            slow[d] = False
            out[p] = out[p]._replace(slow=slow)
    return out


class Part(NamedTuple):
    """A stage's slow group (or lone slow worker) as `_split` finds it."""
    slow: np.ndarray        # bool [D]
    ratio: np.ndarray       # [3, D] time relative to the fast group's median: all steps, even, odd
    gap: float              # the log gap between the fast group and the slow side
    sure: bool              # the split holds on the even and odd steps alone (or < 5 workers)
    fast: np.ndarray        # bool [D]: the fast group (a worker peeled off the slow side is in
    #                         neither)
    company: bool = False   # told by steadiness beside one fast worker: a group only beside
    #                         other stages' members (`_group_parts`)


def _split(times: np.ndarray, cfg, steady: bool = False) -> list[Part]:
    """The slow group of one stage's workers ([D, T] busy seconds): [] where they do not fall
    into two separate groups, [the group] (it may be one worker: `_groups` decides what it
    is), or, where the slow side is two workers unlike each other, each as a lone one.

    A worker of the slow side that stands apart from the rest of it (the outlier test with the
    rest as the norm) is a slow rank of its own beside the group, slowed unlike it: it is
    peeled off (worker_fault's to name). Taken in, a rank ×1.3-1.5 the group's was named a
    member, and a group on a stage beside one was not alike the other stages' members.
    """
    # Each worker's typical speed: its median over steps of its time relative to the step's
    # median worker. A median, not a mean: a worker slow for a stretch of the run (PAI's
    # job_3, four workers a quarter slower in its last tenth) stays in the group it belongs
    # to the rest of the time, and does not blur the gap between the groups.
    ref = np.median(times, axis=0)                                            # [T]
    steps = ref > 0
    if not steps.any():
        return []
    kept = times[:, steps] / ref[steps]                                       # [D, T']
    mean = np.median(kept, axis=1)                                            # [D]
    if not np.all(mean > 0):
        return []
    x = np.log(mean)
    order = np.argsort(x)
    gaps = np.diff(x[order])
    k = int(np.argmax(gaps))                      # the widest gap: fast = order[:k+1]
    slow = np.zeros(len(x), dtype=bool)
    slow[order[k + 1:]] = True
    fast = ~slow
    # Two groups apart where they meet; noise alone leaves per-worker means within a few
    # percent of each other, and the group test below asks for a persistent 15%.
    if gaps[k] < np.log1p(MIN_GAP):
        return []
    slow &= ~_apart(x, slow, cfg)
    # a worker of the fast side standing above the rest of it: slowed, by less than the gap
    # above it (a group ×1.36 beside a rank ×2 of its stage: the widest gap lies above the
    # group): a lone slow worker of its own
    between = _above(x, fast, cfg)
    fast &= ~between
    # the peel stops with three left, so a member alike those peeled may stay among them (a
    # group ×1.28 of two beside a rank ×1.76 on a stage of five: one member was peeled, the
    # other stayed "fast" and put the gap below the first negative): split that side again
    below = (_second_split(times, kept, mean, x, fast | between, cfg, steady)
             if between.any() else None)
    if below is not None and below.slow.sum() >= 2 and not (between & ~below.slow).any():
        fast = below.fast.copy()
        lone_parts = [below]
    else:
        if between.sum() >= 2 and np.ptp(x[between]) <= (x[between].min() - x[fast].max()) / 2:
            # two or more of them alike: the group, the widest gap lying above it (a group
            # ×1.36 of two beside a rank ×1.96 of their stage: each was a lone worker, and
            # only one per stage could join the other stages' member, seed 3)
            alike = [between.copy()]
        else:
            alike = [np.arange(len(x)) == d for d in np.flatnonzero(between)]
        lone = [_part(times, kept, mean, side, fast, float(x[side].min() - x[fast].max()), cfg,
                      steady)
                for side in alike]
        lone_parts = [f for f in lone if f is not None]
    if slow.sum() == 1 and not between.any():
        # one worker above the widest gap, and the rest may split as well: a group below a
        # slow rank of its stage slowed unlike it (×1.32 beside ×1.87: the gap above the
        # group was the wider, and the group, the majority of the fast side, stood out of it
        # by no outlier test, diagnosis_slow_group_stages seed 3), or one member of a group
        # over stages (×1.37 beside ×1.94 on a stage of four, the other member ×1.38 on the
        # next stage: `_groups` pairs lone workers alike)
        below = _second_split(times, kept, mean, x, fast, cfg, steady)
        if below is not None:
            part = _part(times, kept, mean, slow, fast & ~below.slow, float(gaps[k]), cfg,
                         steady)
            return [below] + ([] if part is None else [part])
    # Slow workers of different speeds that the outlier test finds one by one are faults of
    # their own (worker_fault's to name); a tight group of alike ones is a group, however few.
    tight = float(np.ptp(x[slow])) <= gaps[k] / 2
    if not tight and slow.sum() == 2:
        # two unlike: neither the other's group; one may be alike another stage's members
        singles = [_part(times, kept, mean, slow & (np.arange(len(x)) == d), fast,
                         float(gaps[k]), cfg, steady) for d in np.flatnonzero(slow)]
        return [f for f in singles if f is not None] + lone_parts
    if not tight and (robust_z(mean, cfg.outlier_scale_floor)[slow] >= cfg.outlier_z).all():
        return lone_parts
    part = _part(times, kept, mean, slow, fast, float(gaps[k]), cfg, steady)
    return ([] if part is None else [part]) + lone_parts


def _second_split(times: np.ndarray, kept: np.ndarray, mean: np.ndarray, x: np.ndarray,
                  side: np.ndarray, cfg, steady: bool = False) -> Part | None:
    """The slow part within `side` (bool [D], two workers or more) at its own widest gap, by
    the tests of a stage's split (≥ 5% apart, alike above it, `_part`'s), or None: a group, or
    a lone worker (`_groups` makes it a member only where other stages' members are alike
    it). A lone worker above a single fast one is held to `_part`'s 15%, as on any stage of
    fewer than five (a stage of three: a member, a healthy worker and a slow rank)."""
    if side.sum() < 2:
        return None
    idx = np.flatnonzero(side)
    order = idx[np.argsort(x[idx])]
    gaps = np.diff(x[order])
    k = int(np.argmax(gaps))
    upper = np.zeros(len(x), dtype=bool)
    upper[order[k + 1:]] = True
    if gaps[k] < np.log1p(MIN_GAP) or np.ptp(x[upper]) > gaps[k] / 2:
        return None
    return _part(times, kept, mean, upper, side & ~upper, float(gaps[k]), cfg, steady)


def _above(x: np.ndarray, fast: np.ndarray, cfg) -> np.ndarray:
    """bool [D]: workers of the fast side ([D] log levels) that stand `outlier_z` robust
    deviations (the rest's spread about its median, floored) above the rest of it, the
    slowest first, while three or more are left."""
    return _peel(x, fast, 3, lambda v, centre: v - centre, cfg)


def _apart(x: np.ndarray, slow: np.ndarray, cfg) -> np.ndarray:
    """bool [D]: workers of the slow side ([D] log levels) that stand `outlier_z` robust
    deviations (the rest's spread about its median, floored) from the rest of it, the
    farthest first, while two or more are left."""
    return _peel(x, slow, 2, lambda v, centre: np.abs(v - centre), cfg)


def _peel(x: np.ndarray, side: np.ndarray, left: int, distance, cfg) -> np.ndarray:
    """bool [D]: the workers of `side` peeled off it one by one, the farthest by `distance`
    (from the side's median) first, while each stands `outlier_z` robust deviations of the
    rest (about the rest's median, floored) away and `left` or more stay."""
    out = np.zeros(len(x), dtype=bool)
    members = side.copy()
    while members.sum() > left:
        idx = np.flatnonzero(members)
        far = int(idx[np.argmax(distance(x[idx], np.median(x[idx])))])
        rest = x[idx[idx != far]]
        centre = float(np.median(rest))
        spread = max(MAD_TO_SIGMA * float(np.median(np.abs(rest - centre))),
                     cfg.outlier_scale_floor)
        if float(distance(x[far], centre)) < cfg.outlier_z * spread:
            break
        members[far], out[far] = False, True
    return out


def _part(times: np.ndarray, kept: np.ndarray, mean: np.ndarray, slow: np.ndarray,
          fast: np.ndarray, gap: float, cfg, steady: bool = False) -> Part | None:
    """The slow side `slow` of a stage as a Part, or None where it is neither persistently
    15% slower than the fast group, nor apart from it on the even and odd steps alone, nor
    (`steady`, fewer than five workers) behind it in every step as worker_fault asks."""
    ratio = _relative(mean, fast)
    point, lo, _ = _group_interval(times, slow, cfg, fast)
    # Closer groups, from five workers on: the outlier test with the fast group as the norm
    # (the whole stage's median sits between the groups when half of it is slow): every slow
    # worker lies `outlier_z` robust deviations (the workers' spread about their own group's
    # median) above the fast group's median, and the slow group is slower in (nearly) every
    # step; what fixing it buys is the gain test's. A slow half of a job 10% slower was named
    # as nothing, while a slow 40% of it was named by the outlier test worker by worker.
    apart = len(mean) >= 5 and lo > 1 and _holds_in_halves(kept, slow, fast, cfg)
    # With fewer than five, the route worker_fault has for a worker behind its peers in
    # every step of five or more (a slow device slows every step; ranks sharing a CPU are
    # slowed step by step at random), asked of every member (`_behind_every_step`): two
    # ranks of four x1.14 alike were named as two worker faults, the group's 15% unmet
    behind = steady and len(mean) < 5 and _behind_every_step(times, slow, fast, cfg) \
        and lo > 1 and point - 1 >= cfg.outlier_z * cfg.outlier_scale_floor
    held = apart or behind
    if lo >= 1 + cfg.worker_min_excess or held:     # persistently 15% slower, or apart
        halves = (np.stack([_relative(np.median(kept[:, h::2], axis=1), fast) for h in (0, 1)])
                  if kept.shape[1] >= 2 else np.stack([ratio, ratio]))
        company = (not (apart or lo >= 1 + cfg.worker_min_excess) and slow.sum() >= 2
                   and fast.sum() < 2)
        return Part(slow, np.vstack([ratio, halves]), gap, held or len(mean) < 5, fast, company)
    return None


def _behind_every_step(times: np.ndarray, slow: np.ndarray, fast: np.ndarray, cfg) -> bool:
    """Whether every worker of the slow side is behind every fast worker ([D, T] s) in every
    step, over STEADY_STEPS steps or more (beside one fast worker: `Part.company`)."""
    if times.shape[1] < STEADY_STEPS:
        return False
    # Every member against every fast worker, not the sides' medians: the split is chosen
    # from the data, the side behind most often, so "the slow side's median behind in every
    # step" held by chance far above the sign test's 1 in 32 (noise-only dp 4 jobs of five
    # steps: 2 of 180 named a group x1.09-1.13). k of n workers all behind the rest in a
    # step is 1 in C(n, k) for a split fixed in advance; over five steps and every split of
    # that size, C(n, k)^-4 by chance: 1/1296 for two of four, 1/81 for one of three, 1/16
    # for one of two (a member only where another stage's is alike)
    return bool((times[slow].min(axis=0) > times[fast].max(axis=0)).all())


def _steady(ctx: Context) -> bool:
    """Whether steadiness may tell a group of a stage of fewer than five workers, as it may
    tell worker_fault's slow worker: not where the sequences' pattern is there without Σs²
    (a DP rank that drew the heavier sequences can be behind in every step)."""
    return ctx.seq_pattern is None or ctx.seq_balanced is not None


def _relative(mean: np.ndarray, fast: np.ndarray) -> np.ndarray:
    """Each worker's level over the fast group's median level."""
    return mean / max(float(np.median(mean[fast])), 1e-12)


def _holds_in_halves(kept: np.ndarray, slow: np.ndarray, fast: np.ndarray, cfg) -> bool:
    """The outlier test with the fast group as the norm on the even steps and on the odd ones
    each alone ([D, T] times relative to the step's median worker). The split was chosen on
    all of them: chance per-step loads that favoured some workers (random sequence lengths
    over 8 steps, GC pauses) make groups that do not hold in each half."""
    halves = (kept[:, 0::2], kept[:, 1::2])
    if min(h.shape[1] for h in halves) < 2:
        return False
    return all(_stands_apart(np.log(np.median(half, axis=1)), slow, fast, cfg)
               for half in halves)


def _stands_apart(x: np.ndarray, slow: np.ndarray, fast: np.ndarray, cfg) -> bool:
    """The outlier test with the fast group as the norm: every slow worker's log level lies
    `outlier_z` robust deviations (the workers' spread about their own group's median) above
    the fast group's median."""
    if not np.all(np.isfinite(x)):
        return False
    both = slow | fast
    norm = float(np.median(x[fast]))
    centre = np.where(slow, np.median(x[slow]), norm)
    spread = max(MAD_TO_SIGMA * float(np.median(np.abs(x - centre)[both])),
                 cfg.outlier_scale_floor)
    return float(x[slow].min()) - norm >= cfg.outlier_z * spread


def _group_interval(times: np.ndarray, slow: np.ndarray, cfg,
                    fast: np.ndarray | None = None) -> tuple[float, float, float]:
    """Mean over steps of the slow group's median time over the fast group's (default: all
    the others), with its interval."""
    fast = ~slow if fast is None else fast
    per_step = np.median(times[slow], axis=0) / np.maximum(np.median(times[fast], axis=0), 1e-12)
    lo, hi = mean_interval(per_step[None, :], cfg)
    return float(per_step.mean()), float(np.ravel(lo)[0]), float(np.ravel(hi)[0])
