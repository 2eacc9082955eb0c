"""Shapes of real profiler traces from other projects (HTA, TraceLens), hand-written small."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from stragglers.errors import InputError
from stragglers.trace.kineto import read_kineto
from stragglers.trace.load import load_trace
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


def _mtia_rank(rank: int, slow: float) -> dict:
    """An MTIA trace as HTA's mtia_rank_0 has it: kernels are mtia_ccp_events launched by
    mtia_runtime events, DMA transfers without a launch, collectives hccl: annotations only."""
    ev: list[dict] = []
    for s in range(4):
        t = T0 + s * 10_000.0
        c = 1000 + 10 * s
        ev += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s + 1}", "pid": 5,
                "tid": 5, "ts": t, "dur": 9000.0},
               {"ph": "X", "cat": "cpu_op", "name": "aten::linear", "pid": 5, "tid": 5,
                "ts": t + 10, "dur": 40.0},
               {"ph": "X", "cat": "mtia_runtime",
                "name": "runFunction - job_prep_and_submit_for_execution", "pid": 5, "tid": 5,
                "ts": t + 20, "dur": 20.0, "args": {"correlation": c}},
               {"ph": "X", "cat": "mtia_ccp_events", "name": "fc-dtype_Float", "pid": 9,
                "tid": 4, "ts": t + 100, "dur": 3000.0 * slow, "args": {"correlation": c,
                                                                         "stream": 1}},
               {"ph": "X", "cat": "mtia_ccp_events", "name": "dma_request", "pid": 9,
                "tid": 801, "ts": t + 50, "dur": 10.0, "args": {"size": 16, "sqid": 1}},
               {"ph": "X", "cat": "user_annotation", "name": "hccl:all_reduce", "pid": 5,
                "tid": 5, "ts": t + 100 + 3000.0 * slow, "dur": 3000 * (2.0 - slow) + 200}]
    return {"schemaVersion": 1, "traceEvents": ev, "deviceProperties": [],
            "distributedInfo": {"backend": "mtia:hccl,cpu:gloo", "rank": rank, "world_size": 2}}


def test_mtia_kernels_are_device_rows_and_hccl_annotations_its_collectives(tmp_path):
    for r, slow in ((0, 1.0), (1, 1.5)):
        (tmp_path / f"mtia_rank_{r}.json").write_text(json.dumps(_mtia_rank(r, slow)))
    t = read_kineto(tmp_path)
    assert t.meta.extra["compute_from"] == "gpu kernels"   # not the CPU ops' launch times
    names = t.optype_names()
    for r, slow in ((0, 1.0), (1, 1.5)):
        mine = t.ops["rank"] == r
        comp = [d for d, n in zip(t.ops["duration"][mine], names[mine]) if n.endswith("compute")]
        # busy time: the kernel and the DMA transfer before it
        assert len(comp) == 4 and max(comp) == pytest.approx((3000 * slow + 10) * 1e-6)
        assert list(names[mine]).count("grads-all-reduce") == 4
    assert any("hccl" in n.message for n in t.notes)
    res = analyze(t)
    assert not res.partial
    assert 1 in {w.rank for f in res.diagnosis for w in f.where.workers}


REAL = Path(__file__).resolve().parents[1] / "data" / "real"
MI250 = REAL / "hta-mi250-minitoy" / "mi250_minitoy_train_ROCm6_2_kineto.json.gz"


@pytest.mark.slow
def test_hta_mi250_toy_is_read_as_one_process_with_its_hip_kernels():
    # real file: 12 HIP kernels and 2 HtoD copies launched in ProfilerStep#1; ProfilerStep#2
    # holds none (the window ends), so one step is analysed
    t = load_trace(MI250)
    assert t.meta.world_size == 1 and t.meta.extra["compute_from"] == "gpu kernels"
    assert sorted(set(t.ops["step"])) == [1]
    r = analyze(t)
    assert r.steps_analysed == [1] and not r.partial
    out = subprocess.run([sys.executable, "-m", "stragglers.cli", "analyze", str(MI250)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "Traceback" not in out.stderr and "world size 1" in out.stdout


def _old_autograd_steps() -> list[dict]:
    """PyTorch 1.8's tb_plugin samples (pytorch/kineto): categories Operator/Runtime/Kernel,
    no evaluate_function op; the autograd thread's top-level ops are the nodes
    (CudnnConvolutionBackward), torch::autograd::AccumulateGrad and the engine's own aten::sum
    between two nodes."""
    ev: list[dict] = []
    corr = 1
    for s in range(3):
        t = T0 + s * 10_000.0
        ev.append({"ph": "X", "cat": "Operator", "name": f"ProfilerStep#{s + 5}", "pid": 1,
                   "tid": "100", "ts": t, "dur": 9000.0})
        plan = [("100", "aten::cudnn_convolution", 100.0, 2000.0),
                ("200", "MseLossBackward", 3000.0, 500.0),
                ("200", "aten::sum", 4000.0, 300.0),
                ("200", "CudnnConvolutionBackward", 5000.0, 1500.0),
                ("200", "torch::autograd::AccumulateGrad", 7000.0, 200.0)]
        for tid, name, at, work in plan:
            ev += [{"ph": "X", "cat": "Operator", "name": name, "pid": 1, "tid": tid,
                    "ts": t + at, "dur": 100.0},
                   {"ph": "X", "cat": "Runtime", "name": "cudaLaunchKernel", "pid": 1,
                    "tid": tid, "ts": t + at + 10, "dur": 5.0, "args": {"correlation": corr}},
                   {"ph": "X", "cat": "Kernel", "name": f"k_{name}", "pid": 0, "tid": "stream 7",
                    "ts": t + at + 20, "dur": work, "args": {"correlation": corr}}]
            corr += 1
    return ev


def test_autograd_nodes_of_old_traces_are_backward(tmp_path):
    # before, with no evaluate_function op, the whole step was forward-compute; with the node
    # names alone, the engine's aten::sum between two nodes cut the backward in pieces
    t = read_kineto(_write(tmp_path / "worker0.pt.trace.json", _old_autograd_steps()))
    names = t.optype_names()
    for step in (5, 6, 7):
        sel = t.ops["step"] == step
        assert list(names[sel]) == ["forward-compute", "backward-compute"]
        # busy time: the forward kernel; the four backward kernels (500 + 300 + 1500 + 200)
        assert list(t.ops["duration"][sel] * 1e6) == pytest.approx([2000.0, 2500.0])


def test_ddp_work_after_the_last_gradient_all_reduce_stays_optimizer():
    # HTA's nccl_data (PyTorch >= 1.10: evaluate_function ops): the autograd thread also runs
    # DDP's copy of the buckets back to the grads, after the last all-reduce. Read as a
    # backward thread as a whole (the rule for pre-1.10 traces), that copy became backward.
    from conftest import KINETO
    path = KINETO / "nccl_parser_config_nccl_data.json.gz"
    if not path.exists():
        pytest.skip(f"{path} not present")
    t = read_kineto(path)
    names = t.optype_names()
    for step in sorted(set(t.ops["step"])):
        sel = t.ops["step"] == step
        starts = t.ops["start_ts"][sel]
        # (the tail's first kernel and the all-reduce start within a microsecond)
        last_ar = starts[names[sel] == "grads-all-reduce"].max() - 1e-5
        assert not (starts[names[sel] == "backward-compute"] >= last_ar).any()
        assert (starts[names[sel] == "optimizer"] >= last_ar).all()


def _no_step_spans(iterations: int) -> list[dict]:
    """A training loop profiled without schedule/prof.step() (TraceLens' MI300 DDP resnet18,
    HTA's with_gpu_user_annotation): no ProfilerStep#N, one Optimizer.step# per iteration."""
    ev: list[dict] = []
    for i in range(iterations):
        t = T0 + i * 1000.0 + (500.0 if i >= 2 else 0.0)   # the third waits 500 µs for data
        ev += [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1,
                "ts": t + 10, "dur": 20.0},
               {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1,
                "ts": t + 12, "dur": 5.0, "args": {"correlation": 10 + i}},
               {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": t + 40,
                "dur": 400.0, "args": {"correlation": 10 + i}},
               {"ph": "X", "cat": "user_annotation", "name": "Optimizer.step#SGD.step", "pid": 1,
                "tid": 1, "ts": t + 500, "dur": 100.0},
               {"ph": "X", "cat": "gpu_user_annotation", "name": "Optimizer.step#SGD.step",
                "pid": 0, "tid": 7, "ts": t + 510, "dur": 10.0}]
    return ev


