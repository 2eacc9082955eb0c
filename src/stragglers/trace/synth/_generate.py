"""Run a pipeline schedule forward with sampled costs to get a causally consistent trace.

Times are computed per schedule position on vectors over every (step, dp rank). Steps are
independent once expressed relative to the previous step's barrier (the global clip all-reduce,
or the DP gradient sync when pp = 1): every worker's next step begins a sampled tail (barrier
transfer + optimizer launch delay + optimizer + step gap) after that barrier's group start.
So all steps are evaluated at once and stitched together with a cumulative sum.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from stragglers.errors import InputError
from stragglers.trace.model import COLUMNS, JobMeta, Trace, optype_code
from stragglers.trace.synth.durations import FORWARD_BACKWARD, Costs, sample_costs
from stragglers.trace.synth.schedule import StepGraph, build_step_graph
from stragglers.trace.synth.spec import SynthSpec, synth_spec
from stragglers.trace.synth.truth import injected_causes
from stragglers.trace.synth.validate import KEYWORDS, SOURCE, Job


def generate(spec: SynthSpec | None = None, /, **keywords: Any) -> Trace:
    """A synthetic Megatron-style job trace with the given injected straggler causes.

    `spec` is a SynthSpec: the job's shape (dp, pp, vpp, microbatches, steps, sync, seed, noise,
    launch_delay, step_gap, name, stage_scale) and its typed injections (SlowWorker,
    HeavyLastStage, SequenceImbalance, GC, GCInCompute, SlowLink, SlowCollective, HostStall);
    keywords given with it change its fields. Without one, the keyword form, converted by
    `SynthSpec.from_keywords`:

    slow_worker=(dp_rank, stage, factor); heavy_last_stage=factor;
    seq_imbalance={"dist": "lognormal"|"uniform", "max_len", "tokens_per_mb", ...};
    gc=(pauses per worker per step, pause length s);
    slow_link={"kind": "p2p", "dp", "stage_from", "stage_to", "factor"} or
    {"kind": "collective", "optype", "stage" (None = all), "factor"}, either with an optional
    "steps" list (an intermittent slowdown; default every step);
    host_stall={"dp", "stage", "seconds", "steps" (optional)}: host-side work (a slow data
    loader) before that worker's first op of each step;
    gc_in_compute=(pauses per worker per step, pause s): GC pauses inside forward/backward
    compute, with no gc rows (what NDTimeline traces show);
    stage_scale=[factor per stage]: the work of each stage's forward/backward (a layer split;
    not a cause by itself, e.g. the rebalanced twin of a heavy-stage job).
    """
    spec = synth_spec(spec, keywords)
    job = spec.parameters()
    dp, steps = job.dp, job.steps
    # refused before the schedule is built: with pp = 100,000 building it alone fills memory
    _check_size(job, upper_bound_ops(job.pp, job.vpp, job.microbatches) * dp * steps)
    sched = build_step_graph(job.pp, job.vpp, job.microbatches, job.sync,
                             gc_slots=job.gc is not None)
    _check_size(job, len(sched.nodes) * dp * steps)
    # Sizes that overflow float64 are refused by _check_usable, in one line: numpy's own
    # overflow warnings on the way there would only bury it.
    with np.errstate(over="ignore", invalid="ignore"):
        costs = sample_costs(sched, job)
        start, end = run_forward(sched, costs, dp, steps)
        ops = assemble_ops(sched, costs, start, end, dp, steps)
    _check_usable(ops, job)
    impacts = measure_impacts(sched, job, start, end) \
        if len(sched.nodes) * dp * steps <= MAX_IMPACT_OPS else None
    del start, end
    name = spec.name or _default_name(job)
    meta = JobMeta(name=name, dp_size=dp, pp_size=job.pp, vpp_size=job.vpp, run_id=str(job.seed),
                   extra={"ground_truth": msgspec.to_builtins(injected_causes(job, costs,
                                                                              impacts)),
                          "generator": {"tool": "stragglers.trace.synth", "version": 1,
                                        **job.keywords(), **costs.notes()}})
    return Trace(ops, meta, source=f"<synthetic {name}>")


def upper_bound_ops(pp: int, vpp: int, microbatches: int) -> int:
    """At least the ops of one step of all of a DP rank's stages, without building the schedule:
    per stage, model chunk and microbatch a forward, a backward and up to four transfers, plus
    each stage's collectives, optimizer and GC slots."""
    return pp * (vpp * microbatches * 6 + 8 + vpp * microbatches)


