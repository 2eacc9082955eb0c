"""The detectors that pair a microbatch's ops across stages (sequence load, the microbatch
factor, a worker-step's longest microbatch) read which microbatch an op holds from each
worker-step's own rows, not from the first DP replica's: a first rank numbering its
microbatches otherwise (its seq_ids lie) paired, on the honest replicas, one microbatch's
ops with another's on the other stages, and the sequence imbalance was missed (dp 3 × pp 2,
no Σs² columns, seed 2); read from the replica-step the model read instead, the lying
replica's honest worker was named a worker fault (seed 0). gc's grouping of a microbatch's
ops reads each worker-step's own rows too: from the first replica's rows, GC pauses beside
the sequences were named on 4 of 6 workers and the sequences missed; from the stage's
reference replica-step, the lying replica's ops were grouped with other microbatches' and
pauses it did not have were found (seeds 3 and 4: 31 and 25 pauses, 23 and 21 honest)."""

from __future__ import annotations

import re

import pytest
from possible_traces import lying

from stragglers.trace.synth import generate
from stragglers.whatif import analyze
from stragglers.whatif.causes.sequence import MicrobatchCells, microbatch_nodes, microbatch_rows
from stragglers.whatif.grid import FWD, build_grid
from stragglers.whatif.metrics import WhatIf


def _sequences_without_lens(seed: int, lie: bool = True, **causes):
    trace = generate(dp=3, pp=2, microbatches=4, steps=8, seed=seed,
                     seq_imbalance={"dist": "lognormal"}, **causes)
    for column in ("attn_cost", "tokens"):
        trace.ops.pop(column, None)
    if not lie:
        return trace
    # rank 0 (dp 0, pp 0) numbers its forward and backward microbatches the other way round
    return lying(lying(trace, 0, "forward-compute", "reverse"), 0, "backward-compute", "reverse")


@pytest.mark.parametrize("seed", [0, 2])
def test_a_renumbering_first_rank_hides_no_sequences_and_names_no_honest_worker(seed):
    result = analyze(_sequences_without_lens(seed))
    found = [(f.cause, f.where.ranks) for f in result.diagnosis]
    assert "sequence_imbalance" in [cause for cause, _ in found], found
    # (the lying rank's rows, out of the model's order, read as its own host's stall)
    assert {r for _, ranks in found for r in ranks} <= {0}, found


def test_a_renumbering_first_rank_leaves_gc_pauses_on_every_worker():
    # GC pauses inside compute beside the sequences: gc's microbatches keyed by the first
    # replica's rows named the pauses of ranks 2-5 only and missed the sequences (gc's lookup
    # alone back on the first replica: the same)
    result = analyze(_sequences_without_lens(0, gc_in_compute=(0.5, 0.4)))
    found = {f.cause: f.where.ranks for f in result.diagnosis}
    assert found == {"host_stall": [0], "sequence_imbalance": [], "gc": [0, 1, 2, 3, 4, 5]}, found


def _pauses(trace) -> tuple[int, list[int]]:
    """(pauses gc found inside compute, their ranks)."""
    gc = [f for f in analyze(trace).diagnosis if f.cause == "gc"]
    assert gc, "no gc finding"
    return int(re.match(r"(\d+) forward/backward ops", gc[0].evidence).group(1)), gc[0].where.ranks


@pytest.mark.parametrize("seed", [0, 3, 4])
def test_a_renumbering_rank_adds_no_pauses_to_gc(seed):
    # the lying replica's ops grouped by the reference replica-step's microbatches: their
    # shared factor taken from another microbatch's ops, pauses it did not have stood out
    honest = _pauses(_sequences_without_lens(seed, lie=False, gc_in_compute=(0.5, 0.4)))
    assert _pauses(_sequences_without_lens(seed, gc_in_compute=(0.5, 0.4))) == honest


def test_each_worker_step_holds_the_microbatches_its_rows_name():
    trace = _sequences_without_lens(0)
    w = WhatIf.build(build_grid(trace))
    nodes = microbatch_nodes(w, trace, 0, FWD)
    cells = MicrobatchCells(w, trace, [nodes])
    held = cells.ids[cells.index[0]]                                   # [n, D, T]
    rows = w.grid.row[nodes]
    assert (rows >= 0).all() and (held == trace.ops["mb_id"][rows]).all()
    # the honest replicas agree with each other, the lying one holds them the other way round
    assert (held[:, 1] == held[:, 2]).all() and (held[:, 0] == held[::-1, 1]).all()
    # what a template op is (gc's microbatches, model chunks) is read where the model read
    # its order: stage 0's reference is another replica than the lying first one
    d_ref, t_ref = w.model.ref_cells
    assert d_ref[0] != 0
    assert (w.grid.row[nodes, d_ref[0], t_ref[0]] == microbatch_rows(w, nodes)).all()
