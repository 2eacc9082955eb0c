"""A worker's rows that its own timeline cannot hold (timing.clip_to_own_timeline): a GC pause
through the rank's own ops, a send starting before the compute that feeds it; and two GC
pauses side by side in one slot (grid.gc_slots). Red team round 13, findings 3-5."""

from __future__ import annotations

import numpy as np

from stragglers.trace.model import OPTYPE_CODES, Trace
from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif._analyze import analyze_with_model
from stragglers.whatif.grid import GC, GC_WITHIN

SEND = OPTYPE_CODES["backward-send"]
FWD = OPTYPE_CODES["forward-compute"]


def _healthy() -> Trace:
    return generate(dp=2, pp=2, microbatches=4, steps=8, seed=0)


def _with_rows(trace: Trace, add: dict) -> Trace:
    """`trace` with the rows `add`, in the recorder's order (step, start)."""
    o = trace.ops
    merged = {k: np.concatenate([o[k], add[k]]) for k in o}
    order = np.lexsort((merged["start_ts"], merged["step"]))
    return Trace({k: v[order] for k, v in merged.items()}, trace.meta)


def _cut(result) -> list[str]:
    return [w for w in result.warnings if w.startswith("rows cut to their worker's own")]


def test_a_gc_pause_through_its_ranks_own_ops_costs_only_the_time_they_leave_free():
    """Rank 3 writes a 0.2 s pause (about 2/3 of a step) at each step's first op while its ops
    run on time inside it: read at face value S 1.25 (a healthy job straggling); cut to the
    time its own ops leave free, the job reads healthy and the warning names the pauses."""
    trace = _healthy()
    o = trace.ops
    sel = np.flatnonzero(o["rank"] == 3)
    _, first = np.unique(o["step"][sel], return_index=True)
    rows = sel[first]
    add = {k: v[rows].copy() for k, v in o.items()}
    add["optype"][:] = GC
    add["mb_id"][:] = -1
    add["seq_id"][:] = 0
    add["duration"] = np.full(len(rows), 0.2)
    result = analyze(_with_rows(trace, add))
    assert result.slowdown < 1.1, result.slowdown
    assert [f.cause for f in result.diagnosis] == ["none"], result.diagnosis
    assert "GC pauses through their rank's own compute" in _cut(result)[0], result.warnings
    assert _cut(result)[0].endswith("workers (dp 1, pp 1))"), result.warnings


def test_gc_pauses_in_free_time_are_kept_whole():
    """The generator's pauses fall where their worker waits for nothing (before a forward):
    every one keeps its measured length, nothing is cut, and the GC job is still found."""
    trace = generate(dp=2, pp=2, microbatches=4, steps=8, seed=3, gc=(0.5, 0.05))
    result, w = analyze_with_model(trace)
    g = w.grid
    pauses = g.node_optype == GC
    rows = g.row[pauses][g.present[pauses]]
    np.testing.assert_array_equal(g.duration[pauses][g.present[pauses]],
                                  trace.ops["duration"][rows])
    assert _cut(result) == []
    assert "gc" in [f.cause for f in result.diagnosis], result.diagnosis


def test_a_send_starting_before_the_compute_that_feeds_it_is_charged_from_its_end():
    """Rank 3's backward-sends written 0.05 s earlier, ends kept (before the ~0.04 s backward
    that produces their gradient started): read at face value S 1.19; charged from the
    backward's end, healthy, the warning naming the sends."""
    trace = _healthy()
    o = trace.ops
    sel = (o["rank"] == 3) & (o["optype"] == SEND)
    ops = {**o, "start_ts": np.where(sel, o["start_ts"] - 0.05, o["start_ts"]),
           "duration": np.where(sel, o["duration"] + 0.05, o["duration"])}
    result = analyze(Trace(ops, trace.meta))
    assert result.slowdown < 1.1, result.slowdown
    assert [f.cause for f in result.diagnosis] == ["none"], result.diagnosis
    assert "sends starting before the compute op they follow" in _cut(result)[0]


def test_a_healthy_job_is_not_cut():
    """A job whose rows are its schedule's (transfers overlapping compute on their own
    streams): nothing cut, the same S as the rows read as they are."""
    result = analyze(_healthy())
    assert _cut(result) == [] and result.slowdown < 1.05


def test_two_gc_pauses_in_one_slot_are_both_replayed():
    """Rank 3 records two pauses back to back after its first forward of each step (a gen-0
    collection and the gen-2 one it set off): once an error 'two ops share (... optype=gc,
    seq_id=0)'; now the second is a cell of its own after the first, both in the grid."""
    trace = generate(dp=2, pp=2, microbatches=4, steps=8, seed=0, slow_worker=(0, 0, 3.0))
    o = trace.ops
    fc = np.flatnonzero((o["rank"] == 3) & (o["optype"] == FWD) & (o["mb_id"] == 0))
    add = {k: np.concatenate([v[fc], v[fc]]) for k, v in o.items()}
    end = np.concatenate([o["start_ts"][fc] + o["duration"][fc]] * 2)
    add["optype"][:] = GC
    add["mb_id"][:] = -1
    add["seq_id"] = np.repeat(np.array([0, 1], np.int32), len(fc))
    add["start_ts"] = end + np.repeat([0.0, 2e-6], len(fc))
    add["duration"] = np.full(2 * len(fc), 1e-6)
    result, w = analyze_with_model(_with_rows(trace, add))
    g = w.grid
    pauses = np.flatnonzero(g.node_optype == GC)
    assert sorted(g.node_seq[pauses] // GC_WITHIN) == [0, 1], g.node_seq[pauses]
    assert g.present[pauses].sum() == 2 * len(g.steps)
    assert result.slowdown > 1.15 and result.diagnosis[0].cause == "worker_fault"
