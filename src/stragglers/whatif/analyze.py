"""The whole what-if analysis of one trace, as the result dict that reports and --json use."""

from __future__ import annotations

from typing import Callable

import numpy as np

from stragglers.trace.model import Trace
from stragglers.whatif.diagnosis import diagnose
from stragglers.whatif.grid import build_grid
from stragglers.whatif.metrics import DECOMPOSE_THRESHOLD, WhatIf
from stragglers.whatif.replay import replay


def analyze(trace: Trace, steps: list[int] | None = None,
            progress: Callable[[str], None] | None = None) -> dict:
    """S and its decompositions, M_W, M_S and the diagnosis (specs/whatif.md §4–§7)."""
    result, _ = analyze_with_model(trace, steps, progress)
    return result


def analyze_with_model(trace: Trace, steps: list[int] | None = None,
                       progress: Callable[[str], None] | None = None) -> tuple[dict, WhatIf]:
    """Like analyze(), also returning the WhatIf object (for timelines and custom what-ifs)."""
    tick = progress or (lambda _msg: None)
    tick("laying ops on the schedule grid")
    grid = build_grid(trace, steps)
    tick("dependency model")
    w = WhatIf.build(grid, trace.meta.dsp_size, tick)
    s = w.slowdown
    by_optype = by_stage = by_dp = {}
    scores: list[dict] = []
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
    diagnosis = diagnose(w, trace, by_optype, by_stage, by_dp, scores, m_w or 0.0, top)
    meta = trace.meta
    result = {
        "job": {"name": meta.name, "run_id": meta.run_id, "dp": meta.dp_size, "pp": meta.pp_size,
                "tp": meta.tp_size, "dsp": meta.dsp_size, "vpp": meta.vpp_size,
                "world_size": meta.world_size, "steps": int(len(grid.steps)), "ops": int(len(trace)),
                "source": trace.source},
        "slowdown": s,
        "waste": 1 - 1 / s,
        "straggling": s >= 1.1,
        "sim_error": w.sim_error,
        "launch_slowdown": w.launch_slowdown,
        "T_base": float(w.t_base.mean()),
        "T_nodelay": float(w.t_nodelay.mean()),
        "T_ideal": float(w.t_ideal.mean()),
        "step_slowdown": w.step_slowdown(),
        "step_times": {
            "base": _per_step(grid.steps, w.t_base), "replay": _per_step(grid.steps, w.t_replay),
            "nodelay": _per_step(grid.steps, w.t_nodelay), "ideal": _per_step(grid.steps, w.t_ideal)},
        "ideal_durations": w.ideal_values,
        "by_optype": by_optype,
        "by_stage": by_stage,
        "by_dp_rank": by_dp,
        "worker_scores": scores,
        "M_W": m_w,
        "M_S": m_s,
        "diagnosis": diagnosis,
        "warnings": list(grid.warnings),
    }
    return result, w


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
    sub = Trace({k: v[rows] for k, v in trace.ops.items()}, trace.meta, trace.source)
    offset = shift[present][order]
    measured_start = sub.ops["start_ts"] + offset
    measured = (measured_start, measured_start + sub.ops["duration"])
    ideal = (start[present][order] + offset, end[present][order] + offset)
    return sub, {"measured": measured, "ideal": ideal}
