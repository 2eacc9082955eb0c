"""Perfetto / Chrome-trace export: valid JSON, every op once, tracks labelled, fast path exact."""

from __future__ import annotations

import json
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stragglers.errors import InputError
from stragglers.report import write_perfetto
from stragglers.report.perfetto import MAX_LANES, TRIM_FRACTION, TRIM_NS, _assign_lanes
from stragglers.trace.model import OPTYPES, STREAM_OF_OPTYPE, STREAMS, JobMeta, Trace

T0 = 1_732_900_000.0  # epoch seconds: absolute timestamps must not turn into 1.7e+15


def small_trace(dp: int = 2, pp: int = 2, steps: int = 2) -> Trace:
    """A 1F1B-ish dp × pp job: forward, p2p, backward, DP all-reduce and optimizer per step."""
    rows = defaultdict(list)
    rank = 0
    for d in range(dp):
        for p in range(pp):
            rank = d * pp + p
            t = T0 + 0.001 * rank
            for step in range(steps):
                seq = defaultdict(int)
                plan = [("forward-compute", 0, 0.010), ("forward-send", -1, 0.002),
                        ("forward-compute", 1, 0.010), ("forward-recv", -1, 0.001),
                        ("backward-compute", 0, 0.020 + 0.005 * d),
                        ("backward-compute", 1, 0.020), ("grads-all-reduce", -1, 0.004),
                        ("optimizer", -1, 0.003)]
                for optype, mb, dur in plan:
                    rows["rank"].append(rank)
                    rows["dp_rank"].append(d)
                    rows["stage"].append(p)
                    rows["step"].append(10 + step)
                    rows["optype"].append(optype)
                    rows["start_ts"].append(t)
                    rows["duration"].append(dur)
                    rows["seq_id"].append(seq[optype])
                    rows["mb_id"].append(mb)
                    rows["mc"].append(0)
                    rows["gmc"].append(p)
                    seq[optype] += 1
                    t += dur + 0.0005
    return Trace.from_rows(rows, JobMeta(name="tiny", dp_size=dp, pp_size=pp))


def events_by_phase(path):
    doc = json.loads(path.read_text())
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    m = [e for e in doc["traceEvents"] if e["ph"] == "M"]
    return doc, x, m


def test_one_file_per_timeline_with_every_op_labelled(tmp_path):
    trace = small_trace()
    ideal_start = trace.ops["start_ts"] - T0  # a replay's own clock, starting near 0
    ideal_end = ideal_start + 0.9 * trace.ops["duration"]
    paths = write_perfetto(tmp_path / "perfetto", trace, {
        "measured": (trace.ops["start_ts"], trace.end_ts), "ideal": (ideal_start, ideal_end)})
    assert [p.name for p in paths] == ["measured.json", "ideal.json"]

    pids = {}
    for path, start, end in zip(paths, (trace.ops["start_ts"], ideal_start),
                                (trace.end_ts, ideal_end)):
        doc, x, meta = events_by_phase(path)
        assert doc["otherData"]["timeline"] == path.stem and doc["otherData"]["job"] == "tiny"
        assert len(x) == len(trace)
        assert "e+" not in path.read_text()  # plain decimals, even for epoch microseconds
        # Events come out in trace-row order: check each against its row.
        for i, e in enumerate(x):
            assert e["name"] == OPTYPES[trace.ops["optype"][i]]
            assert e["cat"] == STREAMS[STREAM_OF_OPTYPE[trace.ops["optype"][i]]]
            assert e["ts"] == pytest.approx(start[i] * 1e6, abs=1e-3, rel=2e-16)
            assert e["dur"] == pytest.approx((end[i] - start[i]) * 1e6, abs=2e-3)
            assert e["args"] == {"step": int(trace.ops["step"][i]),
                                 "mb_id": int(trace.ops["mb_id"][i])}
        proc_names = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
        thread_names = {(e["pid"], e["tid"]): e["args"]["name"]
                        for e in meta if e["name"] == "thread_name"}
        # One process per worker, named after it, and the same pid in every file.
        for i, e in enumerate(x):
            d, p = int(trace.ops["dp_rank"][i]), int(trace.ops["stage"][i])
            assert proc_names[e["pid"]] == f"dp {d} / pp {p}"
            pids.setdefault((d, p), e["pid"])
            assert pids[(d, p)] == e["pid"]
            assert thread_names[(e["pid"], e["tid"])] == e["cat"]  # one track per stream
        assert len(proc_names) == 4
        assert sorted(set(thread_names.values())) == sorted(
            ["compute", "f-send", "f-recv", "dp-comm"])


