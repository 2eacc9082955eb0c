"""A transfer that its host's other ranks computed beside is no slow link of its own.

The fixture (tests/data/recorded/pp2-clean-profiler-one-cpu-beside-hogs): the clean dp 2 × pp 2
job of tests/trace/test_kineto_recorded.py (`kineto_profile_job.py --pp 2 --steps 16`, every
rank on CPU 0 as the fixture runs it, torchrun on gloo) beside four `while True: pass` hogs
(load 18–26 with other agents' work, 2026-12-07 02:49 UTC, commit 42a65bb), its PyTorch-profiler
traces converted to the run format (`stragglers convert`). A profiler trace records no CPU
waits. The first stage's all-reduce is short and it starts the next step's forward at once;
the last stage's all-reduce (ranks 1 and 3, one DP group) runs beside that forward on the one
CPU and takes 2–6× as long. In steps 2, 7, 9 and 16 it is late on both ranks: CI's run had it
so in most steps, and the diagnosis named `communication` at ranks [1, 3] (×1.08 here).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
from conftest import persistent_findings

from stragglers.trace.load import load_trace
from stragglers.trace.model import Trace
from stragglers.whatif import analyze

RUN = Path(__file__).parents[1] / "data" / "recorded" / "pp2-clean-profiler-one-cpu-beside-hogs"
LATE = [2, 7, 9, 16]   # the steps whose last-stage all-reduce is ≥ 2× the median on both ranks


@pytest.fixture(scope="module")
def trace() -> Trace:
    return load_trace(RUN)


def _comm(result) -> list[tuple[str, list[int]]]:
    return [(f.cause, list(f.where.ranks or [])) for f in result.diagnosis
            if f.cause in ("communication", "cpu_contention")]


def test_the_last_stages_all_reduce_beside_the_first_stages_compute_names_no_stage(trace):
    result = analyze(trace, steps=LATE)
    assert not [(c, r) for c, r in persistent_findings(result, len(LATE)) if r != [0, 1, 2, 3]], \
        (result.slowdown, _comm(result))
    assert not _comm(analyze(trace)), "the whole run: no transfer family singled out"


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
    result = analyze(Trace(trace.ops, meta, trace.source), steps=LATE)
    assert ("communication", [1, 3]) in _comm(result), result.diagnosis
