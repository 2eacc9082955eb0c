"""Kineto reader on the real Holistic Trace Analysis samples (../shared/data/kineto-samples)."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from conftest import KINETO

from stragglers.errors import InputError
from stragglers.trace.kineto import looks_like_kineto, read_kineto
from stragglers.whatif import analyze


def _messages(trace) -> list[str]:
    """The reader's notes as plain messages."""
    return [n.message for n in trace.notes]


pytestmark = pytest.mark.skipif(not KINETO.exists(), reason=f"{KINETO} not present")
SAMPLED = [KINETO / "trace_filter_sampled_rank-0.json.gz", KINETO / "trace_filter_sampled_rank-1.json.gz"]
CPU_ONLY = KINETO / "cpu_only_rank-34.Jul_15_10_52_41.1074.pt.trace.json.gz"
NO_INFO = KINETO / "distributed_info_unavailable_distributed_info_not_found.json.gz"
NO_RANK = KINETO / "rank_unavailable_rank_not_found.json.gz"


@pytest.fixture(scope="module")
def sampled():
    return read_kineto(SAMPLED)


def _count(trace, rank, step, optype):
    sel = (trace.ops["rank"] == rank) & (trace.ops["step"] == step)
    return int((trace.optype_names()[sel] == optype).sum())


def test_two_sampled_ranks_load_as_one_job(sampled):
    t = sampled
    assert sorted(set(t.ops["rank"])) == [0, 1] and sorted(set(t.ops["step"])) == [551, 552]
    assert t.meta.world_size == 128 and t.meta.pp_size == 1 and set(t.ops["stage"]) == {0}
    for rank in (0, 1):
        for step in (551, 552):
            # DDP's bucketed all-reduces in backward and Shampoo's all-gather in the optimizer.
            assert _count(t, rank, step, "grads-all-reduce") == 2
            assert _count(t, rank, step, "params-all-gather") == 1
            assert _count(t, rank, step, "forward-compute") >= 1
            assert _count(t, rank, step, "backward-compute") >= 1
            assert _count(t, rank, step, "optimizer") >= 1
    # Rows lie inside the step span; times are seconds since a whole-second origin.
    assert t.meta.extra["time_origin_unix_s"] == 1682725898  # 2023-04-29, epoch µs
    assert np.all(t.ops["duration"] >= 0) and np.all(t.ops["duration"] < 0.7)


def test_sampled_ranks_clocks_are_matched_and_close(sampled):
    extra = sampled.meta.extra
    assert extra["clock_offsets_s"]["0"] == 0.0
    assert abs(extra["clock_offsets_s"]["1"]) < 1e-3      # same host: well under a millisecond
    quality = extra["clock_alignment"]["1"]
    assert quality["matched"] == 10                        # all-reduces, all-gathers, all-to-alls
    # The sampled files miss some kernels on one rank or the other, so pairing by order gets
    # some wrong; the offset comes from the pairs that agree (both all-gathers, two all-reduces).
    assert quality["agreeing"] >= 4 and quality["median_residual_s"] < 5e-4
    assert any("few agreeing collectives" in n for n in _messages(sampled))
    # every collective is a row (docs/whatif.md §2, §12), none is left out for want of an op type
    assert all(_count(sampled, r, s, "all-to-all") == 2 for r in (0, 1) for s in (551, 552))
    assert not any("left out" in n for n in _messages(sampled))
    assert any("stage 0" in n for n in _messages(sampled))


def test_analysis_runs_on_the_sampled_job(sampled):
    result = analyze(sampled)
    assert result.slowdown >= 1 - 1e-9
    assert result.job.steps == 2
    # 2 ranks of 128: no job-wide verdict, and what compares ranks says it is among those two
    assert result.partial and result.straggling is None
    for f in result.diagnosis:
        assert f.cause == "partial" or f.where.scope == "traced ranks"
        assert f.cause == "partial" or f.evidence.startswith("among the 2 traced ranks of 128")


def test_modern_nccl_trace_with_collective_metadata():
    t = read_kineto(KINETO / "nccl_parser_config_nccl_data.json.gz")
    assert sorted(set(t.ops["step"])) == [4, 5, 6] and set(t.ops["rank"]) == {0}
    assert t.meta.world_size == 2 and t.meta.dp_size == 2
    for step in (4, 5, 6):
        assert _count(t, 0, step, "grads-all-reduce") == 5
        # the two broadcasts are rows and split the forward: their result feeds the work after
        assert _count(t, 0, step, "broadcast") == 2
        assert _count(t, 0, step, "forward-compute") == 3
        assert _count(t, 0, step, "optimizer") == 1
    assert not any("left out" in n for n in _messages(t))
    # baseTimeNanoseconds was added back: the origin is in 2024, not 1970.
    assert 1.7e9 < t.meta.extra["time_origin_unix_s"] < 1.8e9
    # One rank: nothing to straggle behind. S may dip a little under 1 because the spec
    # idealises every all-reduce with one median, and the last (exposed) bucket is smaller.
    assert analyze(t).slowdown == pytest.approx(1.0, abs=0.02)


