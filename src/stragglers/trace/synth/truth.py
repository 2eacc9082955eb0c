"""The injected causes of a synthetic job, written down as what a diagnosis should find.

`generate` records them in the trace's metadata (`meta.extra["ground_truth"]`, plain JSON
values, so a written trace keeps them); `ground_truth(trace)` reads them back as typed
`InjectedCause`s.
"""

from __future__ import annotations

from typing import Any, Sequence

import msgspec
import numpy as np

from stragglers.errors import InputError
from stragglers.trace.model import Trace
from stragglers.trace.synth.durations import Costs
from stragglers.trace.synth.injections import SlowLink
from stragglers.trace.synth.validate import Job

P2P_OPTYPES = ["forward-send", "forward-recv", "backward-send", "backward-recv"]


class CauseWhere(msgspec.Struct, omit_defaults=True):
    """Where an injected cause sits; a dimension left out (None) is not narrowed."""

    dp: list[int] | None = None
    pp: list[int] | None = None
    steps: list[int] | None = None   # an intermittent cause's steps


class InjectedCause(msgspec.Struct):
    """One injected cause: the diagnosis cause it is, where, its parameters, what it costs.

    `params`: the injection as the generator's metadata records it, plus what sampling it
    gave (gc: pauses, pause_s; sequence imbalance: attn_cost_cv, cost_cv; a slow link: the
    optypes it slows). `impact`: mean step time with it / without it (None for jobs too big
    to measure).
    """

    cause: str
    where: CauseWhere
    params: dict[str, Any]
    impact: float | None = None


def injected_causes(job: Job, costs: Costs,
                    impacts: dict[str, float] | None) -> list[InjectedCause]:
    """The ground truth of `job`, cause by cause (the metadata records it as plain values)."""
    truth: list[InjectedCause] = []

    def add(keyword: str, cause: str, where: CauseWhere, params: dict[str, Any]) -> None:
        impact = None if impacts is None else round(impacts[keyword], 6)
        truth.append(InjectedCause(cause, where, params, impact))

    if job.slow_worker is not None:
        slow = job.slow_worker
        add("slow_worker", "worker_fault", CauseWhere([slow.dp], [slow.stage]),
            {"factor": slow.factor})
    if job.heavy_last_stage is not None:
        add("heavy_last_stage", "stage_imbalance", CauseWhere(pp=[job.pp - 1]),
            {"factor": job.heavy_last_stage.factor})
    if job.seq_imbalance is not None:
        add("seq_imbalance", "sequence_imbalance", CauseWhere(),
            {**job.seq_imbalance.record(), "attn_cost_cv": costs.attn_cost_cv,
             "cost_cv": costs.cost_cv})
    if job.gc is not None:
        assert costs.gc_active is not None and costs.gc_slot_stage is not None
        active = costs.gc_active
        add("gc", "gc", _pause_where(job, active, costs.gc_slot_stage),
            {"rate": job.gc.rate, "length_s": job.gc.seconds, "pauses": int(active.sum()),
             "pause_s": float(costs.duration[costs.gc_rows][active].sum())})
    if job.slow_link is not None:
        link = job.slow_link
        if isinstance(link, SlowLink):
            where = CauseWhere([link.dp], sorted([link.stage_from, link.stage_to]))
            optypes = P2P_OPTYPES
        else:
            where = CauseWhere(pp=list(range(job.pp)) if link.stage is None else [link.stage])
            optypes = [link.optype]
        where.steps = _listed(link.steps)
        add("slow_link", "communication", where, {**link.record(), "optypes": optypes})
    if job.host_stall is not None:
        stall = job.host_stall
        add("host_stall", "host_stall",
            CauseWhere([stall.dp], [stall.stage], _listed(stall.steps)), {"seconds": stall.seconds})
    if job.gc_in_compute is not None:
        assert costs.pause_cells is not None
        active = costs.pause_cells.active
        add("gc_in_compute", "gc", _pause_where(job, active, costs.pause_cells.stages),
            {"rate": job.gc_in_compute.rate, "length_s": job.gc_in_compute.seconds,
             "pauses": int(active.sum()), "in_compute": True})
    return truth


def ground_truth(trace: Trace) -> list[InjectedCause]:
    """The injected causes a synthetic trace records ([] for any other trace)."""
    recorded = trace.meta.extra.get("ground_truth", [])
    try:
        return msgspec.convert(recorded, list[InjectedCause])
    except msgspec.ValidationError as exc:
        raise InputError(trace.source, "ground_truth", f"expected the generator's injected "
                         f"causes: {exc}") from None


def _listed(steps: Sequence[int] | None) -> list[int] | None:
    return None if steps is None else list(steps)


def _pause_where(job: Job, active: np.ndarray, stages: np.ndarray) -> CauseWhere:
    """The workers, stages and steps where GC pauses landed (active: slots × columns)."""
    cols = np.flatnonzero(active.any(axis=0))
    return CauseWhere(sorted(set((cols % job.dp).tolist())),
                      sorted(set(stages[active.any(axis=1)].tolist())),
                      sorted(set((cols // job.dp).tolist())))
