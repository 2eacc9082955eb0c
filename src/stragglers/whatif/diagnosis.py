"""Diagnosis (spec §7): name the causes of a straggling job, where they sit and what fixing buys."""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import COMPUTE_OPTYPES, OPTYPE_CODES as C, OPTYPES, Trace
from stragglers.whatif.grid import BWD, FWD, GC
from stragglers.whatif.metrics import MERGED_OPTYPE, WhatIf

STRAGGLING = 1.1          # a job is straggling when S ≥ 1.1
MW_WORKER = 0.5           # M_W above this: an individual worker problem
MS_STAGE = 0.5            # M_S at or above this: stage partitioning imbalance
SEQ_CORR = 0.9            # forward/backward correlation of the same microbatch
SEQ_FIT = 0.6             # or: correlation of a microbatch's compute with its Σ s_i²
SEQ_CV = 0.1              # coefficient of variation of forward durations within a worker
STAGE_EXCESS = 0.05       # the hot stage's typical compute per step exceeds the others' by this
WORKER_COMPUTE = 1.1      # a faulty worker computes at least this much longer than its peers
MIN_GAIN = 1.02           # a cause must buy at least 2% to be reported
FIXES = {
    "worker_fault": "replace or restart the slow worker (stragglers.adapt KILL_RESTART), or route "
                    "around it (StragglAR, gradient coding)",
    "stage_imbalance": "rebalance layers across stages (stragglers.mitigate.suggest_stage_split)",
    "sequence_imbalance": "balance Σs² across DP ranks and microbatches "
                          "(stragglers.mitigate.balance_sequences)",
    "gc": "plan GC: automatic GC off, gc.collect() on all ranks at the same step "
          "(stragglers.mitigate.PlannedGC)",
    "communication": "check the slow link or collective (NIC, switch port, NCCL settings)",
}


def diagnose(w: WhatIf, trace: Trace, by_optype: dict, by_stage: dict, by_dp: dict,
             scores: list[dict], m_w: float, top: list[tuple[int, int]]) -> list[dict]:
    """Causes, most important first; [`none`] when the job is not straggling."""
    s = w.slowdown
    if s < STRAGGLING:
        return [_entry("none", {}, f"S = {s:.3f} < {STRAGGLING}: the job is not straggling "
                       f"(waste {100 * (1 - 1 / s):.1f}%)", None)]
    found = []
    t_nd = float(w.t_nodelay.mean())
    dp_spread = (max(by_dp.values()) - min(by_dp.values())) if by_dp else 0.0

    # Worker fault: fixing the top ⌈3%⌉ workers alone removes most of the slowdown.
    compute_ratio = max((_worker_compute_ratio(w, d, p) for d, p in top), default=1.0)
    if m_w > MW_WORKER and compute_ratio >= WORKER_COMPUTE:
        where = {"dp": sorted({d for d, _ in top}), "pp": sorted({p for _, p in top})}
        score = max(x["score"] for x in scores)
        found.append(_entry("worker_fault", where,
                            f"worker(s) {', '.join(f'(dp {d}, pp {p})' for d, p in top)} score "
                            f"S_w = {score:.3f}, computing {compute_ratio:.2f}× as long as their stage's "
                            f"median worker; fixing only them removes {100 * min(m_w, 1):.0f}% "
                            f"of the slowdown (M_W = {m_w:.2f})",
                            t_nd / w.fix_fraction(w.worker_mask(top))[1]))

    # Stage imbalance: one stage hot on every DP rank alike.
    if by_stage:
        hot = max(by_stage, key=by_stage.get)
        stage_mask = w.ops_mask(w.grid.node_stage == hot)
        m_hot, t_rem_stage = w.fix_fraction(stage_mask)
        uniform = dp_spread <= 0.5 * (s - 1)
        excess = _stage_compute_excess(w, hot)
        worker_found = any(f["cause"] == "worker_fault" for f in found)
        if m_hot >= MS_STAGE and uniform and not worker_found and excess >= STAGE_EXCESS:
            found.append(_entry("stage_imbalance", {"pp": [hot]},
                                f"stage {hot} has S = {by_stage[hot]:.3f} on all DP ranks (others "
                                f"≤ {max([v for k, v in by_stage.items() if k != hot] or [1]):.3f}); "
                                f"it computes {100 * excess:.0f}% more per step than the other "
                                f"stages; balancing it alone removes {100 * m_hot:.0f}% of the "
                                f"slowdown (M = {m_hot:.2f})", t_nd / t_rem_stage))

    seq = _sequence_imbalance(w, trace)
    if seq is not None and not any(f["cause"] == "worker_fault" for f in found):
        stages, corr, cv, fit = seq
        mask = w.ops_mask(np.isin(w.grid.node_optype, (FWD, BWD)))
        evidence = (f"microbatch compute varies by {100 * cv:.0f}% within each worker and step on "
                    f"stage(s) {', '.join(map(str, stages))}; forward and backward of the same "
                    f"microbatch correlate at {corr:.2f}")
        if fit is not None:
            evidence += f"; compute follows Σs² (correlation {fit:.2f})"
        balanced = _balanced_sequence_costs(w, trace)
        # With Σs² recorded, the fix removes only the part of compute that Σs² explains (what
        # balancing sequences can do); without it, all compute variation (an upper bound).
        t_rem = w.mean_step_time(balanced) if balanced is not None else w.fix_fraction(mask)[1]
        found.append(_entry("sequence_imbalance", {"pp": stages}, evidence, t_nd / t_rem))

    gc = _gc(w)
    if gc is not None:
        where, total, count = gc
        gain = t_nd / w.fix_fraction(w.ops_mask(w.grid.node_optype == GC))[1]
        found.append(_entry("gc", where, f"{count} GC pauses totalling {total:.3f} s on "
                            f"{len(where['workers'])} workers at uncoordinated steps "
                            f"(S_gc = {by_optype.get('gc', 1.0):.3f})", gain))

    comm = _communication(w, by_optype)
    if comm is not None:
        found.append(comm)

    found = [f for f in found if f["speedup_if_fixed"] is None or f["speedup_if_fixed"] >= MIN_GAIN]
    found.sort(key=lambda f: -(f["speedup_if_fixed"] or 0))
    if not found:
        found.append(_entry("unexplained", {}, f"S = {s:.3f} but no single cause explains it; see "
                            "the attribution by op type, stage and DP rank", None))
    return found


