"""The whole what-if analysis of one trace, as the AnalysisResult that reports and --json use."""

from __future__ import annotations

from typing import Callable

import numpy as np
from msgspec.structs import replace

from stragglers.errors import InputError
from stragglers.trace.model import Trace
from stragglers.whatif.config import DEFAULT, DiagnosisConfig
from stragglers.whatif.diagnosis import Coverage, diagnose
from stragglers.whatif.grid import build_grid
from stragglers.whatif.warmup import warmup_steps
from stragglers.whatif.metrics import DECOMPOSE_THRESHOLD, WhatIf
from stragglers.whatif._replay import replay
from stragglers.whatif.result import (AnalysisResult, Finding, SlowStep, WorkerScore, job_info,
                                      plain, reader_notes)


def analyze(trace: Trace, steps: list[int] | str | None = None,
            progress: Callable[[str], None] | None = None,
            config: DiagnosisConfig | None = None) -> AnalysisResult:
    """S and its decompositions, M_W, M_S and the diagnosis (docs/whatif.md §4–§7).

    steps: None = every step but the warm-up (detected, named in the result); "all" = every
    step; a list = exactly those steps.
    """
    result, _ = analyze_with_model(trace, steps, progress, config)
    return result


def analyze_with_model(trace: Trace, steps: list[int] | str | None = None,
                       progress: Callable[[str], None] | None = None,
                       config: DiagnosisConfig | None = None
                       ) -> tuple[AnalysisResult, WhatIf]:
    """Like analyze(), also returning the WhatIf object (for timelines and custom what-ifs)."""
    cfg = config or DEFAULT
    tick = progress or (lambda _msg: None)
    tick("laying ops on the schedule grid")
    if isinstance(steps, str) and steps != "all":
        raise InputError(trace.source, "steps", f"expected a list of steps, None or 'all', "
                         f"got {steps!r}")
    grid = build_grid(trace, None if isinstance(steps, str) else steps)
    return analyze_grid(trace, grid, steps, tick, cfg)


def analyze_grid(trace: Trace, grid, steps, tick: Callable[[str], None], cfg: DiagnosisConfig,
                 build: Callable[..., WhatIf] = WhatIf.build, job_trace=None
                 ) -> tuple[AnalysisResult, WhatIf]:
    """The analysis of a trace laid on its grid: `build` makes the WhatIf (whatif/partitioned.py
    replays on a Dask cluster), `job_trace` holds the job's facts when `trace` holds only the
    grid's rows."""
    warmup = warmup_steps(grid, cfg) if steps is None else []
    if warmup:
        grid = grid.select_steps(~np.isin(grid.steps, warmup))
        grid.warnings.append(f"left out {len(warmup)} warm-up step(s) ({', '.join(map(str, warmup))}"
                             f"): slower than {cfg.warmup_factor}× the median step; "
                             "--steps all keeps them")
    tick("dependency model")
    w = build(grid, trace.meta.dsp_size, tick)
    if not w.t_ideal.mean() > 0:  # every duration zero: no step time to compare against
        raise InputError(trace.source, "duration", "every op in the analysed steps has zero "
                         "duration, so the slowdown is undefined; expected measured durations")
    s = w.slowdown
    by_optype = by_stage = by_dp = {}
    scores: list[WorkerScore] = []
    m_w = m_s = None
    top: list = []
    if s >= DECOMPOSE_THRESHOLD:
        by_optype = w.by_optype()
        by_stage = w.by_stage()
        by_dp = w.by_dp_rank()
        scores = w.worker_scores(by_dp, by_stage)
        tick("fix fractions M_W, M_S")
        m_w, top = w.m_w(scores)
        m_s = w.m_s()
    tick("diagnosis")
    job = job_info(trace if job_trace is None else job_trace, steps=len(grid.steps),
                   ops=int(grid.present.sum()), left_out=grid.left_out)
    partial = coverage(trace, job, w)
    diagnosis, diagnosis_summary = diagnose(
        w, trace, cfg, {(s_.dp, s_.pp): s_.score for s_ in scores} or None, partial)
    from stragglers.whatif.causes import Context

    ctx = Context.build(w, trace, cfg)      # global ranks and hosts, for the lists below
    scores = _with_ranks(scores, w, ctx)
    by_step = w.step_slowdown()
    straggling = _straggling(s, cfg, partial, diagnosis)
    if straggling is False:
        _label_below_threshold(diagnosis, s, w, cfg)
    result = AnalysisResult(
        job=job,
        slowdown=s,
        # a trace of some ranks cannot say whether the job straggles (unknown, not false)
        straggling=straggling,
        partial=partial is not None,
        straggling_threshold=cfg.straggling_slowdown,
        sim_error=w.sim_error,
        launch_slowdown=w.launch_slowdown,
        t_base=float(w.t_base.mean()),
        t_nodelay=float(w.t_nodelay.mean()),
        t_ideal=float(w.t_ideal.mean()),
        step_slowdown=by_step,
        slowest_steps=slowest_steps(w, ctx, by_step),
        step_times={
            "base": _per_step(grid.steps, w.t_base), "replay": _per_step(grid.steps, w.t_replay),
            "nodelay": _per_step(grid.steps, w.t_nodelay), "ideal": _per_step(grid.steps, w.t_ideal)},
        ideal_durations=plain(w.ideal_values),
        by_optype=plain(by_optype),
        by_stage=plain(by_stage),
        by_dp_rank=plain(by_dp),
        worker_scores=scores,
        m_w=m_w,
        m_s=m_s,
        diagnosis=diagnosis,
        warnings=[str(x) for x in grid.warnings],
        notes=reader_notes(trace),
        left_out=[replace(x, host=ctx.hosts.get(x.rank)) if x.rank is not None else x
                  for x in grid.left_out],
        diagnosis_summary=diagnosis_summary,
        steps_analysed=[int(x) for x in grid.steps],
        warmup_steps=[int(x) for x in warmup],
        diagnosis_config=cfg,
    )
    return result, w


