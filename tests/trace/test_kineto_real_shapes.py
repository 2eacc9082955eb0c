"""Shapes of real profiler traces from other projects (HTA, TraceLens), hand-written small."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stragglers.errors import InputError
from stragglers.trace.kineto import read_kineto
from stragglers.whatif import analyze

T0 = 1_700_000_000_000_000.0  # µs since the epoch


def _steps(n: int, *, nccl: bool = False) -> list[dict]:
    """n ProfilerSteps of one launch + kernel each (and an NCCL all-reduce when asked)."""
    ev: list[dict] = []
    for s in range(n):
        t = T0 + s * 1000.0
        ev += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s + 1}", "pid": 1,
                "tid": 1, "ts": t, "dur": 1000.0},
               {"ph": "X", "cat": "cuda_runtime", "name": "hipLaunchKernel", "pid": 1, "tid": 1,
                "ts": t + 10, "dur": 5.0, "args": {"correlation": 100 + 2 * s}},
               {"ph": "X", "cat": "kernel", "name": "Cijk_Alik_Bljk_SB", "pid": 0, "tid": 7,
                "ts": t + 20, "dur": 300.0 + s, "args": {"correlation": 100 + 2 * s}}]
        if nccl:
            ev += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1,
                    "tid": 1, "ts": t + 330, "dur": 5.0, "args": {"correlation": 101 + 2 * s}},
                   {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_Generic", "pid": 0,
                    "tid": 8, "ts": t + 340, "dur": 50.0, "args": {"correlation": 101 + 2 * s}}]
    return ev


def _write(path: Path, events: list[dict], **top) -> Path:
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events, **top}))
    return path


def test_a_lone_trace_of_a_program_without_process_group_is_a_job_of_one(tmp_path):
    # TraceLens' bert-small / HTA's MI250 minitoy: no distributedInfo, no collective, no rank
    # in the name. Refused before with advice to rename the file after its rank.
    t = read_kineto(_write(tmp_path / "mi250_minitoy_train.json", _steps(3)))
    assert t.meta.world_size == 1 and t.meta.extra["ranks_read"] == [0]
    assert t.meta.extra["ranks_missing"] == []
    assert any("single-process" in n.message for n in t.notes)
    assert sorted(set(t.ops["step"])) == [1, 2, 3]
    r = analyze(t)
    assert not r.partial and len(r.steps_analysed) >= 2


def test_a_lone_trace_with_collectives_but_no_rank_is_still_refused(tmp_path):
    # a collective means a process group: which rank this is cannot be guessed
    path = _write(tmp_path / "trace.json", _steps(3, nccl=True))
    with pytest.raises(InputError) as err:
        read_kineto(path)
    assert err.value.field == "distributedInfo.rank" and "trace.json" in str(err.value)


def test_two_traces_without_ranks_are_refused(tmp_path):
    a = _write(tmp_path / "a.json", _steps(3))
    b = _write(tmp_path / "b.json", _steps(3))
    with pytest.raises(InputError) as err:
        read_kineto([a, b])
    assert err.value.field == "distributedInfo.rank"
