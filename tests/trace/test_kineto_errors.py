"""Bad Kineto input gives one-line InputErrors naming file and field; fuzzed input never crashes."""

from __future__ import annotations

import gzip
import json
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stragglers.errors import InputError, StragglersError
from stragglers.trace.kineto import read_kineto
from stragglers.trace.kineto.align import consensus_offset

GOOD_EVENTS = [
    {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#1", "pid": 1, "tid": 1,
     "ts": 1000.0, "dur": 900.0},
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 1010.0, "dur": 50.0},
]


def _write(path: Path, doc, gz: bool = False) -> Path:
    data = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def _doc(events, **top):
    return {"distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": events, **top}


@pytest.mark.parametrize("content, field, words", [
    (b"{not json", None, "not valid JSON"),
    (b"\xff\xfe\x00garbage", None, "not UTF-8"),
    (b"[1, 2, 3]", None, "expected a JSON object"),
    (json.dumps({"distributedInfo": {"rank": 0}}).encode(), "traceEvents", "missing"),
    (json.dumps({"traceEvents": {"a": 1}, "distributedInfo": {"rank": 0}}).encode(),
     "traceEvents", "expected a list"),
    (json.dumps(_doc(GOOD_EVENTS[1:])).encode(), "traceEvents", "ProfilerStep"),
    (json.dumps(_doc([{**GOOD_EVENTS[0], "ts": "soon"}])).encode(), "traceEvents[0].ts", "number"),
    (json.dumps(_doc([GOOD_EVENTS[0], {**GOOD_EVENTS[1], "dur": -5}])).encode(),
     "traceEvents[1].dur", ">= 0"),
    (json.dumps(_doc(GOOD_EVENTS, baseTimeNanoseconds="x")).encode(), "baseTimeNanoseconds",
     "whole nanoseconds"),
    (json.dumps({"distributedInfo": [0], "traceEvents": GOOD_EVENTS}).encode(), "distributedInfo",
     "object"),
    (json.dumps(_doc([{**GOOD_EVENTS[0], "ts": float("nan")}])).encode(), "traceEvents[0].ts",
     "finite"),
])
def test_bad_files_are_one_line_input_errors(tmp_path, content, field, words):
    path = _write(tmp_path / "rank-0.json", content)
    with pytest.raises(InputError) as err:
        read_kineto(path)
    assert err.value.field == field and words in str(err.value)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_truncated_gzip_is_an_input_error(tmp_path):
    data = gzip.compress(json.dumps(_doc(GOOD_EVENTS)).encode())
    path = tmp_path / "rank-0.json.gz"
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="gzip"):
        read_kineto(path)


def test_missing_paths_and_empty_directories(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        read_kineto(tmp_path / "nope.json")
    with pytest.raises(InputError, match="no .json or .json.gz"):
        read_kineto(tmp_path)
    with pytest.raises(InputError, match="no trace files"):
        read_kineto([])


def test_a_good_minimal_file_reads(tmp_path):
    trace = read_kineto(_write(tmp_path / "rank-0.json", _doc(GOOD_EVENTS)))
    assert list(trace.optype_names()) == ["forward-compute"]
    assert trace.ops["duration"][0] == pytest.approx(50e-6)


def test_consensus_offset_ignores_mismatched_pairs():
    rng = np.random.default_rng(0)
    good = 0.004 + rng.normal(0, 20e-6, 5)
    bad = np.array([-0.2, 0.13, 0.25, 0.09])
    off, agreeing = consensus_offset(np.concatenate([good, bad]))
    assert off == pytest.approx(0.004, abs=5e-5) and agreeing == 5


# --- fuzzing: any document at all gives a Trace or a StragglersError, never another exception.

_numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-10**18, 10**18))
_scalars = st.one_of(st.none(), st.booleans(), _numbers, st.text(max_size=12))
_good_names = st.sampled_from(["ProfilerStep#1", "ProfilerStep#2", "ProfilerStep#x", "aten::mm",
                     "autograd::engine::evaluate_function: MmBackward0", "Optimizer.step#SGD.step",
                     "record_param_comms", "c10d::allreduce_", "gloo:all_reduce",
                     "nccl:_all_gather_base", "ncclKernel_AllReduce_RING_LL",
                     "ncclDevKernel_SendRecv", "ncclDevKernel_", "sgemm", "## backward ##"])
_names = st.one_of(_good_names, _scalars)
_cats = st.one_of(st.sampled_from(["cpu_op", "user_annotation", "gpu_user_annotation", "kernel",
                                   "gpu_memcpy", "cuda_runtime", "cuda_driver", "ac2g",
                                   "python_function", "Kernel"]), _scalars)
