"""Run a pipeline schedule forward with sampled costs to get a causally consistent trace.

Times are computed per schedule position on vectors over every (step, dp rank). Steps are
independent once expressed relative to the previous step's barrier (the global clip all-reduce,
or the DP gradient sync when pp = 1): every worker's next step begins a sampled tail (barrier
transfer + optimizer launch delay + optimizer + step gap) after that barrier's group start.
So all steps are evaluated at once and stitched together with a cumulative sum.
"""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import COLUMNS, JobMeta, Trace, optype_code
from stragglers.trace.synth.durations import FORWARD_BACKWARD, Costs, sample_costs
from stragglers.trace.synth.schedule import Schedule, build_schedule
from stragglers.trace.synth.validate import ground_truth, validate_parameters


def generate(dp: int = 2, pp: int = 4, vpp: int = 1, microbatches: int = 8, steps: int = 10, *,
             sync: str = "zero", seed: int = 0, noise: float = 0.02,
             slow_worker: tuple[int, int, float] | None = None,
             heavy_last_stage: float | None = None,
             seq_imbalance: dict | None = None,
             gc: tuple[float, float] | None = None,
             slow_link: dict | None = None,
             launch_delay: float = 20e-6, step_gap: float = 1e-3,
             name: str | None = None) -> Trace:
    """A synthetic Megatron-style job trace with the given injected straggler causes.

    slow_worker=(dp_rank, stage, factor); heavy_last_stage=factor;
    seq_imbalance={"dist": "lognormal"|"uniform", "max_len", "tokens_per_mb", ...};
    gc=(pauses per worker per step, pause length s);
    slow_link={"kind": "p2p", "dp", "stage_from", "stage_to", "factor"} or
    {"kind": "collective", "optype", "stage" (None = all), "factor"}.
    """
    params = validate_parameters(dict(
        dp=dp, pp=pp, vpp=vpp, microbatches=microbatches, steps=steps, sync=sync, seed=seed,
        noise=noise, slow_worker=slow_worker, heavy_last_stage=heavy_last_stage,
        seq_imbalance=seq_imbalance, gc=gc, slow_link=slow_link, launch_delay=launch_delay,
        step_gap=step_gap))
    rng = np.random.default_rng(params["seed"])
    sched = build_schedule(pp, vpp, microbatches, params["sync"], gc_slots=params["gc"] is not None)
    costs = sample_costs(sched, dp, steps, rng, noise=noise, launch_delay=launch_delay,
                         step_gap=step_gap, slow_worker=params["slow_worker"],
                         heavy_last_stage=params["heavy_last_stage"],
                         seq_imbalance=params["seq_imbalance"], gc=params["gc"],
                         slow_link=params["slow_link"])
    start, end = run_forward(sched, costs, dp, steps)
    ops = assemble_ops(sched, costs, start, end, dp, steps)
    del start, end
    name = name or _default_name(params)
    meta = JobMeta(name=name, dp_size=dp, pp_size=pp, vpp_size=vpp, run_id=str(seed),
                   extra={"ground_truth": ground_truth(params, sched, costs, dp, steps),
                          "generator": {"tool": "stragglers.trace.synth", "version": 1,
                                        **params, **costs.notes}})
    return Trace(ops, meta, source=f"<synthetic {name}>")


def _default_name(params: dict) -> str:
    causes = [k for k in ("slow_worker", "heavy_last_stage", "seq_imbalance", "gc", "slow_link")
              if params[k] is not None]
    return (f"synth-dp{params['dp']}-pp{params['pp']}-vpp{params['vpp']}-"
            f"{'+'.join(causes) or 'noise'}-seed{params['seed']}")


def step_begin(sched: Schedule, costs: Costs, dp: int) -> np.ndarray:
    """(pp, columns): when each worker starts a step, relative to the previous barrier start."""
    barrier = sched.groups[sched.barrier]
    begin = np.empty_like(costs.step_gap)
    for stage, opt in enumerate(sched.optimizer):
        member = next(m for m in barrier.members if sched.nodes[m].stage == stage)
        tail = costs.duration[member] + costs.delay[opt] + costs.duration[opt]
        begin[stage, :dp] = 0.0  # the first step starts from rest
        begin[stage, dp:] = tail[:-dp]
    begin += costs.step_gap
    return begin


