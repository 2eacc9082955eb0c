"""read_kineto: PyTorch-profiler traces (one file per rank) → one op-table Trace."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Iterable

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.kineto.align import clock_offsets
from stragglers.trace.kineto.events import read_rank_events
from stragglers.trace.kineto.ops import RankRows, rank_rows
from stragglers.trace.kineto.placement import (
    JobShape, job_shape, place, rank_of, world_size_of)
from stragglers.trace.model import COLUMNS, JobMeta, Trace

TRACE_SUFFIXES = (".json", ".json.gz")


def kineto_files(paths: Path | str | Iterable[Path | str]) -> list[Path]:
    """The trace files named: a directory's *.json / *.json.gz files, a single file, or a list."""
    items = [paths] if isinstance(paths, (str, Path)) else list(paths)
    if not items:
        raise InputError("<paths>", None, "no trace files given")
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.is_file() and not f.name.startswith(".")
                           and f.name.endswith(TRACE_SUFFIXES))
            if not found:
                raise InputError(p, None, "no .json or .json.gz profiler traces in this directory")
            files.extend(found)
        elif not p.exists():
            raise InputError(p, None, "no such file or directory")
        else:
            files.append(p)
    return files


def looks_like_kineto(path: Path | str) -> bool:
    """Whether a path is a Kineto trace file, or a directory of them (and not one of our runs)."""
    p = Path(path)
    if p.is_dir():
        if (p / "meta.json").exists():
            return False
        return any(_sniff(f) for f in p.iterdir()
                   if f.is_file() and f.name.endswith(TRACE_SUFFIXES))
    return p.is_file() and p.name.endswith(TRACE_SUFFIXES) and _sniff(p)


def _sniff(path: Path) -> bool:
    """The first 64 KiB mention a profiler-trace key."""
    import gzip
    import zlib

    try:
        with open(path, "rb") as fh:
            head = fh.read(2)
        opener = gzip.open if head == b"\x1f\x8b" else open
        with opener(path, "rb") as fh:
            chunk = fh.read(65536)
    except (OSError, EOFError, zlib.error):
        return False
    return any(k in chunk for k in (b'"traceEvents"', b'"schemaVersion"', b'"distributedInfo"'))


