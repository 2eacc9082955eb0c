"""Test traces slowed as a real worker is: its later rows pushed back, not overlapped; rows a
rank's recorder numbers otherwise or adds (seq_ids lying, a stray transfer renumbering the
rest); and the per-worker busy times the capacity checks read."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from stragglers.trace.model import COMPUTE_OPTYPES, OPTYPE_CODES, P2P_OPTYPES, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze


def stretched(trace: Trace, scale: np.ndarray | None = None,
              plus: np.ndarray | None = None) -> Trace:
    """`trace` with each row's duration × `scale` + `plus` (per row; 1 and 0 leave it), run on
    as a worker runs it (as `synth.generate(slow_worker=...)` does; durations × scale with
    starts kept put two computes on one stream at once, a trace no worker can write): every
    row of a rank that began after a longer one began pushed back by the time it gained; a
    collective (rows of one step, op type and sequence number; not p2p) ends where its last
    member's start and each member's own transfer say, and a member's rows begun after it
    ended are pushed back by what its end moved."""
    ops = {k: v.copy() for k, v in trace.ops.items()}
    start = ops["start_ts"].astype(np.float64)
    duration = ops["duration"].astype(np.float64)
    gain = np.zeros(len(start)) if scale is None else \
        duration * (np.asarray(scale, dtype=np.float64) - 1.0)
    if plus is not None:
        gain += plus
    new_duration = duration + gain
    shift = np.zeros(len(start))
    for rank in np.unique(ops["rank"]):
        rows = np.flatnonzero(ops["rank"] == rank)
        order = rows[np.argsort(start[rows], kind="stable")]
        s = start[order]
        gained = np.cumsum(np.maximum(gain[order], 0.0))   # a shorter op leaves a gap
        # each row moves by what the rows begun strictly before it gained
        before = np.searchsorted(s, s, side="left")
        shift[order] = np.where(before > 0, gained[np.maximum(before - 1, 0)], 0.0)
    end = start + duration
    coll = np.flatnonzero(~np.isin(ops["optype"], _OWN))
    key = np.stack([ops["step"][coll], ops["optype"][coll], ops["seq_id"][coll]])
    _, group = np.unique(key, axis=1, return_inverse=True)
    group = group.ravel()
    groups = [coll[group == k] for k in range(group.max() + 1)] if len(coll) else []
    for members in sorted(groups, key=lambda m: start[m].min()):
        arrive = start[members] + shift[members]
        transfer = np.maximum(end[members] - start[members].max(), 0.0)
        ends = np.maximum(arrive + new_duration[members], arrive.max() + transfer)
        extra = ends - arrive - new_duration[members]
        new_duration[members] += extra
        for m, e in zip(members, extra):
            if e > 0:
                after = (ops["rank"] == ops["rank"][m]) & (start >= end[m])
                shift[after] += e
    ops["start_ts"] = (start + shift).astype(ops["start_ts"].dtype)
    ops["duration"] = new_duration.astype(ops["duration"].dtype)
    return Trace(ops, trace.meta, trace.source)


# a rank's own rows: computes and p2p (not matched across ranks by stretched)
_OWN = [OPTYPE_CODES[o] for o in COMPUTE_OPTYPES + P2P_OPTYPES]
# the job's shape among a synthetic trace's recorded generator keywords (the rest: its notes)
_SHAPE = ("dp", "pp", "vpp", "microbatches", "steps", "sync", "seed", "noise", "launch_delay",
          "step_gap")
_WORK = ("forward-compute", "backward-compute", "backward-weight-compute", "optimizer")


def rerun(trace: Trace, edit: Callable[[Any, Any, Any], None]) -> Trace:
    """The synthetic `trace` run again by its generator, its sampled costs changed first by
    `edit(schedule, costs, job)` (costs.duration [node, step × dp + dp rank], in place): every
    op then starts when its dependencies end, peers waiting on a slower one."""
    from stragglers.trace.synth._generate import assemble_ops, run_forward
    from stragglers.trace.synth.durations import sample_costs
    from stragglers.trace.synth.schedule import build_step_graph
    from stragglers.trace.synth.spec import synth_spec
    from stragglers.trace.synth.validate import KEYWORDS

    recorded = trace.meta.extra["generator"]
    job = synth_spec(None, {k: recorded[k] for k in _SHAPE + KEYWORDS
                            if recorded.get(k) is not None}).parameters()
    sched = build_step_graph(job.pp, job.vpp, job.microbatches, job.sync,
                             gc_slots=job.gc is not None)
    costs = sample_costs(sched, job)
    edit(sched, costs, job)
    start, end = run_forward(sched, costs, job.dp, job.steps)
    return Trace(assemble_ops(sched, costs, start, end, job.dp, job.steps), trace.meta,
                 trace.source)


def slowed(trace: Trace, factors: dict[int, list[float]], optypes: tuple[str, ...] = _WORK
           ) -> Trace:
    """The synthetic `trace` run again with rank r's own compute (`optypes`: forward, backward,
    optimizer) in step i × factors[r][i]: the peers wait for it, its later ops start later,
    as `generate(slow_worker=...)` (one worker, every step alike) runs it."""
    ops = trace.ops

    def edit(sched, costs, job) -> None:
        for rank, by_step in factors.items():
            dp = int(ops["dp_rank"][ops["rank"] == rank][0])
            stage = int(ops["stage"][ops["rank"] == rank][0])
            rows = [n.id for n in sched.nodes if n.optype in optypes and n.stage == stage]
            for step, f in enumerate(by_step):
                costs.duration[rows, step * job.dp + dp] *= f

    return rerun(trace, edit)


def rank0_straggler(dp: int, steps: int, optypes: tuple[str, ...] = _WORK
                    ) -> tuple[Trace, float]:
    """dp × pp 2 (ranks 0..dp-1 at stage 0), rank 0 (dp 0, pp 0) computing its `optypes`
    (default: forward, backward, optimizer) 3× as long, run as a slow worker runs (`slowed`);
    the trace and its S."""
    trace = slowed(generate(dp=dp, pp=2, microbatches=4, steps=steps, seed=0),
                   {0: [3.0] * steps}, optypes)
    return trace, analyze(trace).slowdown


def lying(trace: Trace, rank: int, optype: str, order: str) -> Trace:
    """`trace` with `rank`'s `optype` rows numbered otherwise in every step: microbatches 1
    and 2 swapped ("swap") or every one reversed ("reverse")."""
    o = {k: v.copy() for k, v in trace.ops.items()}
    mine = (o["rank"] == rank) & (o["optype"] == OPTYPE_CODES[optype])
    for step in np.unique(o["step"][mine]):
        rows = np.flatnonzero(mine & (o["step"] == step))
        seq = o["seq_id"][rows]
        o["seq_id"][rows] = seq[::-1] if order == "reverse" else \
            np.where(seq == 1, 2, np.where(seq == 2, 1, seq))
    return Trace(o, trace.meta, trace.source)


def renumbered(trace: Trace, rank: int, optype: str, after: int = 1) -> Trace:
    """`trace` with a 0.1 ms `optype` row at `rank` right after its #`after` in every step,
    the rank's rows of that type numbered again in order (the stray takes #`after` + 1)."""
    o = trace.ops
    code = OPTYPE_CODES[optype]
    at = np.flatnonzero((o["optype"] == code) & (o["rank"] == rank) & (o["seq_id"] == after))
    add = {k: v[at].copy() for k, v in o.items()}
    add["start_ts"] = add["start_ts"] + add["duration"] + 1e-6
    add["duration"] = np.full(len(at), 1e-4)
    merged = {k: np.concatenate([o[k], add[k]]) for k in o}
    order = np.lexsort((merged["start_ts"], merged["step"]))
    merged = {k: v[order] for k, v in merged.items()}
    mine = (merged["optype"] == code) & (merged["rank"] == rank)
    for step in np.unique(merged["step"][mine]):
        rows = np.flatnonzero(mine & (merged["step"] == step))
        merged["seq_id"][rows] = np.arange(len(rows))
    return Trace(merged, trace.meta, trace.source)


def busy(factors: dict[tuple[int, int], float], d: int = 4, p: int = 2, t: int = 8,
         noise: float = 0.01, seed: int = 0) -> np.ndarray:
    """[D, P, T] busy seconds: 1 s per step (×factor where given), lognormal noise."""
    rng = np.random.default_rng(seed)
    out = np.exp(noise * rng.standard_normal((d, p, t)))
    for (w, s), f in factors.items():
        out[w, s] *= f
    return out


def started_early(trace: Trace, rank: int, optype: str, by: float) -> Trace:
    """`trace` with `rank`'s `optype` rows written to start `by` s early, their ends kept (a
    recorder stamping an op's launch, queued behind its stream's work, as its start)."""
    o = {k: v.copy() for k, v in trace.ops.items()}
    hit = (o["rank"] == rank) & (o["optype"] == OPTYPE_CODES[optype])
    o["start_ts"] = np.where(hit, o["start_ts"] - by, o["start_ts"])
    o["duration"] = np.where(hit, o["duration"] + by, o["duration"])
    return Trace(o, trace.meta, trace.source)