def test_cpu_only_trace_reads_collectives_from_cpu_annotations():
    t = read_kineto(CPU_ONLY)
    assert set(t.ops["rank"]) == {34} and t.meta.world_size == 300
    assert list(t.optype_names()) == ["grads-all-reduce", "grads-all-reduce"]
    assert np.allclose(sorted(t.ops["duration"]), [0.170471258, 0.173209713])
    assert any("no GPU rows" in n for n in _messages(t))
    # That step holds no compute op, which the engine needs: a clear error, not a traceback.
    with pytest.raises(InputError, match="forward/backward-compute"):
        analyze(t)


def test_missing_distributed_info_falls_back_to_the_file_name(tmp_path):
    with pytest.raises(InputError) as err:
        read_kineto(NO_INFO)
    assert err.value.field == "distributedInfo.rank" and NO_INFO.name in str(err.value)
    renamed = tmp_path / "trainer_rank-5.json.gz"
    shutil.copyfile(NO_INFO, renamed)
    t = read_kineto(renamed)
    assert set(t.ops["rank"]) == {5} and sorted(set(t.ops["step"])) == [1009]
    assert any("taken from the file name" in n for n in _messages(t))
    assert analyze(t).slowdown >= 1 - 1e-9


def test_missing_rank_is_a_clear_error_naming_the_file():
    with pytest.raises(InputError) as err:
        read_kineto(NO_RANK)
    msg = str(err.value)
    assert err.value.field == "distributedInfo.rank" and NO_RANK.name in msg
    assert "rank-3" in msg and "\n" not in msg


def test_samples_are_detected_as_kineto():
    assert looks_like_kineto(SAMPLED[0]) and looks_like_kineto(KINETO)
    assert not looks_like_kineto(KINETO / "LICENSE")


# --- the two decoders (msgspec, a chunk at a time; the stdlib) read the same events.

ALL_SAMPLES = sorted(KINETO.glob("*.json.gz"))


@pytest.mark.parametrize("path", ALL_SAMPLES, ids=lambda p: p.name[:40])
def test_msgspec_and_stdlib_decoders_read_the_same_events(path):
    pytest.importorskip("msgspec")
    from stragglers.trace.kineto import fastdecode
    from stragglers.trace.kineto.events import _read_streaming, read_rank_events

    fast = _read_streaming(path, fastdecode)
    assert fast is not None, "the streaming decoder fell back to the stdlib on a real trace"
    assert fast == read_rank_events(path, "json")
    assert fast.events > 0 and (fast.has_kernels or len(fast.cpu_ts))


@pytest.mark.slow
def test_without_msgspec_the_stdlib_reads_the_same_ops(tmp_path):
    """The reader runs without msgspec (and without torch): the same ops, decoder json (the
    analysis result's types are msgspec Structs, a declared dependency; the reader's fallback
    keeps a broken msgspec build from stopping a read)."""
    import subprocess
    import sys

    code = (
        "import sys, json\n"
        "sys.modules['msgspec'] = None  # import msgspec now fails, as when it is not installed\n"
        "sys.modules['torch'] = None\n"
        "from stragglers.trace.kineto import fastdecode, read_kineto\n"
        "from stragglers.trace.kineto.events import read_rank_events\n"
        "from stragglers.errors import InputError\n"
        "assert not fastdecode.AVAILABLE\n"
        "t = read_kineto(sys.argv[1:])\n"
        "try:\n"
        "    read_rank_events(sys.argv[1], 'msgspec')\n"
        "except InputError as exc:\n"
        "    assert 'msgspec is not installed' in str(exc)\n"
        "else:\n"
        "    raise AssertionError('decoder=msgspec without msgspec')\n"
        "o = t.ops\n"
        "print(json.dumps([len(t), float(o['start_ts'].sum()), float(o['duration'].sum()),\n"
        "                  int(o['optype'].sum()), int(o['rank'].sum())]))\n")
    out = subprocess.run([sys.executable, "-c", code, *map(str, SAMPLED)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    n, starts, durations, optypes, ranks = __import__("json").loads(
        out.stdout.strip().splitlines()[-1])
    o = read_kineto(SAMPLED).ops
    assert n == len(o["rank"]) and optypes == int(o["optype"].sum())
    assert ranks == int(o["rank"].sum())
    assert starts == pytest.approx(float(o["start_ts"].sum()), rel=1e-12)
    assert durations == pytest.approx(float(o["duration"].sum()), rel=1e-12)