_args = st.one_of(_scalars, st.dictionaries(
    st.sampled_from(["correlation", "Collective name", "Process Group Name", "Seq", "Src Rank",
                     "Dst Rank", "External id"]),
    st.one_of(_scalars, st.sampled_from(["allreduce", "send", "recv", "all_to_all", "0"])),
    max_size=5))
_times = st.one_of(st.floats(0, 5000, allow_nan=False), _scalars)
_event = st.fixed_dictionaries(
    {"ph": st.one_of(st.sampled_from(["X", "X", "X", "s", "f", "M", "i"]), _scalars)},
    optional={"cat": _cats, "name": _names, "ts": _times, "dur": _times,
              "pid": st.one_of(st.integers(0, 3), _scalars), "tid": st.one_of(st.integers(0, 3),
                                                                                 _scalars),
              "args": _args})
# Mostly well-formed events, so the fuzz reaches the op building and clock alignment too.
_plausible = st.fixed_dictionaries({
    "ph": st.just("X"), "cat": st.sampled_from(["cpu_op", "user_annotation", "kernel",
                                                "cuda_runtime", "gpu_user_annotation"]),
    "name": _good_names, "ts": st.floats(0, 5000), "dur": st.floats(0, 800),
    "pid": st.integers(0, 2), "tid": st.integers(0, 3),
    "args": st.fixed_dictionaries({"correlation": st.integers(0, 6)}, optional={
        "Collective name": st.sampled_from(["allreduce", "send", "all_to_all", "_allgather_base"]),
        "Seq": st.integers(0, 3), "Process Group Name": st.sampled_from(["0", "1"]),
        "Dst Rank": st.integers(0, 3), "Src Rank": st.integers(0, 3)})})
_step = st.builds(lambda n, ts: {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}",
                                 "pid": 1, "tid": 1, "ts": ts, "dur": 2500.0},
                  st.integers(0, 2), st.sampled_from([0.0, 2500.0]))
_events = st.integers(0, 9).flatmap(lambda k: st.lists(_event, max_size=25) if k == 0 else st.builds(
    lambda a, b, c: a + b + c, st.lists(_step, min_size=1, max_size=2),
    st.lists(_plausible, min_size=4, max_size=20), st.lists(_event, max_size=2)))
_info = st.one_of(st.builds(lambda r: {"rank": r, "world_size": 4},
                                                  st.integers(0, 3)), st.fixed_dictionaries(
    {}, optional={"rank": st.one_of(st.integers(-2, 4), _scalars),
                  "world_size": st.one_of(st.integers(-1, 5), _scalars),
                  "pg_config": st.one_of(_scalars, st.lists(st.fixed_dictionaries(
                      {}, optional={"pg_desc": st.sampled_from(["mesh_pp", "dp", "x", 3]),
                                    "ranks": st.one_of(_scalars, st.lists(_scalars, max_size=4),
                                                       st.lists(st.integers(0, 4), max_size=4))}),
                      max_size=3))}))


def _mostly(good, bad):
    """`good` nine times in ten, else `bad` (hypothesis' one_of draws its branches evenly)."""
    return st.integers(0, 9).flatmap(lambda k: bad if k == 0 else good)


_document = st.fixed_dictionaries(
    {"traceEvents": _mostly(_events, _scalars)},
    optional={"distributedInfo": _mostly(_info, _scalars),
              "baseTimeNanoseconds": _mostly(st.integers(0, 2 * 10**18), _scalars)})


@pytest.mark.slow
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(docs=st.lists(_document, min_size=1, max_size=2), gz=st.booleans())
def test_fuzzed_documents_never_crash(docs, gz):
    with tempfile.TemporaryDirectory() as tmp:
        paths = [_write(Path(tmp) / f"trace_rank-{i}.json{'.gz' if gz else ''}", d, gz)
                 for i, d in enumerate(docs)]
        try:
            trace = read_kineto(paths)
        except StragglersError as exc:
            assert "\n" not in str(exc)
            return
        assert len(trace) > 0
        assert np.all(np.isfinite(trace.ops["start_ts"])) and np.all(trace.ops["duration"] >= 0)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=300), cut=st.integers(0, 400))
def test_fuzzed_bytes_never_crash(data, cut):
    good = json.dumps(_doc(GOOD_EVENTS)).encode()
    with tempfile.TemporaryDirectory() as tmp:
        for content in (data, good[:cut] + data[:8], gzip.compress(good)[:cut]):
            path = Path(tmp) / "rank-0.json.gz"
            path.write_bytes(content)
            try:
                read_kineto(path)
            except StragglersError as exc:
                assert "\n" not in str(exc)