def _entry(cause: str, where: dict, evidence: str, speedup: float | None) -> dict:
    """One diagnosis record."""
    where = {k: [int(x) for x in v] if k != "workers" else v for k, v in where.items()}
    return {"cause": cause, "where": where, "evidence": evidence,
            "speedup_if_fixed": None if speedup is None else float(speedup),
            "fix": FIXES.get(cause)}


def _worker_compute_ratio(w: WhatIf, dp: int, stage: int) -> float:
    """A worker's mean fwd+bwd time over the median worker of its stage (slow links are not)."""
    g = w.grid
    sel = np.isin(g.node_optype, (FWD, BWD)) & (g.node_stage == stage)
    per_worker = g.duration[sel].sum(axis=0).mean(axis=1)       # [D]
    mine = per_worker[int(np.searchsorted(g.dp_ranks, dp))]
    return float(mine / max(float(np.median(per_worker)), 1e-12))


def _stage_compute_excess(w: WhatIf, stage: int) -> float:
    """How much more fwd+bwd compute per step (median over workers and steps) a stage does."""
    g = w.grid
    compute = np.isin(g.node_optype, (FWD, BWD))
    per_stage = [float(np.median(g.duration[compute & (g.node_stage == s)].sum(axis=0)))
                 for s in range(g.pp_size)]
    others = [v for s, v in enumerate(per_stage) if s != stage]
    if not others or max(others) <= 0:
        return 0.0
    return per_stage[stage] / float(np.mean(others)) - 1