def test_overlapping_ops_on_a_stream_get_their_own_lane(tmp_path):
    trace = small_trace(dp=1, pp=1, steps=1)
    start, end = trace.ops["start_ts"].copy(), trace.end_ts.copy()
    # The optimizer (compute stream) overlaps the second backward: lane 2 of the compute track.
    opt = int(np.flatnonzero(trace.optype_names() == "optimizer")[0])
    bwd = int(np.flatnonzero(trace.optype_names() == "backward-compute")[-1])
    start[opt] = start[bwd] + 0.005
    end[opt] = end[bwd] + 0.005
    (path,) = write_perfetto(tmp_path, trace, {"measured": (start, end)})
    _, x, meta = events_by_phase(path)
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert names[(x[opt]["pid"], x[opt]["tid"])] == "compute #2"
    assert names[(x[bwd]["pid"], x[bwd]["tid"])] == "compute"
    assert_no_overlap_within_tracks(x)


def assert_no_overlap_within_tracks(x_events):
    tracks = defaultdict(list)
    for e in x_events:
        if e["dur"] > 0:  # a point nests inside whatever slice it falls in
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in tracks.values():
        spans.sort()
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert start >= end - 1e-6


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 50), st.integers(0, 30)),
                min_size=1, max_size=60))
def test_lanes_never_overlap(spans):
    # Units of 3 µs on ops up to 0.9 ms: overlaps of 1-3 units are timer noise (trimmed),
    # longer ones are real.
    track = np.array([s[0] for s in spans], dtype=np.int64)
    ts = np.array([s[1] for s in spans], dtype=np.int64) * 3000
    end = ts + np.array([s[2] for s in spans], dtype=np.int64) * 3000
    lane, trimmed, crowded = _assign_lanes(track, ts, end)
    slack = np.maximum(TRIM_NS, (TRIM_FRACTION * (end - ts)).astype(np.int64))
    assert np.all(trimmed >= ts) and np.all(trimmed - ts <= slack) and np.all(trimmed <= end)
    if crowded:
        return  # past MAX_LANES the overflow lane may overlap (and a warning says so)
    assert lane.max() < MAX_LANES
    for key in set(zip(track.tolist(), lane.tolist())):
        rows = sorted((trimmed[i], end[i]) for i in range(len(spans))
                      if (track[i], lane[i]) == key and end[i] > trimmed[i])
        for (_, e0), (s1, _) in zip(rows, rows[1:]):
            assert s1 >= e0  # points (zero length) may sit inside a slice; slices never cross
    first = np.lexsort((-end, ts, track))
    assert lane[first[0]] == 0  # the earliest (longest on ties) op is on the main track


def test_clock_rounding_overlaps_are_trimmed_not_moved(tmp_path):
    trace = small_trace(dp=1, pp=1, steps=1)
    start, end = trace.ops["start_ts"].copy(), trace.end_ts.copy()
    second = 2  # the second forward-compute, on the compute stream after the first one
    start[second] = end[0] - 60e-9  # 60 ns before its predecessor ends (float32 rounding)
    (path,) = write_perfetto(tmp_path, trace, {"measured": (start, end)})
    _, x, _ = events_by_phase(path)
    assert x[second]["tid"] == x[0]["tid"]
    assert x[second]["ts"] == pytest.approx(x[0]["ts"] + x[0]["dur"], abs=1e-3)
    assert_no_overlap_within_tracks(x)