def _check_size(job: Job, ops: int) -> None:
    if ops > MAX_OPS:
        raise InputError(SOURCE, "steps", f"dp={job.dp}, pp={job.pp}, vpp={job.vpp}, microbatches="
                         f"{job.microbatches} and steps={job.steps} make about {ops:,} ops; the "
                         f"generator keeps ~100 bytes per op in memory and takes at most "
                         f"{MAX_OPS:,}")


def _check_usable(ops: dict[str, np.ndarray], job: Job) -> None:
    """Refuse parameters whose trace the loaders would refuse (overflowing or unresolvable times)."""
    from stragglers.trace.columns import check_values

    try:
        check_values(ops, SOURCE)
    except InputError as exc:
        given = {k: v for k, v in job.keywords().items()
                 if k in ("noise",) + KEYWORDS and v is not None}
        raise InputError(SOURCE, None, f"these sizes make a trace no loader accepts "
                         f"({exc.field}: {exc.problem}); lower the noise or the injected "
                         f"factors and lengths (given: {given})") from None


# Measuring impacts replays the job once per injected cause; skipped for big jobs.
MAX_IMPACT_OPS = 2_000_000
MAX_OPS = 200_000_000


def mean_step_time(start: np.ndarray, end: np.ndarray, dp: int, steps: int) -> float:
    """Mean over steps of (last end - first start) over all workers."""
    first = start.reshape(len(start), steps, dp).min(axis=(0, 2))
    last = end.reshape(len(end), steps, dp).max(axis=(0, 2))
    return float((last - first).mean())


def measure_impacts(sched: StepGraph, job: Job, start: np.ndarray,
                    end: np.ndarray) -> dict[str, float]:
    """Per injected cause: mean step time with it / without it (all other draws unchanged).

    An injection can have no effect (a slow collective on a stage with slack before the clip),
    which a diagnosis test should know.
    """
    dp, steps = job.dp, job.steps
    with_all = mean_step_time(start, end, dp, steps)
    impacts = {}
    for cause, _ in job.injected():
        costs = sample_costs(sched, job.without(cause))
        s, e = run_forward(sched, costs, dp, steps)
        impacts[cause] = with_all / mean_step_time(s, e, dp, steps)
    return impacts


def _default_name(job: Job) -> str:
    causes = [k for k, _ in job.injected()]
    return (f"synth-dp{job.dp}-pp{job.pp}-vpp{job.vpp}-{'+'.join(causes) or 'noise'}-"
            f"seed{job.seed}")


def step_begin(sched: StepGraph, costs: Costs, dp: int) -> np.ndarray:
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


def run_forward(sched: StepGraph, costs: Costs, dp: int,
                steps: int) -> tuple[np.ndarray, np.ndarray]:
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
    assert barrier_start is not None, "the schedule has no barrier"
    offset = np.repeat(np.concatenate([[0.0], np.cumsum(barrier_start)[:-1]]), dp)
    start += offset
    end += offset
    return start, end


