"""A transfer that its host's other ranks computed beside is no slow link of its own.

The fixture (tests/data/recorded/pp2-clean-profiler-one-cpu-beside-hogs): the clean dp 2 × pp 2
job of tests/trace/test_kineto_recorded.py (`kineto_profile_job.py --pp 2 --steps 16`, every
rank on CPU 0 as the fixture runs it, torchrun on gloo) beside four `while True: pass` hogs
(load 18–26 with other agents' work, 2026-12-07 02:49 UTC, commit 42a65bb), its PyTorch-profiler
traces converted to the run format (`stragglers convert`). A profiler trace records no CPU
waits. The first stage's all-reduce is short and it starts the next step's forward at once;
the last stage's all-reduce (ranks 1 and 3, one DP group) runs beside that forward on the one
CPU and takes 2–6× as long. Here it is ≥ 2× the median in a few steps, and the communication
detector named ranks [1, 3] there, a candidate whose gain the gate happened to drop; CI's run
had it late in most steps, and its diagnosis named `communication` at [1, 3], persistent.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from stragglers.trace.load import load_trace
from stragglers.trace.model import Trace
from stragglers.whatif import analyze
from stragglers.whatif._analyze import analyze_with_model
from stragglers.whatif.causes import Context, communication
from stragglers.whatif.config import DEFAULT
from stragglers.whatif.partitioned import analyze_run

RUN = Path(__file__).parents[1] / "data" / "recorded" / "pp2-clean-profiler-one-cpu-beside-hogs"


@pytest.fixture(scope="module")
def trace() -> Trace:
    return load_trace(RUN)


def _at_a_subset(trace: Trace) -> list[tuple[str, list[int]]]:
    """The communication detector's candidates that name some of the job's ranks, not all."""
    _, w = analyze_with_model(trace)
    named = [(c.cause, sorted(int(r) for r in c.where.ranks or []))
             for c in communication(Context.build(w, trace, DEFAULT))]
    return [(cause, ranks) for cause, ranks in named if ranks != [0, 1, 2, 3]]


def test_the_last_stages_all_reduce_beside_the_first_stages_compute_names_no_stage(trace):
    assert not _at_a_subset(trace)
    assert not [f for f in analyze(trace).diagnosis
                if f.cause in ("communication", "cpu_contention")
                and list(f.where.ranks or []) != [0, 1, 2, 3]]


def test_the_run_read_by_step_partitions_reads_the_same(trace):
    # (`stragglers analyze DIR` reads a run directory by step partitions: its trace holds
    # the grid's columns only, so the bound is taken from the grid, as here)
    def named(result):
        # with what the diagnosis says it withheld (test_comm_contention_cannot_tell.py)
        return [(f.cause, list(f.where.ranks or []), f.speedup_if_fixed)
                for f in result.diagnosis] + [w for w in result.warnings if "cannot tell" in w]

    assert named(analyze_run(RUN)[0]) == named(analyze(trace))


@pytest.mark.parametrize("change", ["hosts apart", "compute on GPUs"])
def test_the_same_lateness_where_no_rank_computes_on_its_cpu_is_the_link(trace, change):
    # The same transfers, where the trace shows no rank that could have held their CPU:
    # every rank on a host of its own, or the compute on GPUs. Then nothing but the link
    # says why these are late and the first stage's are not.
    meta = copy.deepcopy(trace.meta)
    if change == "hosts apart":
        meta.extra.pop("clock_alignment")
    else:
        meta.extra["compute_from"] = "gpu kernels"
    assert ("communication", [1, 3]) in _at_a_subset(Trace(trace.ops, meta, trace.source))