def _sequence_imbalance(w: WhatIf, trace: Trace):
    """Stages whose microbatches differ in cost the way their sequence lengths do.

    Evidence, per stage, on durations normalised per worker and step (so a uniformly slow
    worker or a machine whose speed drifts does not count): forward and backward of the same
    microbatch move together (spec §7), or, where the trace carries Σ sᵢ², the microbatch's
    compute follows it.
    """
    g = w.grid
    stages, corrs, cvs, fits = [], [], [], []
    for s in range(g.pp_size):
        f = _by_microbatch(g, trace, s, FWD)
        b = _by_microbatch(g, trace, s, BWD)
        if f is None or b is None or f.shape != b.shape or f.shape[0] < 2:
            continue
        fn = f / f.mean(axis=0, keepdims=True)
        bn = b / b.mean(axis=0, keepdims=True)
        if fn.std() == 0 or bn.std() == 0:
            continue
        corr = float(np.corrcoef(fn.ravel(), bn.ravel())[0, 1])
        cv = float(fn.std())
        fit = _attn_fit(g, trace, s, f + b)
        if cv >= SEQ_CV and (corr >= SEQ_CORR or (fit is not None and fit >= SEQ_FIT)):
            stages.append(s)
            corrs.append(corr)
            cvs.append(cv)
            if fit is not None:
                fits.append(fit)
    if not stages:
        return None
    return stages, float(np.mean(corrs)), float(np.mean(cvs)), \
        (float(np.mean(fits)) if fits else None)


def _balanced_sequence_costs(w: WhatIf, trace: Trace) -> np.ndarray | None:
    """Costs after Σs² is balanced across DP ranks and microbatches of each stage and step.

    Per stage and compute type, duration ≈ a + b·Σs² (least squares); balancing moves every
    microbatch's Σs² to the step's mean, so each op loses b·(Σs² − mean) and keeps its residual.
    """
    if "attn_cost" not in trace.ops:
        return None
    g = w.grid
    cost = w.cost.copy()
    for s in range(g.pp_size):
        for code in (FWD, BWD):
            nodes = _microbatch_nodes(g, trace, s, code)
            if len(nodes) == 0:
                continue
            rows = g.row[nodes]
            attn = np.where(rows >= 0, trace.ops["attn_cost"][np.maximum(rows, 0)], np.nan)
            if not np.all(np.isfinite(attn)):
                return None
            dur = g.duration[nodes]
            x, y = attn.ravel(), dur.ravel()
            if np.std(x) == 0:
                continue
            slope = float(np.cov(x, y)[0, 1] / np.var(x, ddof=1))
            step_mean = attn.mean(axis=(0, 1), keepdims=True)
            cost[nodes] = np.maximum(dur - max(slope, 0.0) * (attn - step_mean), 0.0)
    return cost


def _attn_fit(g, trace: Trace, stage: int, compute: np.ndarray) -> float | None:
    """Correlation of a microbatch's fwd+bwd time with its Σ sᵢ² (both normalised per worker-step)."""
    if "attn_cost" not in trace.ops:
        return None
    nodes = _microbatch_nodes(g, trace, stage, FWD)
    rows = g.row[nodes]
    cost = np.where(rows >= 0, trace.ops["attn_cost"][np.maximum(rows, 0)], np.nan)
    if not np.all(np.isfinite(cost)) or np.any(cost.mean(axis=0) <= 0):
        return None
    cn = cost / cost.mean(axis=0, keepdims=True)
    dn = compute / compute.mean(axis=0, keepdims=True)
    if cn.std() < SEQ_CV or dn.std() == 0:
        return None
    return float(np.corrcoef(cn.ravel(), dn.ravel())[0, 1])


def _microbatch_nodes(g, trace: Trace, stage: int, code: int) -> np.ndarray:
    """Template ops of one compute type on one stage, ordered by (model chunk, microbatch)."""
    nodes = np.flatnonzero((g.node_stage == stage) & (g.node_optype == code))
    ref = g.row[nodes, 0, 0]
    key = trace.ops["mc"][ref].astype(np.int64) * 100000 + trace.ops["mb_id"][ref]
    return nodes[np.argsort(key, kind="stable")]


def _by_microbatch(g, trace: Trace, stage: int, code: int):
    """Durations [microbatch, D, T] of one compute type on one stage, ordered by (mc, mb_id)."""
    nodes = _microbatch_nodes(g, trace, stage, code)
    return g.duration[nodes] if len(nodes) else None