def _straggling(s: float, cfg, partial, diagnosis: list[Finding]) -> bool | None:
    """The headline verdict: unknown on a partial trace; S ≥ the threshold, unless all of it is
    what jitter alone gives (the diagnosis then says `none`, and the headline agrees)."""
    if partial is not None:
        return None
    within_noise = len(diagnosis) == 1 and diagnosis[0].cause == "none"
    return s >= cfg.straggling_slowdown and not within_noise


def _label_below_threshold(diagnosis: list[Finding], s: float, w: WhatIf, cfg) -> None:
    """Causes found in a job that is not straggling say so, so no report lists a cause under a
    'not straggling' headline unlabelled: a duration cause is minor (S < the threshold); a
    host stall is counted in the launch-delay slowdown, which S leaves out."""
    for entry in diagnosis:
        if entry.cause in ("none", "unexplained", "partial"):
            continue
        entry.below_threshold = True
        if entry.cause == "host_stall":
            why = (f"the job is not straggling by S = {s:.3f} (< {cfg.straggling_slowdown}), "
                   f"which leaves out launch delays; they cost ×{w.launch_slowdown:.2f} on top, "
                   "and this is part of it")
        else:
            why = (f"minor: the job is not straggling (S = {s:.3f} < "
                   f"{cfg.straggling_slowdown})")
        entry.evidence = f"{why}; {entry.evidence}"


def coverage(trace: Trace, job, w: WhatIf) -> Coverage | None:
    """What part of its job a trace holds, when it is not the whole job (None: all of it)."""
    missing = trace.meta.extra.get("ranks_missing") or []
    if not missing and not job.missing_workers:
        return None
    world = int(trace.meta.world_size or job.world_size or 0)
    read = int(job.ranks_read)
    workers = len(w.grid.dp_ranks) * w.grid.pp_size
    left = len({x.rank for x in w.grid.left_out if x.rank is not None})
    return Coverage(read, max(world, read + left + len(missing)), workers, left)


def _with_ranks(scores: list[WorkerScore], w: WhatIf, ctx) -> list[WorkerScore]:
    """Worker scores with each worker's global rank and host (where the trace names them)."""
    index = {int(d): i for i, d in enumerate(w.grid.dp_ranks)}
    for s_ in scores:
        rank = int(ctx.ranks[index[s_.dp], s_.pp])
        s_.rank, s_.host = (rank if rank >= 0 else None), ctx.hosts.get(rank)
    return scores


# The slowest steps a result lists, each with the worker that computed longest in it.
SLOWEST_STEPS = 10
# A worker is named for a step where it took at least this much longer than its stage's median
# worker (below it, no one worker's compute made the step slow).
CULPRIT_RATIO = 1.05


def slowest_steps(w: WhatIf, ctx, by_step: dict[int, float]) -> list[SlowStep]:
    """The steps of highest slowdown (`by_step`: S per step), each with the worker whose busy
    compute (forward, backward, optimizer) was longest against its stage's median worker that
    step: who a stretch of slow steps waited for, where no cause is worth naming over the whole
    run (one worker of PAI's job_1 slow for a twentieth of it)."""
    from stragglers.whatif.causes.base import BUSY, per_worker_sum

    g = w.grid
    top = sorted(by_step.items(), key=lambda kv: -kv[1])[:SLOWEST_STEPS]
    if not top:
        return []
    busy = per_worker_sum(g.duration, g.node_stage, np.isin(g.node_optype, BUSY), g.pp_size)
    median = np.median(busy, axis=0, keepdims=True)                            # [1, P, T]
    ratio = np.where(median > 0, busy / np.maximum(median, 1e-300), 1.0)       # [D, P, T]
    column = {int(s): i for i, s in enumerate(g.steps)}
    out = []
    for step, value in top:
        t = column[step]
        d, p = np.unravel_index(int(np.argmax(ratio[:, :, t])), ratio.shape[:2])
        r = float(ratio[d, p, t])
        if len(g.dp_ranks) < 2 or r < CULPRIT_RATIO:
            out.append(SlowStep(step, value))
            continue
        out.append(SlowStep(step, value, ctx.where_workers([(int(d), int(p))]).workers[0], r))
    return out


def _per_step(steps, values) -> dict[int, float]:
    return {int(s): float(v) for s, v in zip(steps, values)}


def timelines(w: WhatIf, trace: Trace) -> tuple[Trace, dict]:
    """The analysed rows and their measured and ideal (start, end), for Perfetto export.

    Steps are laid end to end on one axis (traces may restart the clock every step), at the
    same offsets in both timelines so they can be compared side by side.
    """
    _, start, end = replay(w.plan, w.ideal, w.step_start, keep_timeline=True)
    present = w.grid.present
    start = np.broadcast_to(start, present.shape)
    end = np.broadcast_to(end, present.shape)
    span = np.maximum(w.t_base, w.t_ideal) * 1.05
    shift = np.concatenate([[0.0], np.cumsum(span)[:-1]]) - w.step_start       # [T]
    shift = np.broadcast_to(shift, present.shape)
    rows = w.grid.row[present]
    order = np.argsort(rows)
    rows = rows[order]
    sub = Trace({k: v[rows] for k, v in trace.ops.items()}, trace.meta, trace.source, trace.notes)
    offset = shift[present][order]
    measured_start = sub.ops["start_ts"] + offset
    measured = (measured_start, measured_start + sub.ops["duration"])
    ideal = (start[present][order] + offset, end[present][order] + offset)
    return sub, {"measured": measured, "ideal": ideal}