def read_kineto(paths: Path | str | Iterable[Path | str], *, dp_size: int | None = None,
                pp_size: int | None = None, name: str | None = None) -> Trace:
    """Read PyTorch-profiler traces, one file per rank, into one op table on one clock."""
    files = kineto_files(paths)
    source = str(paths) if isinstance(paths, (str, Path)) else str(files[0].parent)
    notes: list[str] = []
    per_rank: dict[int, RankRows] = {}
    rank_file: dict[int, str] = {}
    origin_s: int | None = None
    starts: dict[int, np.ndarray] = {}
    sync_s: dict[int, dict[tuple, float]] = {}
    hosts: dict[int, str | None] = {}
    shape: JobShape | None = None
    world_seen: tuple[int, str] | None = None
    for path in files:
        ev = read_rank_events(path)  # one file decoded at a time; dropped before the next
        rank = rank_of(ev, notes)
        world = world_size_of(ev)
        if world is not None:
            if world_seen is not None and world != world_seen[0]:
                raise InputError(path, "distributedInfo.world_size", f"{world}, but "
                                 f"{world_seen[1]} says {world_seen[0]}; pass the files of one job")
            world_seen = world_seen or (world, str(path))
        if shape is None:
            shape = job_shape(world or len(files), dp_size, pp_size, str(path), world is not None)
        elif world is not None and world != shape.world_size:
            raise InputError(path, "distributedInfo.world_size", f"{world}, but the job has "
                             f"{shape.world_size} ranks (from the number of files)")
        if rank in rank_file:
            raise InputError(path, "distributedInfo.rank", f"rank {rank} again (also in "
                             f"{rank_file[rank]}); pass one file per rank from one profiling "
                             "window")
        rows = rank_rows(ev, place(ev, rank, shape))
        if origin_s is None:
            # Times become seconds since a whole-second origin so float64 keeps sub-µs detail.
            origin_s = (ev.base_ns + int(rows.start_us.min() * 1000)) // 1_000_000_000
        shift_us = (origin_s * 1_000_000_000 - ev.base_ns) / 1000.0
        starts[rank] = (rows.start_us - shift_us) / 1e6
        sync_s[rank] = {k: (v - shift_us) / 1e6 for k, v in rows.sync.items()}
        per_rank[rank] = rows
        rank_file[rank] = str(path)
        hosts[rank] = ev.host
        del ev
    assert shape is not None and origin_s is not None
    offsets, quality, align_notes = clock_offsets(sync_s, hosts)
    shared = sorted(r for r, q in quality.items() if "same_host_as" in q)
    if shared:
        align_notes.append(f"{len(shared)} rank(s) run on the same host as a lower rank (trace "
                           "host_name) and share its clock: not shifted")
    notes += align_notes
    ranks = sorted(per_rank)
    for r in ranks:
        starts[r] = starts[r] - offsets.get(r, 0.0)
    low = min(float(s.min()) for s in starts.values())
    if low < 0:  # an earlier rank than the first file: move the origin back whole seconds
        back = math.floor(low)
        origin_s += back
        for r in ranks:
            starts[r] = starts[r] - back
    ops = _columns(per_rank, starts)
    if not shape.known and ranks[-1] >= shape.world_size:
        shape.world_size = shape.dp_size = ranks[-1] + 1
    if not shape.known:
        notes.append(f"no distributedInfo.world_size: world size {shape.world_size} assumed from "
                     "the files and ranks given")
    notes += _notes(per_rank, shape)
    max_stage = int(ops["stage"].max())
    pp = max(shape.pp_size, max_stage + 1)
    dp = shape.dp_size if pp == shape.pp_size else max(1, shape.world_size // (pp * shape.tp_size))
    meta = JobMeta(name=name or _default_name(paths, files), dp_size=dp, pp_size=pp,
                   tp_size=shape.tp_size, world_size=shape.world_size,
                   extra={"source_format": "kineto",
                          "files": {str(r): rank_file[r] for r in ranks},
                          "time_origin_unix_s": origin_s,
                          "clock_offsets_s": {str(r): offsets.get(r, 0.0) for r in ranks},
                          "clock_alignment": {str(r): quality.get(r, {}) for r in ranks},
                          "notes": notes})
    return Trace(ops, meta, source)


def _columns(per_rank: dict[int, RankRows], starts: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
    """Concatenate ranks' rows; seq_id numbers each optype by start within (step, rank)."""
    parts: dict[str, list[np.ndarray]] = {c: [] for c in COLUMNS}
    for r in sorted(per_rank):
        rows = per_rank[r]
        n = len(rows.step)
        p = rows.placement
        start = starts[r]
        order = np.lexsort((start, rows.optype, rows.step))
        step, optype = rows.step[order], rows.optype[order]
        start, dur = start[order], rows.dur_us[order]
        first = np.ones(n, dtype=bool)
        first[1:] = (step[1:] != step[:-1]) | (optype[1:] != optype[:-1])
        idx = np.arange(n)
        seq = idx - np.maximum.accumulate(np.where(first, idx, 0))
        is_compute = optype <= 1  # forward/backward-compute carry microbatch 0
        parts["rank"].append(np.full(n, r))
        parts["dp_rank"].append(np.full(n, p.dp_rank))
        parts["stage"].append(np.full(n, p.stage))
        parts["step"].append(step)
        parts["optype"].append(optype)
        parts["start_ts"].append(start)
        parts["duration"].append(dur / 1e6)
        parts["seq_id"].append(seq)
        parts["mb_id"].append(np.where(is_compute, 0, -1))
        parts["mc"].append(np.zeros(n))
        parts["gmc"].append(np.full(n, p.stage))
    return {c: np.concatenate(parts[c]).astype(dt) for c, dt in COLUMNS.items()}


def _notes(per_rank: dict[int, RankRows], shape: JobShape) -> list[str]:
    """What the reader assumed or left out, summed over ranks (one line each)."""
    total: Counter = Counter()
    for rows in per_rank.values():
        total.update(rows.counts)
    notes = []
    placements = [rows.placement for rows in per_rank.values()]
    if shape.how == "none" and all(p.stage == 0 for p in placements):
        notes.append("no pipeline information (no pp_size given, no pipeline group in "
                     "distributedInfo.pg_config): every rank is a data-parallel rank at stage 0 "
                     "with dp_rank = rank")
    elif shape.how == "given":
        notes.append(f"ranks placed from dp_size={shape.dp_size}, pp_size={shape.pp_size} "
                     f"(tp={shape.tp_size}) assuming Megatron rank order (tp fastest, pp slowest)")
    else:
        notes.append("pipeline stages taken from the pipeline group in distributedInfo.pg_config")
    cpu = sorted(r for r, rows in per_rank.items() if rows.mode == "cpu")
    if cpu:
        notes.append(f"{len(cpu)} rank(s) have no GPU rows (e.g. rank {cpu[0]}): compute ops are "
                     "runs of top-level CPU ops and collectives come from gloo:/nccl: annotations "
                     "(or record_param_comms)")
    if total["nccl without device rows"]:
        notes.append("an NCCL job traced without GPU rows: CPU-side collective spans measure the "
                     "launch, not the transfer")
    left = {k[:-len(" left out")]: v for k, v in total.items() if k.endswith(" left out")}
    for kind, n in sorted(left.items()):
        if kind.startswith("p2p "):
            notes.append(f"{n} point-to-point {kind[4:]} op(s) left out: their direction "
                         "(forward/backward) is unknown without pipeline stages and peer ranks")
        else:
            notes.append(f"{n} {kind} collective(s) left out: the what-if model has no op type "
                         "for them (their time shows as gaps between compute ops); they still "
                         "align clocks")
    if total["kernels without launch"]:
        notes.append(f"{total['kernels without launch']} GPU kernel(s) had no launch record "
                     "(correlation id): their step came from the step span and their phase "
                     "from the kernel before them")
    if total["no backward marker"]:
        notes.append(f"{total['no backward marker']} rank(s) have no autograd::engine::"
                     "evaluate_function ops nor backward annotation: compute before the "
                     "optimizer counts as forward-compute")
    if total["backward from annotation"]:
        notes.append(f"{total['backward from annotation']} rank(s) have no autograd ops: backward "
                     "starts at a user annotation naming 'backward'")
    if total["runs clipped"]:
        notes.append(f"{total['runs clipped']} compute run(s) overlapped the next one on another "
                     "stream and were cut at its start")
    if total["outside steps"]:
        notes.append(f"{total['outside steps']} kernel(s)/op(s) outside every ProfilerStep#N "
                     "span were left out")
    if total["enqueue ops ignored"]:
        notes.append(f"{total['enqueue ops ignored']} record_param_comms/c10d enqueue op(s) "
                     "ignored in favour of the collective annotations")
    notes.append("optimizer rows span from the first Optimizer.step# annotation to the step end; "
                 "mb_id is 0 for all compute (one microbatch assumed)")
    return notes


def _default_name(paths, files: list[Path]) -> str:
    if isinstance(paths, (str, Path)) and Path(paths).is_dir():
        return Path(paths).resolve().name
    name = files[0].name
    for suffix in (".gz", ".json", ".pt.trace"):
        name = name.removesuffix(suffix)
    return name