# --- the msgspec decoder (a chunk at a time) reads exactly what the stdlib decoder reads.

def _decoded(path: Path, decoder: str):
    """RankEvents of one file with one decoder, or the error line it gave."""
    from stragglers.trace.kineto.events import read_rank_events

    try:
        return read_rank_events(path, decoder)
    except InputError as exc:
        return str(exc)


# Events whose strings and args hold what a cut between two events looks like.
TRAPS = [
    {"ph": "X", "cat": "cpu_op", "name": 'aten::mm}, {"ph": "X"]', "pid": 1, "tid": 1,
     "ts": 1100.0, "dur": 20.0, "args": {"Input Dims": [[{"a": 1}, {"b": [2]}], []],
                                          "Concrete Inputs": ["", "}, {", "]", "\\\"}"]}},
    {"ph": "X", "cat": "cpu_op", "name": "c10d::send", "pid": 1, "tid": 1, "ts": 1200.0,
     "dur": 5.0, "args": {"Concrete Inputs": ["", "", "3", "0"], "Process Group Name": "0",
                          "Seq": "4"}},
    {"ph": "X", "cat": "cpu_op", "name": "record_param_comms", "pid": 1, "tid": "t}, {", "ts": 1300,
     "dur": 7, "args": {"Collective name": "allreduce", "Process Group Ranks": "[0, 1]",
                        "Process Group Name": "0", "nested": {"x": [{"y": "}]"}, {}]}}},
    {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 3, "pid": 1, "tid": 1, "ts": 1301.0},
    {"ph": "X", "cat": "cpu_op", "name": "autograd::engine::evaluate_function: MmBackward0",
     "pid": 1, "tid": 2, "ts": 1400.0, "dur": 30.0},
]


@pytest.mark.parametrize("indent", [None, 1])
def test_streaming_cuts_never_split_an_event(tmp_path, monkeypatch, indent):
    pytest.importorskip("msgspec")
    from stragglers.trace.kineto import fastdecode
    from stragglers.trace.kineto.events import _read_streaming

    monkeypatch.setattr(fastdecode, "CHUNK_BYTES", 61)  # many cuts, most of them wrong guesses
    doc = {"distributedInfo": {"rank": 0, "world_size": 2, "traceEvents": "not these"},
           "traceEvents": GOOD_EVENTS + TRAPS * 40, "traceName": '"traceEvents": [}]',
           "baseTimeNanoseconds": 1700000000000000000}
    path = tmp_path / "rank-0.json"
    path.write_text(json.dumps(doc, indent=indent))
    fast = _read_streaming(path, fastdecode)
    assert fast is not None
    assert fast == _decoded(path, "json")
    assert fast.base_ns == 1700000000000000000 and len(fast.cpu_ts) == 1 + 4 * 40
    assert {c[7] for c in fast.collectives if c[3] == "send"} == {3}
    assert fast.pg_ranks == {"0": (0, 1)} and fast.events == 2 + 5 * 40


@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(doc=_document, gz=st.booleans(), chunk=st.sampled_from([7, 64, 1 << 20]))
def test_fuzzed_documents_decode_alike(monkeypatch, doc, gz, chunk):
    pytest.importorskip("msgspec")
    from stragglers.trace.kineto import fastdecode

    monkeypatch.setattr(fastdecode, "CHUNK_BYTES", chunk)
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp) / f"rank-0.json{'.gz' if gz else ''}", doc, gz)
        assert _decoded(path, "msgspec") == _decoded(path, "json")


def test_gpu_step_spans_numbered_past_the_cpu_spans_read(tmp_path):
    # A fuzz find: GPU-side ProfilerStep spans #1 and #2 but a CPU span for #1 only. A kernel
    # with no launch record in the GPU span #2 was given #2's index among the GPU spans (1),
    # an index the CPU's step list (one step) does not have: an IndexError deep inside.
    events = [GOOD_EVENTS[0],
              {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#1", "pid": 0,
               "tid": 7, "ts": 0, "dur": 0},
              {"ph": "X", "cat": "gpu_user_annotation", "name": "ProfilerStep#2", "pid": 0,
               "tid": 7, "ts": 0, "dur": 0},
              {"ph": "X", "cat": "kernel", "name": "gemm", "pid": 0, "tid": 7, "ts": 0, "dur": 0}]
    try:
        trace = read_kineto(_write(tmp_path / "rank-0.json", _doc(events)))
    except StragglersError as exc:
        assert "\n" not in str(exc)
        return
    assert set(trace.ops["step"].tolist()) <= {1}