def test_without_profiler_steps_the_optimizer_steps_end_the_steps(tmp_path):
    t = read_kineto(_write(tmp_path / "train.json", _no_step_spans(4),
                           distributedInfo={"rank": 0, "world_size": 1}))
    assert list(t.ops["step"]) == [1, 2, 3, 4]           # one kernel each, in its own step
    assert list(t.ops["duration"] * 1e6) == pytest.approx([400.0] * 4)
    assert list(np.diff(t.ops["start_ts"]) * 1e6) == pytest.approx([1000.0, 1500.0, 1000.0])
    assert any("Optimizer.step#" in n.message for n in t.notes)
    assert analyze(t).steps_analysed == [1, 2, 3, 4]
    one = _write(tmp_path / "one.json", _no_step_spans(1),
                 distributedInfo={"rank": 0, "world_size": 1})
    with pytest.raises(InputError, match="ProfilerStep"):
        read_kineto(one)


def test_times_beyond_any_calendar_are_one_line_errors(tmp_path):
    # HTA's large_integer_trace carries 2^64-sized ids; times that large (a float
    # baseTimeNanoseconds of 2.5e20, ts in the year 30,000) raised OverflowError/ValueError
    # from the date in the "two jobs" message
    big_base = _write(tmp_path / "rank-0.json", _steps(3), baseTimeNanoseconds=2.534023008e20,
                      distributedInfo={"rank": 0, "world_size": 1})
    with pytest.raises(InputError) as err:
        read_kineto(big_base)
    assert err.value.field == "baseTimeNanoseconds"
    a = _write(tmp_path / "a_rank-0.json", _steps(3), distributedInfo={"rank": 0, "world_size": 2})
    late = [{**e, "ts": e["ts"] + 1e18} for e in _steps(3)]
    b = _write(tmp_path / "b_rank-1.json", late, distributedInfo={"rank": 1, "world_size": 2})
    with pytest.raises(InputError, match="two jobs") as err:
        read_kineto([a, b])
    assert "\n" not in str(err.value)
