"""Persistent or intermittent: a fault on (nearly) every step has no step list, even with spikes."""

from __future__ import annotations

import numpy as np

from stragglers.trace.synth import generate
from stragglers.whatif import analyze_with_model
from stragglers.whatif.causes import Context
from stragglers.whatif.config import DEFAULT


def _context(steps: int = 20) -> Context:
    trace = generate(dp=2, pp=1, microbatches=2, steps=steps, seed=1, sync="ddp")
    _, w = analyze_with_model(trace, steps="all")
    return Context.build(w, trace, DEFAULT)


def test_a_persistent_effect_with_spikes_is_persistent():
    ctx = _context()
    per_step = np.full(20, 3.88)             # ×4.88 on every step ...
    per_step[[3, 7, 11, 15, 19]] = 9.0       # ... and a few steps far worse
    assert ctx.steps_where(per_step) is None


def test_an_intermittent_effect_names_its_steps():
    ctx = _context()
    per_step = np.full(20, 0.02)             # noise
    per_step[[3, 7, 11]] = 3.88
    assert ctx.steps_where(per_step) == [int(ctx.w.grid.steps[i]) for i in (3, 7, 11)]


def test_a_slow_worker_on_every_step_reads_as_persistent():
    trace = generate(dp=4, pp=1, microbatches=4, steps=40, seed=3, sync="ddp",
                     slow_worker=(1, 0, 4.88))
    result, _ = analyze_with_model(trace)
    fault = [f for f in result.diagnosis if f.cause == "worker_fault"]
    assert fault and not fault[0].where.steps and "only in steps" not in fault[0].evidence