def run_forward(sched: Schedule, costs: Costs, dp: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Absolute start and end of every (node, column), following the dependency model."""
    n, cols = len(sched.nodes), dp * steps
    nodes, dur, delay = sched.nodes, costs.duration, costs.delay
    begin = step_begin(sched, costs, dp)
    start = np.empty((n, cols))
    end = np.empty((n, cols))
    barrier_start = None
    for kind, i in sched.events:
        if kind == "S":
            node = nodes[i]
            if node.deps:
                t = end[node.deps[0]].copy()
                for d in node.deps[1:]:
                    np.maximum(t, end[d], out=t)
            else:
                t = begin[node.stage].copy()
            t += delay[i]
            start[i] = t
            continue
        group = sched.groups[i]
        members = group.members
        if group.kind == "compute":
            np.add(start[members[0]], dur[members[0]], out=end[members[0]])
            continue
        latest = start[members[0]].copy()
        for m in members[1:]:
            np.maximum(latest, start[m], out=latest)
        if group.across_dp:
            latest = np.repeat(latest.reshape(steps, dp).max(axis=1), dp)
        if i == sched.barrier:
            barrier_start = latest[::dp].copy()
        for m in members:
            np.add(latest, dur[members[0] if group.shared_transfer else m], out=end[m])
    # Stitch steps: step k is relative to the barrier start of step k-1.
    offset = np.repeat(np.concatenate([[0.0], np.cumsum(barrier_start)[:-1]]), dp)
    start += offset
    end += offset
    return start, end


def assemble_ops(sched: Schedule, costs: Costs, start: np.ndarray, end: np.ndarray,
                 dp: int, steps: int) -> dict[str, np.ndarray]:
    """Op-table columns, rows grouped by rank, then step, then schedule position."""
    cols = dp * steps
    gc_code = optype_code("gc")
    seq_on = costs.attn_cost is not None
    layouts = []  # per stage: (node ids, flat keep mask or None, row count)
    for ids in sched.by_stage:
        ids = np.asarray(ids)
        codes = np.array([sched.nodes[i].code for i in ids], dtype=np.int8)
        gc_local = np.flatnonzero(codes == gc_code)
        keep = None
        if len(gc_local):
            keep = np.ones((len(ids), cols), dtype=bool)
            keep[gc_local] = costs.gc_active[np.searchsorted(costs.gc_rows, ids[gc_local])]
        layouts.append((ids, codes, gc_local, keep))
    keeps = [_per_worker(k, steps, dp) if k is not None else None for *_, k in layouts]
    sizes = [int(k.sum()) if k is not None else len(ids) * cols
             for (ids, *_), k in zip(layouts, keeps)]
    out = {name: np.empty(sum(sizes), dtype=dtype) for name, dtype in COLUMNS.items()}
    if seq_on:
        out["attn_cost"] = np.empty(sum(sizes))
        out["tokens"] = np.empty(sum(sizes), dtype=np.int64)
    offset = 0
    for stage, ((ids, codes, gc_local, keep), flat_keep, size) in \
            enumerate(zip(layouts, keeps, sizes)):
        nodes = [sched.nodes[i] for i in ids]
        n = len(ids)

        def put(name: str, values: np.ndarray) -> None:
            # values: one per (dp, step, node) in row order; drop the absent gc pauses
            out[name][offset:offset + size] = values if flat_keep is None else values[flat_keep]

        def static(values) -> np.ndarray:
            return np.tile(np.asarray(values), cols)

        seq = np.broadcast_to(_static_seq_ids(codes)[:, None], (n, cols))
        if len(gc_local):
            seq = seq.copy()
            seq[gc_local] = np.cumsum(keep[gc_local], axis=0, dtype=np.int32) - 1
        dp_rank = np.repeat(np.arange(dp, dtype=np.int32), steps * n)
        put("dp_rank", dp_rank)
        put("rank", dp_rank + stage * dp)
        out["stage"][offset:offset + size] = stage
        put("step", np.tile(np.repeat(np.arange(steps, dtype=np.int64), n), dp))
        put("optype", static(codes))
        put("start_ts", _per_worker(start[ids], steps, dp))
        put("duration", _per_worker(end[ids] - start[ids], steps, dp))
        put("seq_id", _per_worker(seq, steps, dp))
        put("mb_id", static([nd.mb for nd in nodes]))
        put("mc", static([nd.chunk for nd in nodes]))
        put("gmc", static([nd.chunk * sched.pp + stage if nd.optype in FORWARD_BACKWARD else -1
                           for nd in nodes]))
        if seq_on:
            fb = np.array([nd.optype in FORWARD_BACKWARD for nd in nodes])
            mbs = np.array([max(nd.mb, 0) for nd in nodes])
            attn = np.where(fb[:, None], costs.attn_cost[mbs], np.nan)
            put("attn_cost", _per_worker(attn, steps, dp))
            put("tokens", static(np.where(fb, costs.tokens, -1)))
        offset += size
    return out


def _per_worker(matrix: np.ndarray, steps: int, dp: int) -> np.ndarray:
    """(nodes, steps*dp) -> flat in (dp, step, node) order, the row order of the table."""
    return np.ascontiguousarray(matrix.reshape(len(matrix), steps, dp).transpose(2, 1, 0)).ravel()


def _static_seq_ids(codes: np.ndarray) -> np.ndarray:
    """Ordinal of each node among the nodes of its op type (stream order = start order)."""
    seq = np.empty(len(codes), dtype=np.int32)
    counts: dict[int, int] = {}
    for i, c in enumerate(codes.tolist()):
        seq[i] = counts.get(c, 0)
        counts[c] = seq[i] + 1
    return seq
