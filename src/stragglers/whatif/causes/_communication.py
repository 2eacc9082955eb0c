"""Communication stragglers: a slow link or collective, located at the workers where it is slow.

A slow link is a place (its transfers late while another carrier's are not) or a time (some
steps). Lateness on every carrier in most steps, or at workers that stand out from the other
carriers in fewer than half the steps, is neither: the family's own variation (on CPU, receives
woken a scheduler tick late), left to the noise floor (tests/record/test_record_single_link.py).
CPU contention in some steps on hosts whose transfers wait for a CPU in every step (ranks that
outnumber their cores: the contention is standing), in a job whose S the jitter alone gives (S
at most the noise floor + `noise_margin`), is that jitter too: which steps the standing
contention made late is the machine's other load's lottery (clean ranks on one CPU).
Without recorded waits, workers whose transfers are longer where their host's other ranks
computed beside them (in pieces begun while a transfer of the other carriers' length would still
run) longer than beside the other carriers' (by at least `contention_explains` of how much longer
they are) stand out no more than contention would make them: the trace cannot tell that from a
slow link, and the result's warnings say so instead of a finding.
"""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import COMPUTE_OPTYPES, OPTYPE_CODES as C, OPTYPES, P2P_OPTYPES
from stragglers.whatif.causes.base import Candidate, Context, Rows, fmt_steps, per_worker_sum
from stragglers.whatif.causes.contention import as_contention, taken_beside
from stragglers.whatif.noise import within_floor

_COMPUTE = {C[o] for o in COMPUTE_OPTYPES}


def _families(codes: np.ndarray) -> dict[str, list[int]]:
    """Op types fixed together: the pipeline link (all p2p, both directions), each collective."""
    present = {int(c) for c in np.unique(codes)}
    out = {"pipeline p2p": [C[o] for o in P2P_OPTYPES if C[o] in present]}
    for c in sorted(present - _COMPUTE - set(out["pipeline p2p"])):
        out[OPTYPES[c]] = [c]
    return {k: v for k, v in out.items() if v}