def _gc(w: WhatIf):
    """Real GC pauses recorded as gc ops: where they happened and how long they took."""
    g = w.grid
    nodes = g.node_optype == GC
    if not nodes.any():
        return None
    dur = np.where(g.present[nodes], g.duration[nodes], 0.0)   # [n_gc, D, T]
    if dur.sum() <= 0:
        return None
    pause = dur > 0.2 * dur.max()
    per_worker = {}
    for k, d, t in zip(*np.nonzero(pause)):
        n = np.flatnonzero(nodes)[k]
        key = (int(g.dp_ranks[d]), int(g.node_stage[n]))
        per_worker.setdefault(key, set()).add(int(g.steps[t]))
    workers = sorted(per_worker)
    steps = sorted({s for v in per_worker.values() for s in v})
    where = {"dp": sorted({d for d, _ in workers}), "pp": sorted({p for _, p in workers}),
             "steps": steps, "workers": [[d, p] for d, p in workers]}
    return where, float(dur.sum()), int(pause.sum())


def _communication(w: WhatIf, by_optype: dict):
    """A slow link or collective: a comm op type with S_t well above 1, located by worker."""
    compute = {o for o in COMPUTE_OPTYPES}
    comm = {k: v for k, v in by_optype.items() if k not in compute}
    if not comm:
        return None
    name, s_t = max(comm.items(), key=lambda kv: kv[1])
    if s_t < 1.05:
        return None
    g = w.grid
    codes = [C[o] for o, m in MERGED_OPTYPE.items() if m == name] if name.endswith("pp-comm") \
        else [C[name]]
    nodes = np.isin(g.node_optype, codes)
    # Locate by excess seconds, not ratio: both ends of a slow link carry the same excess even
    # when their op types have different medians.
    excess = (w.cost[nodes] - w.ideal[nodes]).mean(axis=2)                      # [n, D]
    ratio = (w.cost[nodes] / np.maximum(w.ideal[nodes], 1e-12)).mean(axis=2)
    stage_of = g.node_stage[nodes]
    per_worker: dict = {}
    for i, n_stage in enumerate(stage_of):
        for d in range(excess.shape[1]):
            key = (int(g.dp_ranks[d]), int(n_stage))
            per_worker.setdefault(key, []).append((excess[i, d], ratio[i, d]))
    total = {k: float(sum(e for e, _ in v)) for k, v in per_worker.items()}
    worst_key = max(total, key=total.get)
    worst = max(float(np.mean([r for _, r in per_worker[worst_key]])), 1.0)
    hot = sorted(k for k, v in total.items() if v >= 0.5 * total[worst_key] and v > 0)
    if name.endswith("pp-comm"):
        hot = sorted(set(hot) | _link_peers(w, np.flatnonzero(nodes), excess))
    where = {"dp": sorted({d for d, _ in hot}), "pp": sorted({p for _, p in hot})} if hot else {}
    # The fix: the slow link carries traffic both ways (all p2p op types), or the slow
    # collective, on the workers where it is slow.
    fixed = np.isin(g.node_optype, [C[o] for o in MERGED_OPTYPE]) if name.endswith("pp-comm") \
        else nodes
    mask = np.zeros(w.cost.shape[:2], bool)
    dp_index = {int(d): i for i, d in enumerate(g.dp_ranks)}
    for d, p in hot or [(int(d), p) for d in g.dp_ranks for p in range(g.pp_size)]:
        mask[fixed & (g.node_stage == p), dp_index[d]] = True
    gain = float(w.t_nodelay.mean()) / w.fix_fraction(mask)[1]
    return _entry("communication", where,
                  f"{name} transfers take {worst:.1f}× their median on "
                  f"{', '.join(f'(dp {d}, pp {p})' for d, p in hot) or 'several workers'} "
                  f"(S_{name} = {s_t:.3f})", gain)


def _link_peers(w: WhatIf, nodes: np.ndarray, excess: np.ndarray) -> set:
    """Both ends of the slowest p2p transfers (excess [n, D] per node and DP rank)."""
    peers = set()
    for i, d in zip(*np.nonzero(excess >= 0.5 * excess.max())):
        group = w.model.group_of[nodes[i]]
        members = w.model.groups[group] if group >= 0 else [nodes[i]]
        for m in members:
            peers.add((int(w.grid.dp_ranks[d]), int(w.grid.node_stage[m])))
    return peers


__all__ = ["diagnose", "STRAGGLING", "FIXES", "OPTYPES"]
