"""Long compute ops are taken for GC pauses only where the trace could not record the pauses:
our recorder (attach) writes every pause of the collector as a gc row, so in its traces long
compute ops without gc rows are no GC (on a loaded CPU: preemption)."""

from __future__ import annotations

from stragglers.trace.synth import generate
from stragglers.whatif import analyze


def test_compute_outliers_are_gc_only_where_no_recorder_wrote_the_pauses():
    inferred = generate(dp=4, pp=2, microbatches=8, steps=8, seed=6, gc_in_compute=(0.3, 0.2))
    assert analyze(inferred).diagnosis[0].cause == "gc"
    recorded = generate(dp=4, pp=2, microbatches=8, steps=8, seed=6, gc_in_compute=(0.3, 0.2))
    recorded.meta.extra["recorder"] = {"gc_min_s": 50e-6, "sample_every": 1}
    assert "gc" not in {f.cause for f in analyze(recorded).diagnosis}