def communication(ctx: Context) -> list[Candidate]:
    """Per op-type family: transfers far above their median on some workers (or steps)."""
    w, g, cfg = ctx.w, ctx.w.grid, ctx.cfg
    found = []
    for name, codes in _families(g.node_optype).items():
        ids = np.flatnonzero(np.isin(g.node_optype, codes) & ~w.model.no_op)
        if not len(ids):
            continue
        cost, ideal = w.cost[ids], w.ideal[ids]                            # [n, D, T], [n, 1, 1]
        present = g.present[ids]
        slow = (cost >= cfg.comm_min_ratio * np.maximum(ideal, 1e-9)) & present
        excess = np.where(slow, cost - ideal, 0.0)
        stage = g.node_stage[ids]
        per = per_worker_sum(excess, stage, np.ones(len(ids), bool), g.pp_size)   # [D, P, T]
        mean = per.mean(axis=-1)
        worst = float(mean.max())
        if worst <= 0:
            continue
        hot = [(int(d), int(p)) for d, p in zip(*np.nonzero(mean >= cfg.comm_min_share * worst))]
        hot_mask = np.zeros((len(ids), cost.shape[1]), bool)
        for d, p in hot:
            hot_mask[stage == p, d] = True
        fix = slow & hot_mask[:, :, None]
        # the family's rows only (one family per candidate: a copy of the grid each adds up)
        fixed = Rows(ids, np.where(fix, np.broadcast_to(ideal, cost.shape), cost))
        times = float(np.median(cost[fix] / np.maximum(np.broadcast_to(ideal, cost.shape)[fix],
                                                       1e-9)))
        per_step = sum(per[d, p] for d, p in hot)
        steps = ctx.steps_where(per_step)
        carriers = {(int(d), int(p)) for p in range(g.pp_size)
                    for d in np.flatnonzero(present[stage == p].any(axis=(0, 2)))}
        if steps is None and _apart(per, hot, carriers) < cfg.intermittent_fraction:
            # late in most steps but at no place that stands out: the family's own variation
            # (wake-ups, the scheduler), which the noise floor reshuffles, not a link
            continue
        beside = _taken_explains(ctx, ids, hot, carriers)
        if beside:
            # no waits recorded, but the host's other ranks computed on its CPUs beside these
            # transfers more than beside the others' for at least as long as they are later:
            # their threads may have waited for a core (four ranks on one CPU: the last
            # stage's all-reduce runs beside the first stage's next forward, every step).
            # Not silently: the result's warnings say what was not named and why.
            _say(ctx, f"{name} transfers on {', '.join(ctx.name(d, p) for d, p in hot[:8])}"
                 f"{f' (+{len(hot) - 8} more)' if len(hot) > 8 else ''} take "
                 f"{1e3 * beside[0]:.1f} ms longer than the other carriers' (per transfer, "
                 f"mean over steps), and the host's other ranks computed "
                 f"{1e3 * beside[1]:.1f} ms more beside them (compute begun within a "
                 "transfer of the others' length): with no CPU waits recorded the trace "
                 "cannot tell CPU contention from a slow link there; no communication "
                 "finding is made")
            continue
        evidence = (f"{name} transfers take {times:.1f}× their median on "
                    f"{', '.join(ctx.name(d, p) for d, p in hot[:8])}"
                    + (f" (+{len(hot) - 8} more)" if len(hot) > 8 else "")
                    + f", {1e3 * float(per_step.mean()):.1f} ms per step in all")
        if steps:
            evidence += f", only in steps {fmt_steps(steps)}"
        if carriers <= set(hot):
            # nothing healthy to compare with: say what the trace cannot tell apart
            evidence += (f"; these are all the workers that carry {name} in this job, so the "
                         "trace has no healthy link to compare with")
            if ctx.cpu_waits is None:  # with recorded CPU waits, as_contention tells them apart
                evidence += (": a slow or congested network and hosts too busy to wake their "
                             "waiting threads promptly (CPU contention) look the same here")
        optypes = sorted({OPTYPES[c] for c in codes})
        cand = Candidate("communication", ctx.where_workers(hot, steps, optypes), evidence,
                         cost=fixed, strata=ctx.step_mask(steps))
        late = np.where(fix, cost - np.broadcast_to(ideal, cost.shape), 0.0)
        cand = as_contention(ctx, cand, ids, late, "a slow link")
        if cand.cause == "cpu_contention" and steps is not None \
                and _standing(ctx, ids, present, late) and _within_noise(w, cfg):
            # some steps of a contention standing in every step, in a job the jitter alone
            # explains: the load's lottery (clean ranks on one CPU beside other work)
            continue
        if cand.cause == "cpu_contention" and _waits_shared(ctx, ids, per, hot, carriers):
            # the carriers that are not late waited for a CPU as long: the host's contention
            # is everyone's, and which transfers it made late the scheduler's lottery (four
            # ranks on one CPU, pipeline p2p late on three of them, persistently)
            continue
        found.append(cand)
    return found


def _standing(ctx: Context, ids: np.ndarray, present: np.ndarray, late: np.ndarray) -> bool:
    """Whether the family's transfers wait for a CPU in their typical steps too: the mean over
    its transfers of each one's median wait over steps is at least `contention_explains` of
    the late ones' mean lateness (`late` [n, D, T] s; the waits every step holds already
    hold what made the late ones late). False without recorded waits."""
    waits = ctx.cpu_waits
    if waits is None or not (late > 0).any():
        return False
    typical = np.nanmedian(np.where(present, waits[ids], np.nan), axis=2)     # [n, D]
    return bool(np.nanmean(typical) >= ctx.cfg.contention_explains * late[late > 0].mean())


def _within_noise(w, cfg) -> bool:
    """Whether the job's S is what its jitter alone gives, as the verdict without findings
    judges it (`noise.within_floor`)."""
    return within_floor(w, cfg)


