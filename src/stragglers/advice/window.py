"""One window of in-job step timings as an op table, so `advise` can replay it (no torch).

Each rank times its own step: host work before the forward, forward, backward up to the moment
the gradient sync is called (the DDP hook fires), the sync's completion, the optimizer, and the
GC pause time inside the forward and the backward. Laid out as forward-compute,
backward-compute, grads-all-reduce and optimizer rows (a gc row where a compute op held a pause,
moved before it as the recorder does), it is a DDP-shaped trace
(pp = 1) of the job's own recent steps. All times must come from one clock (one host's
perf_counter, or offsets corrected).
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, fields
from collections.abc import Mapping
from typing import Any

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.model import JobMeta, Trace


@dataclass(frozen=True)
class StepTiming:
    """One rank's step: absolute seconds on a shared clock, its batch and gradient bytes."""

    rank: int
    step: int
    start: float
    forward_start: float
    forward_end: float
    backward_end: float     # gradients ready: the sync was called
    sync_end: float         # the averaged gradients are back
    optimizer_end: float
    batch: int
    nbytes: int = -1
    gc_forward_s: float = 0.0   # GC pause time inside the forward ...
    gc_backward_s: float = 0.0  # ... and inside the backward (each becomes a gc op before it)

    def as_row(self) -> list[float]:
        """The timing as floats, for an all_gather across ranks."""
        return [float(x) for x in astuple(self)]

    @classmethod
    def from_row(cls, row) -> "StepTiming":
        """Inverse of as_row."""
        values: dict[str, Any] = {f.name: int(round(float(x))) if f.type in ("int", int)
                                  else float(x) for f, x in zip(fields(cls), row)}
        return cls(**values)

    @property
    def step_s(self) -> float:
        """This rank's step time."""
        return self.optimizer_end - self.start


ROW_WIDTH = len(fields(StepTiming))


def window_step_time(steps: list[list[StepTiming]]) -> float:
    """Mean over steps of (last optimizer end − first start) over ranks."""
    return float(np.mean([max(t.optimizer_end for t in s) - min(t.start for t in s) for s in steps]))


def window_trace(steps: list[list[StepTiming]], name: str = "window",
                 global_batch: int | None = None,
                 calibration: Mapping[str, object] | None = None) -> Trace:
    """The op table of a window: `steps[i]` holds every rank's StepTiming of one step.

    `calibration` (the job's calibration step: compute_curves, gc_sync_pause_s) goes into the
    metadata's extra, where `advise` reads it.
    """
    if not steps or not steps[0]:
        raise InputError("window", "steps", "expected at least one step with every rank's timing")
    n = len(steps[0])
    rows: dict[str, list] = {k: [] for k in ("rank", "dp_rank", "stage", "step", "optype",
                                             "start_ts", "duration", "seq_id", "mb_id", "mc",
                                             "gmc", "bytes", "tokens")}

    def add(t: StepTiming, optype: str, start: float, end: float, mb: int = -1) -> None:
        for k, v in (("rank", t.rank), ("dp_rank", t.rank), ("stage", 0), ("step", t.step),
                     ("optype", optype), ("start_ts", start), ("duration", max(end - start, 0.0)),
                     ("seq_id", 0), ("mb_id", mb), ("mc", 0), ("gmc", 0 if mb >= 0 else -1),
                     ("bytes", t.nbytes if optype == "grads-all-reduce" else -1),
                     ("tokens", t.batch if optype == "forward-compute" else -1)):
            rows[k].append(v)

    for step in steps:
        if len(step) != n or sorted(t.rank for t in step) != list(range(n)):
            raise InputError("window", "steps", f"expected one timing per rank 0..{n - 1} in "
                             f"every step, got ranks {sorted(t.rank for t in step)}")
        for t in step:
            f0, f1, b1 = t.forward_start, t.forward_end, max(t.backward_end, t.forward_end)
            g1 = min(max(t.gc_forward_s, 0.0), f1 - f0)
            g2 = min(max(t.gc_backward_s, 0.0), b1 - f1)
            if g1 > 0:
                add(t, "gc", f0, f0 + g1)
            add(t, "forward-compute", f0 + g1, f1, 0)
            if g2 > 0:
                add(t, "gc", f1, f1 + g2)
            add(t, "backward-compute", f1 + g2, b1, 0)
            add(t, "grads-all-reduce", b1, t.sync_end)
            add(t, "optimizer", t.sync_end, t.optimizer_end)
    extra: dict[str, Any] = {"global_batch": global_batch or sum(t.batch for t in steps[0])}
    if calibration:
        extra["calibration"] = dict(calibration)
    meta = JobMeta(name=name, dp_size=n, pp_size=1, extra=extra)
    return Trace.from_rows(rows, meta, source=f"<{name}>")