def test_bad_timelines_are_input_errors(tmp_path):
    trace = small_trace(dp=1, pp=1, steps=1)
    start, end = trace.ops["start_ts"], trace.end_ts
    with pytest.raises(InputError, match="one per trace row"):
        write_perfetto(tmp_path, trace, {"measured": (start[:-1], end[:-1])})
    with pytest.raises(InputError, match="plain file name"):
        write_perfetto(tmp_path, trace, {"../escape": (start, end)})
    with pytest.raises(InputError, match="times must be seconds"):
        write_perfetto(tmp_path, trace, {"measured": (start * 1e6, end * 1e6)})  # µs, not s
    with pytest.raises(InputError, match="end before they start"):
        write_perfetto(tmp_path, trace, {"measured": (end, start)})
    assert not list(tmp_path.iterdir())  # nothing written when an argument is bad


def test_many_chunks_match_one_chunk(tmp_path, monkeypatch):
    trace = small_trace(dp=2, pp=2, steps=3)
    timelines = {"measured": (trace.ops["start_ts"], trace.end_ts)}
    (one,) = write_perfetto(tmp_path / "one", trace, timelines)
    monkeypatch.setattr("stragglers.report.perfetto.CHUNK_ROWS", 7)
    (many,) = write_perfetto(tmp_path / "many", trace, timelines)
    assert one.read_bytes() == many.read_bytes()


def test_ops_without_a_time_are_left_out_with_a_warning(tmp_path):
    trace = small_trace(dp=1, pp=1, steps=1)
    start = trace.ops["start_ts"].copy()
    start[3] = np.nan
    with pytest.warns(UserWarning, match="left out 1 ops"):
        (path,) = write_perfetto(tmp_path, trace, {"ideal": (start, trace.end_ts)})
    _, x, _ = events_by_phase(path)
    assert len(x) == len(trace) - 1


@pytest.mark.parametrize("scale", [1, 2**40], ids=["offset", "rank-fallback"])
def test_running_max_restarts_per_group(scale):
    from stragglers.report.perfetto import _running_max_per_group

    values = np.array([5, 3, 9, 1, 2, 8, 7, 4], dtype=np.int64) * scale
    group = np.array([0, 0, 0, 1, 1, 2, 2, 2])
    expected = np.array([5, 5, 9, 1, 2, 8, 8, 8], dtype=np.int64) * scale
    np.testing.assert_array_equal(_running_max_per_group(values, group if scale == 1 else group * 10**7), expected)


def test_real_ndtimeline_trace_exports_without_losing_ops(tmp_path, ndtimeline_dir):
    from stragglers.trace.load import load_trace

    trace = load_trace(ndtimeline_dir / "trace-ST.parquet")
    # NDTimeline restarts the clock every step: export one step (the analysis lays steps out).
    trace = trace.select(trace.ops["step"] == trace.ops["step"][0])
    (path,) = write_perfetto(tmp_path, trace, {"measured": (trace.ops["start_ts"],
                                                            trace.end_ts)})
    _, x, meta = events_by_phase(path)
    assert len(x) == len(trace)
    assert_no_overlap_within_tracks(x)  # so Perfetto drops nothing
    lanes = [e["args"]["name"] for e in meta if e["name"] == "thread_name"]
    assert not [name for name in lanes if "#" in name]  # its overlaps are only timer noise
    assert len({e["pid"] for e in x}) == trace.meta.dp_size * trace.meta.pp_size


def test_timelines_carry_the_result_and_the_reader_notes(tmp_path):
    from stragglers.trace.synth import generate
    from stragglers.whatif import analyze_with_model, timelines

    trace = generate(dp=2, pp=2, microbatches=4, steps=3, seed=2, slow_worker=(0, 1, 1.5))
    trace.note("clock", "clock alignment residual 0.2 ms")
    result, w = analyze_with_model(trace)
    rows, lines = timelines(w, trace)
    paths = write_perfetto(tmp_path, rows, lines, result)
    assert sorted(p.stem for p in paths) == ["ideal", "measured"]
    for path in paths:
        other = json.loads(path.read_text())["otherData"]
        assert other["slowdown"] == pytest.approx(result.slowdown) and other["straggling"]
        assert other["notes"] == ["clock alignment residual 0.2 ms"]
        assert other["timeline"] == path.stem and other["schema_version"] >= 1