def _waits_shared(ctx: Context, ids: np.ndarray, per: np.ndarray, hot: list[tuple[int, int]],
                  carriers: set[tuple[int, int]]) -> bool:
    """Whether the hot workers' CPU waits per transfer exceed the other carriers' by less
    than `contention_explains` of how much later their transfers are (means over the steps
    and over the two sets; `per` [D, P, T] s of lateness): the waits then do not say why
    these transfers are late and not the others. False with no other carrier."""
    waits = ctx.cpu_waits
    if waits is None or not carriers - set(hot):
        return False
    return _gap(ctx, ids, _summed(ctx, ids, waits[ids]), hot, carriers) \
        < ctx.cfg.contention_explains * _gap(ctx, ids, per, hot, carriers)


def _say(ctx: Context, message: str) -> None:
    """`message` among the analysis's warnings (the result's `warnings`), once."""
    if message not in ctx.w.grid.warnings:
        ctx.w.grid.warnings.append(message)


def _taken_explains(ctx: Context, ids: np.ndarray, hot: list[tuple[int, int]],
                    carriers: set[tuple[int, int]]) -> tuple[float, float] | None:
    """Whether, in a trace without recorded waits, the time the hosts' other ranks computed
    during the hot workers' transfers, in compute pieces begun within the first `normal`
    seconds of each (`normal`: each step's median length of the other carriers' transfers of
    the family; `contention.taken_beside`: the most their threads can have waited for a
    core), exceeds that during the other carriers' by at least `contention_explains` of how
    much longer the hot ones are (per transfer, means over the steps): then (how much longer,
    how much more compute) s, else None. Compute begun later found the transfer late
    already: a link that slows a transfer lengthens the window others compute in, which
    cannot have made it late. None with no other carrier, or where the hot workers'
    transfers are not longer."""
    rest = carriers - set(hot)
    if not rest or ctx.cpu_waits is not None:
        return None
    g, cost = ctx.w.grid, ctx.w.cost[ids]
    stage, present = g.node_stage[ids], g.present[ids]
    others = np.zeros(present.shape, bool)
    for d, p in rest:
        others[stage == p, d] = present[stage == p, d]
    if not others.any():
        return None
    normal = np.nanmedian(np.where(others, cost, np.nan).reshape(-1, cost.shape[-1]), axis=0)
    taken = taken_beside(ctx, ids, np.nan_to_num(normal))                # [n, D, T]
    if taken is None:
        return None
    longer = _gap(ctx, ids, _summed(ctx, ids, cost), hot, carriers)
    more = _gap(ctx, ids, _summed(ctx, ids, taken), hot, carriers)
    return (longer, more) if longer > 0 and more >= ctx.cfg.contention_explains * longer \
        else None


def _gap(ctx: Context, ids: np.ndarray, per: np.ndarray, hot: list[tuple[int, int]],
         carriers: set[tuple[int, int]]) -> float:
    """The hot workers' mean per transfer of `per` ([D, P, T] s summed over each worker's
    transfers) less the other carriers' (means over steps). Per transfer: a middle stage
    carries twice the transfers of an end one."""
    rest = sorted(carriers - set(hot))
    g = ctx.w.grid
    count = np.maximum(_summed(ctx, ids, g.present[ids].astype(float)), 1.0)
    per = per / count
    return float(np.mean([per[d, p] for d, p in hot]) - np.mean([per[d, p] for d, p in rest]))


def _summed(ctx: Context, ids: np.ndarray, values: np.ndarray) -> np.ndarray:
    """[D, P, T]: `values` ([len(ids), D, T], one per transfer) summed over each worker's."""
    g = ctx.w.grid
    return per_worker_sum(np.where(g.present[ids], values, 0.0), g.node_stage[ids],
                          np.ones(len(ids), bool), g.pp_size)


def _apart(per: np.ndarray, hot: list[tuple[int, int]], carriers: set[tuple[int, int]]
           ) -> float:
    """The share of steps in which the hot workers' mean excess ([D, P, T] s) is above every
    other carrier's: 1 for a slow link (late each step, the others not), low for lateness
    that falls on a different worker each step, 0 with no other carrier to compare with."""
    rest = sorted(carriers - set(hot))
    if not rest:
        return 0.0
    mean = np.mean([per[d, p] for d, p in hot], axis=0)
    high = np.max([per[d, p] for d, p in rest], axis=0)
    return float((mean > high).mean())
