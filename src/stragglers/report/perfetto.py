"""Perfetto / Chrome-trace JSON of op timelines: one process per worker, one track per stream."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from stragglers.errors import InputError
from stragglers.trace.model import OPTYPES, STREAM_OF_OPTYPE, STREAMS, Trace
from stragglers.whatif.result import SCHEMA_VERSION, AnalysisResult

# Rows per formatting chunk: bounds memory and keeps arrow's 32-bit string offsets safe.
CHUNK_ROWS = 1 << 20
# Overlapping ops on one stream go to extra lanes ("compute #2"); past this many, they share
# the last lane and Perfetto may drop some of them.
MAX_LANES = 8
# Overlaps up to TRIM_NS, or up to TRIM_FRACTION of the later op, are timer noise or float32
# rounding (real NDTimeline traces: 2-4 µs on ms ops, up to 0.1 ms on 0.5 s ops): trimmed off
# the later op rather than moving it to a lane of its own.
TRIM_NS = 10_000
TRIM_FRACTION = 0.01
LANE_STRIDE = 16  # tid = lane * LANE_STRIDE + stream index + 1
MAX_SECONDS = 9e9  # int64 nanoseconds reach ±9.2e9 s (year 2262)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def write_perfetto(directory: str | Path, trace: Trace,
                   timelines: Mapping[str, tuple[np.ndarray, np.ndarray]],
                   result: AnalysisResult | None = None) -> list[Path]:
    """Write `<name>.json` per timeline (start, end arrays in seconds aligned with the trace rows).

    With the AnalysisResult, each file's otherData also carries S, the verdict and the
    reader's notes, so a timeline opened on its own says what it shows and what it cannot.
    """
    directory = Path(directory)
    other: dict[str, Any] = {"job": trace.meta.name, "run_id": trace.meta.run_id,
                             "source": trace.source}
    if result is not None:
        other.update({"slowdown": result.slowdown, "straggling": result.straggling,
                      "schema_version": SCHEMA_VERSION,
                      "notes": [n.message for n in result.notes]})
    checked = {name: _check_timeline(name, trace, *pair) for name, pair in timelines.items()}
    directory.mkdir(parents=True, exist_ok=True)
    worker_pid, worker_labels = _worker_pids(trace)
    stream = STREAM_OF_OPTYPE[trace.ops["optype"]].astype(np.int64)
    paths = []
    for name, (start, end) in checked.items():
        path = directory / f"{name}.json"
        _write_one(path, name, trace, start, end, worker_pid, worker_labels, stream, other)
        paths.append(path)
    return paths


def _check_timeline(name: str, trace: Trace, start: np.ndarray, end: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise InputError("timelines", str(name),
                         "a timeline name must be a plain file name (letters, digits, _ . -)")
    start = np.asarray(start, dtype=np.float64)
    end = np.asarray(end, dtype=np.float64)
    if start.shape != (len(trace),) or end.shape != (len(trace),):
        raise InputError("timelines", name, f"expected start and end arrays of {len(trace)} "
                         f"values (one per trace row), got shapes {start.shape} and {end.shape}")
    with np.errstate(invalid="ignore"):
        huge = (np.abs(start) > MAX_SECONDS) | (np.abs(end) > MAX_SECONDS)
    if huge.any():
        i = int(np.argmax(huge))
        raise InputError("timelines", name, f"times must be seconds (|t| < {MAX_SECONDS:.0e}); "
                         f"row {i} has start {float(start[i])!r}, end {float(end[i])!r}")
    bad = end < start - 1e-9
    if bad.any():
        i = int(np.argmax(bad))
        raise InputError("timelines", name, f"{int(bad.sum())} ops end before they start "
                         f"(first: row {i}, start {float(start[i])!r}, end {float(end[i])!r})")
    return start, end


def _worker_pids(trace: Trace) -> tuple[np.ndarray, dict[int, str]]:
    """A stable pid per (dp, pp): the same worker has the same pid in every file of a job."""
    dp = trace.ops["dp_rank"].astype(np.int64)
    pp = trace.ops["stage"].astype(np.int64)
    pp_span = max(int(trace.meta.pp_size), int(pp.max()) + 1 if len(pp) else 1)
    pid = 1 + dp * pp_span + pp
    labels = {}
    for p in np.unique(pid):
        d, s = divmod(int(p) - 1, pp_span)
        labels[int(p)] = f"dp {d} / pp {s}"
    return pid, labels


def _assign_lanes(track: np.ndarray, ts_ns: np.ndarray, end_ns: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, int]:
    """Lane per op so that no two ops of one lane overlap (Perfetto drops improperly nested
    slices), and starts with clock-rounding overlaps trimmed. Lane 0 takes every op that starts
    after all earlier ops of its track ended (up to a sliver, see TRIM_NS), and every point.
    Returns (lane, trimmed start, number of ops left overlapping in the last lane)."""
    lane = np.zeros(len(track), dtype=np.int64)
    ts_out = ts_ns.copy()
    pending = np.arange(len(track))
    for current in range(MAX_LANES):
        if not len(pending):
            return lane, ts_out, 0
        order = pending[np.lexsort((-end_ns[pending], ts_ns[pending], track[pending]))]
        trk, ts, end = track[order], ts_ns[order], end_ns[order]
        new_track = np.ones(len(order), dtype=bool)
        new_track[1:] = trk[1:] != trk[:-1]
        running = _running_max_per_group(end, np.cumsum(new_track) - 1)
        prev_max = np.empty_like(running)
        prev_max[0] = ts[0]
        prev_max[1:] = np.where(new_track[1:], ts[1:], running[:-1])
        overlap = prev_max - ts
        # A point is always properly nested; a sliver of overlap is clock rounding: trim it.
        slack = np.maximum(TRIM_NS, (TRIM_FRACTION * (end - ts)).astype(np.int64))
        trim = (overlap > 0) & (overlap <= slack) & (end >= prev_max)
        fits = (overlap <= 0) | (end == ts) | trim
        ts_out[order[trim]] = prev_max[trim]
        lane[order[~fits]] = current + 1
        pending = order[~fits]
    lane[pending] = MAX_LANES - 1
    return lane, ts_out, len(pending)


def _running_max_per_group(values: np.ndarray, group: np.ndarray) -> np.ndarray:
    """Cumulative max of int64 values that restarts at each group (groups ascending)."""
    # Offset each group above all earlier ones so one accumulate never carries a max across
    # groups; on values directly when that fits in int64, else on their ranks.
    low = values.min()
    span = int(values.max() - low) + 1
    if span * (int(group[-1]) + 1) < 2**62:
        return np.maximum.accumulate(values - low + group * span) - group * span + low
    uniq, rank = np.unique(values, return_inverse=True)
    return uniq[np.maximum.accumulate(group * len(uniq) + rank.reshape(-1)) - group * len(uniq)]


def _to_ns(seconds: np.ndarray) -> np.ndarray:
    """Seconds as int64 nanoseconds, exact to the ns even for epoch timestamps."""
    whole = np.floor(seconds)
    return whole.astype(np.int64) * 1_000_000_000 + np.rint((seconds - whole) * 1e9).astype(np.int64)


def _ns_text(ns: np.ndarray) -> pa.Array:
    """Integer nanoseconds as microsecond decimals ("12.345"); never exponent notation."""
    sign = pa.array(np.where(ns < 0, "-", ""))
    mag = np.abs(ns)
    whole = pc.cast(pa.array(mag // 1000), pa.string())
    frac = pc.utf8_lpad(pc.cast(pa.array(mag % 1000), pa.string()), 3, "0")
    return pc.binary_join_element_wise(sign, whole, ".", frac, "")


def _write_one(path: Path, name: str, trace: Trace, start: np.ndarray, end: np.ndarray,
               worker_pid: np.ndarray, worker_labels: dict[int, str], stream: np.ndarray,
               other: dict[str, Any]) -> None:
    finite = np.isfinite(start) & np.isfinite(end)
    if not finite.all():
        warnings.warn(f"{path}: left out {int((~finite).sum())} ops whose start or end in "
                      f"timeline '{name}' is not a finite number", stacklevel=3)
        trace, start, end = trace.select(finite), start[finite], end[finite]
        worker_pid, stream = worker_pid[finite], stream[finite]
    ts_ns = _to_ns(start)
    end_ns = np.maximum(_to_ns(end), ts_ns)
    track = worker_pid * LANE_STRIDE + stream
    lane, ts_ns, crowded = _assign_lanes(track, ts_ns, end_ns)
    if crowded:
        warnings.warn(f"{path}: {crowded} ops overlap more than {MAX_LANES} others on their "
                      f"stream; they share lane {MAX_LANES} and Perfetto may hide some of them",
                      stacklevel=3)
    tid = lane * LANE_STRIDE + stream + 1
    # Per op type, the constant JSON text that starts an event: name and category.
    heads = pa.array([f'{{"name":{json.dumps(o)},"cat":"{STREAMS[STREAM_OF_OPTYPE[i]]}",'
                      f'"ph":"X","pid":' for i, o in enumerate(OPTYPES)])
    optype = trace.ops["optype"].astype(np.int64)
    step = trace.ops["step"]
    mb_id = trace.ops["mb_id"]
    with open(path, "wb") as out:
        out.write(b'{"displayTimeUnit":"ms","otherData":'
                  + json.dumps({**other, "timeline": name}, allow_nan=False).encode()
                  + b',\n"traceEvents":[\n')
        for lo in range(0, len(trace), CHUNK_ROWS):
            sl = slice(lo, lo + CHUNK_ROWS)
            text = pc.binary_join_element_wise(
                heads.take(pa.array(optype[sl])),
                _int_text(worker_pid[sl]), ',"tid":', _int_text(tid[sl]),
                ',"ts":', _ns_text(ts_ns[sl]), ',"dur":', _ns_text(end_ns[sl] - ts_ns[sl]),
                ',"args":{"step":', _int_text(step[sl]), ',"mb_id":', _int_text(mb_id[sl]),
                "}},\n", "")
            out.write(_string_bytes(text))
        tracks = np.unique(worker_pid * (MAX_LANES * LANE_STRIDE) + tid)
        out.write(_metadata_events(worker_labels, np.divmod(tracks, MAX_LANES * LANE_STRIDE)))
        out.write(b"\n]}\n")


def _int_text(values: np.ndarray) -> pa.Array:
    return pc.cast(pa.array(np.asarray(values, dtype=np.int64)), pa.string())


def _string_bytes(text: pa.Array) -> memoryview:
    """The concatenated characters of a string array, without copying."""
    offsets = np.frombuffer(text.buffers()[1], dtype=np.int32)
    first, last = offsets[text.offset], offsets[text.offset + len(text)]
    return memoryview(text.buffers()[2])[first:last]


def _metadata_events(worker_labels: dict[int, str],
                     pid_tid: tuple[np.ndarray, np.ndarray]) -> bytes:
    """process_name / thread_name events so every process and track is labelled."""
    events = []
    for pid, label in worker_labels.items():
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": pid,
                       "args": {"sort_index": pid}})
    for pid, tid in zip(*(a.tolist() for a in pid_tid)):
        lane, stream = divmod(int(tid) - 1, LANE_STRIDE)
        label = STREAMS[stream] + (f" #{lane + 1}" if lane else "")
        events.append({"name": "thread_name", "ph": "M", "pid": int(pid), "tid": int(tid),
                       "args": {"name": label}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": int(pid), "tid": int(tid),
                       "args": {"sort_index": int(tid)}})
    return ",\n".join(json.dumps(e, separators=(",", ":")) for e in events).encode()