def assemble_ops(sched: StepGraph, costs: Costs, start: np.ndarray, end: np.ndarray,
                 dp: int, steps: int) -> dict[str, np.ndarray]:
    """Op-table columns: rows grouped by rank, then step, then schedule position; a rank's
    (sparse) GC pauses follow its other rows."""
    cols = dp * steps
    gc_code = optype_code("gc")
    stage_ids = [np.array([i for i in ids if sched.nodes[i].code != gc_code], dtype=np.int64)
                 for ids in sched.by_stage]
    n_gc = int(costs.gc_active.sum()) if costs.gc_active is not None else 0
    total = sum(len(ids) for ids in stage_ids) * cols + n_gc
    out = {name: np.empty(total, dtype=dtype) for name, dtype in COLUMNS.items()}
    if costs.attn_cost is not None:
        out["attn_cost"] = np.empty(total)
        out["tokens"] = np.empty(total, dtype=np.int64)
    offset = 0
    for stage, ids in enumerate(stage_ids):
        nodes = [sched.nodes[i] for i in ids]
        n, size = len(ids), len(ids) * cols
        # each column's rows of this stage as a (dp, step, node) view: numpy writes the
        # transposed schedule matrices straight into the table, without temporaries
        view = {k: v[offset:offset + size].reshape(dp, steps, n) for k, v in out.items()}
        codes = np.array([nd.code for nd in nodes], dtype=np.int8)
        view["dp_rank"][...] = np.arange(dp, dtype=np.int32)[:, None, None]
        view["rank"][...] = (np.arange(dp, dtype=np.int32) + stage * dp)[:, None, None]
        view["stage"][...] = stage
        view["step"][...] = np.arange(steps, dtype=np.int64)[None, :, None]
        view["optype"][...] = codes
        view["seq_id"][...] = _static_seq_ids(codes)
        view["mb_id"][...] = np.array([nd.mb for nd in nodes])
        view["mc"][...] = np.array([nd.chunk for nd in nodes])
        view["gmc"][...] = np.array([nd.chunk * sched.pp + stage
                                     if nd.optype in FORWARD_BACKWARD else -1 for nd in nodes])
        contiguous = ids[-1] - ids[0] + 1 == n
        node_start = start[ids[0]:ids[-1] + 1] if contiguous else start[ids]
        view["start_ts"][...] = _by_worker(node_start, steps, dp)
        node_end = end[ids[0]:ids[-1] + 1] if contiguous else end[ids]
        view["duration"][...] = _by_worker(node_end - node_start, steps, dp)
        if costs.attn_cost is not None:
            fb = np.flatnonzero([nd.optype in FORWARD_BACKWARD for nd in nodes])
            view["attn_cost"][...] = np.nan
            view["attn_cost"][:, :, fb] = _by_worker(
                costs.attn_cost[[nodes[i].mb for i in fb]], steps, dp)
            view["tokens"][...] = np.where(np.isin(np.arange(n), fb), costs.tokens, -1)
        offset += size
        del view  # the views would keep old columns alive through the reordering below
    if n_gc:
        _put_gc_pauses(sched, costs, start, end, dp, out, offset)
        # keep every rank's rows together (what a run directory holds per file)
        order = np.argsort(out["rank"], kind="stable")
        for k in out:  # one column at a time: peak memory grows by one column, not the table
            out[k] = out[k][order]
    return out


def _put_gc_pauses(sched: StepGraph, costs: Costs, start: np.ndarray, end: np.ndarray, dp: int,
                   out: dict[str, np.ndarray], offset: int) -> None:
    """Append the rows of the GC pauses that happened (absent slots are not ops)."""
    active = costs.gc_active
    assert active is not None, "called for a job with GC pauses"
    # seq_id: ordinal among the pauses of the same worker and step (slots are in stream order)
    ordinal = np.cumsum(active, axis=0, dtype=np.int32) - 1
    for stage in range(sched.pp):
        slots = np.flatnonzero([sched.nodes[i].stage == stage for i in costs.gc_rows])
        if not len(slots):
            continue
        first_slot = slots[0]
        slot, col = np.nonzero(active[slots])
        slot += first_slot
        node = costs.gc_rows[slot]
        rows = slice(offset, offset + len(slot))
        d = (col % dp).astype(np.int32)
        out["dp_rank"][rows] = d
        out["rank"][rows] = d + stage * dp
        out["stage"][rows] = stage
        out["step"][rows] = col // dp
        out["optype"][rows] = optype_code("gc")
        out["start_ts"][rows] = start[node, col]
        out["duration"][rows] = end[node, col] - start[node, col]
        out["seq_id"][rows] = ordinal[slot, col] - (ordinal[first_slot - 1, col] + 1
                                                    if first_slot else 0)
        out["mb_id"][rows] = -1
        out["mc"][rows] = np.array([sched.nodes[i].chunk for i in costs.gc_rows])[slot]
        out["gmc"][rows] = -1
        if "attn_cost" in out:
            out["attn_cost"][rows] = np.nan
            out["tokens"][rows] = -1
        offset += len(slot)


def _by_worker(matrix: np.ndarray, steps: int, dp: int) -> np.ndarray:
    """(nodes, steps*dp) as a (dp, step, node) view, the row order of the table."""
    return matrix.reshape(len(matrix), steps, dp).transpose(2, 1, 0)


def _static_seq_ids(codes: np.ndarray) -> np.ndarray:
    """Ordinal of each node among the nodes of its op type (stream order = start order)."""
    seq = np.empty(len(codes), dtype=np.int32)
    counts: dict[int, int] = {}
    for i, c in enumerate(codes.tolist()):
        seq[i] = counts.get(c, 0)
        counts[c] = seq[i] + 1
    return seq
