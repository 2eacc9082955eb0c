"""read_kineto: PyTorch-profiler traces (one file per rank) → one op-table Trace."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.columns import check_values
from stragglers.trace.kineto.align import clock_offsets
from stragglers.trace.kineto.events import DistributedInfo
from stragglers.trace.kineto.exchanges import merge_exchanges
from stragglers.trace.kineto.layout import (
    Pipelines, check_given_layout, pipelines_from_p2p)
from stragglers.trace.kineto.mix import check_metadata, check_overlap
from stragglers.trace.kineto.notes import reader_notes
from stragglers.trace.kineto.ops import Placement, RankParts, RankRows, rank_rows
from stragglers.trace.kineto.parse import parse_files
from stragglers.trace.kineto.unnamed import name_cross_stage
from stragglers.trace.kineto.placement import (JobShape, group_sizes, job_shape,
                                               model_parallel_groups, place, rank_of,
                                               single_process, undescribed_blocks,
                                               world_size_of)
from stragglers.trace.model import COLUMNS, OPTIONAL_COLUMNS, JobMeta, Trace

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
                raise InputError(p, None, "no .json or .json.gz profiler traces in this directory "
                                 "(expected one torch.profiler trace per rank)")
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
                pp_size: int | None = None, name: str | None = None,
                workers: int | None = None, tp_size: int | None = None) -> Trace:
    """Read PyTorch-profiler traces, one file per rank, into one op table on one clock.

    Files are parsed in parallel processes (`workers`, default: one per core, bounded by memory;
    1 parses one file at a time, in this process unless the input is 256 MB or more). What the
    reader assumed or left out is in `Trace.notes`.
    """
    files = kineto_files(paths)
    source = str(paths) if isinstance(paths, (str, Path)) else str(files[0].parent)
    notes: list[tuple[str, str]] = []
    parts = _ranks(parse_files(files, workers), notes)
    world, known = _world(parts, len(files))
    shape = job_shape(world, dp_size, pp_size, source, known, tp_size)
    check_metadata(parts)
    exchanged = merge_exchanges(parts)
    if exchanged:
        notes.append(("layout", f"send/recv of {len(exchanged)} process group(s) read as "
                      "exchanges among the group (each rank sends and receives at once from a "
                      "step's first transfer on, as ring attention does; a pipeline's first "
                      "transfer stands alone): one op per pair, synchronising the group"))
    found = pipelines_from_p2p(parts)
    check_given_layout(source, pp_size, shape.dp_size if tp_size else dp_size, parts, found,
                       shape.world_size)
    placements = _placements(parts, shape, found, notes)
    for r, where in placements.items():
        where.model_parallel = model_parallel_groups(parts[r], r, shape.tp_size)
    notes += [("layout", n) for n in name_cross_stage(parts, placements)]
    per_rank = {r: rank_rows(parts[r], placements[r]) for r in sorted(parts)}
    origin_s, starts, sync_s, spans_s = _one_time_base(parts, per_rank)
    hosts = {r: parts[r].host for r in parts}
    offsets, quality, align_notes = clock_offsets(
        sync_s, hosts, spans_s, {r: per_rank[r].ring_peers for r in per_rank})
    check_overlap(spans_s, offsets, {r: parts[r].source for r in parts})
    shared = sorted(r for r, q in quality.items() if "same_host_as" in q)
    if shared:
        align_notes.append(f"{len(shared)} rank(s) run on the same host as a lower rank (trace "
                           "host_name) and share its clock: not shifted")
    notes += [("clock", n) for n in align_notes]
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
    max_stage = int(ops["stage"].max())
    pp = max(shape.pp_size, max_stage + 1)
    dp = shape.dp_size if pp == shape.pp_size else max(1, shape.world_size // (pp * shape.tp_size))
    # each tensor-parallel rank is a worker (column) of its own: the table holds dp·tp of them
    workers_per_stage, implied_tp = dp * shape.tp_size, shape.tp_size
    notes = reader_notes(per_rank, parts, shape, pp, found, notes)
    missing = sorted(set(range(shape.world_size)) - set(ranks))
    dims = group_sizes(parts)
    blocks = undescribed_blocks(parts, shape.tp_size, shape.world_size)
    if blocks is not None:
        notes.append(("layout", f"all-reduces / all-gathers / reduce-scatters run in groups of "
                      f"{blocks} consecutive ranks that distributedInfo.pg_config does not "
                      "describe: read as data-parallel groups (their ranks workers that wait "
                      "for each other at the gradient sync); if they are tensor parallel, pass "
                      f"--tp-size {blocks}, or the diagnosis may name the wrong rank"))
    ep = dims.get("ep", 1)
    if dims:
        notes.append(("layout", "process groups show " + ", ".join(
            f"{k} = {v}" for k, v in sorted(dims.items())) + " (distributedInfo.pg_config, "
            "all-to-all groups); their collectives synchronise their own group"))
    meta = JobMeta(name=name or _default_name(paths, files), dp_size=workers_per_stage,
                   pp_size=pp, world_size=shape.world_size,
                   ep_size=ep if shape.world_size % ep == 0 else 1,
                   extra={"source_format": "kineto",
                          "files": {str(r): parts[r].source for r in ranks},
                          "ranks_read": ranks, "ranks_missing": missing,
                          "world_size_known": shape.known,
                          "tp_size_implied": implied_tp,
                          "group_sizes": dims,
                          "compute_split_at_collectives": True,
                          "compute_from": ("gpu kernels" if all(
                              per_rank[r].mode == "gpu" for r in ranks) else "cpu ops"),
                          "time_origin_unix_s": origin_s,
                          "clock_offsets_s": {str(r): offsets.get(r, 0.0) for r in ranks},
                          "clock_alignment": {str(r): quality.get(r, {}) for r in ranks}})
    check_values(ops, source)  # the checks every other reader's columns get
    trace = Trace(ops, meta, source)
    for kind, message in notes:
        trace.note(kind, message)
    return trace


def _ranks(parsed: list[RankParts], notes: list) -> dict[int, RankParts]:
    """Each file's rank; one file per rank."""
    out: dict[int, RankParts] = {}
    names: list[str] = []
    if len(parsed) == 1 and single_process(parsed[0]):
        # torch.profiler records distributedInfo whenever a process group exists: a lone file
        # without one, whose trace holds no collective at all, is a job of one process.
        parsed[0].distributed_info = DistributedInfo(rank=0, world_size=1)
        parsed[0].rank = 0
        notes.append(("ranks", f"{Path(parsed[0].source).name}: no distributedInfo and no "
                      "collective: read as a single-process run (rank 0 of 1)"))
    for p in parsed:
        rank = rank_of(p, names)
        if rank in out:
            raise InputError(p.source, "distributedInfo.rank", f"rank {rank} again (also in "
                             f"{out[rank].source}); pass one file per rank from one profiling "
                             "window")
        p.rank = rank
        out[rank] = p
    notes += [("ranks", n) for n in names]
    return out


def _world(parts: dict[int, RankParts], n_files: int) -> tuple[int, bool]:
    """World size from distributedInfo (all files must agree), else the number of files."""
    seen: tuple[int, str] | None = None
    for r in sorted(parts):
        w = world_size_of(parts[r])
        if w is None:
            continue
        if seen is not None and w != seen[0]:
            raise InputError(parts[r].source, "distributedInfo.world_size", f"{w}, but "
                             f"{seen[1]} says {seen[0]}; pass the files of one job")
        seen = seen or (w, parts[r].source)
    if seen is None:
        return max(n_files, max(parts) + 1), False
    for r, p in parts.items():
        if r >= seen[0]:
            raise InputError(p.source, "distributedInfo.rank", f"rank {r} is outside the world "
                             f"size {seen[0]}")
    return seen[0], True


def _placements(parts: dict[int, RankParts], shape: JobShape, found: Pipelines,
                notes: list) -> dict[int, Placement]:
    """DP rank and stage of every rank: from the send/recv pattern where it gives one (and
    agrees with a given pp_size), else the given sizes (Megatron order), else the process
    groups' names, else every rank a DP rank."""
    if found.chains and found.pp > 1 and shape.tp_size == 1 and shape.pp_size in (1, found.pp):
        per_stage = max(1, shape.world_size // found.pp)
        stages = found.stage

        def stage_of(peer: int) -> int:
            """The peer's stage; -10 (no neighbour of any stage) for a rank on no chain."""
            return stages.get(peer, -10)

        out = {}
        for i, chain in enumerate(sorted(found.chains)):
            head = chain[0]
            if all(r == head + k * per_stage for k, r in enumerate(chain)):
                dp_rank = head % per_stage            # Megatron order: pp slowest
            elif all(r == head + k for k, r in enumerate(chain)):
                dp_rank = head // found.pp            # stage fastest (rank = dp·pp + stage)
            else:
                dp_rank = i
            for stage, r in enumerate(chain):
                if r in parts:
                    out[r] = Placement(r, dp_rank, stage, stage_of, found.pp)
        shape.pp_size, shape.dp_size = found.pp, per_stage
        shape.how = "p2p"
        return out
    return {r: place(p, r, shape) for r, p in parts.items()}


def _one_time_base(parts: dict[int, RankParts], per_rank: dict[int, RankRows]):
    """Seconds since one whole-second origin for every rank's rows and sync points."""
    origin_s: int | None = None
    starts: dict[int, np.ndarray] = {}
    sync_s: dict[int, dict[tuple, float]] = {}
    spans_s: dict[int, dict[tuple, tuple[float, float]]] = {}
    for r in sorted(per_rank):
        rows, base = per_rank[r], parts[r].base_ns
        if origin_s is None:
            # Times become seconds since a whole-second origin so float64 keeps sub-µs detail.
            origin_s = (base + int(rows.start_us.min() * 1000)) // 1_000_000_000
        shift_us = (origin_s * 1_000_000_000 - base) / 1000.0
        starts[r] = (rows.start_us - shift_us) / 1e6
        sync_s[r] = {k: (v - shift_us) / 1e6 for k, v in rows.sync.items()}
        spans_s[r] = {k: ((a - shift_us) / 1e6, (b - shift_us) / 1e6)
                      for k, (a, b) in rows.sync_span.items()}
    assert origin_s is not None
    return origin_s, starts, sync_s, spans_s


def _columns(per_rank: dict[int, RankRows], starts: dict[int, np.ndarray]) -> dict[str, np.ndarray]:
    """Concatenate ranks' rows; seq_id numbers each optype by start within (step, rank); `pg`
    numbers the process groups the collectives ran in, one id per group name job-wide."""
    names = sorted({g for rows in per_rank.values() for g in rows.group if g is not None})
    pg_id = {g: i for i, g in enumerate(names)}
    parts: dict[str, list[np.ndarray]] = {c: [] for c in (*COLUMNS, "pg", "tokens", "sent")}
    for r in sorted(per_rank):
        rows = per_rank[r]
        n = len(rows.step)
        p = rows.placement
        start = starts[r]
        order = np.lexsort((start, rows.optype, rows.step))
        step, optype = rows.step[order], rows.optype[order]
        parts["pg"].append(np.array([pg_id.get(rows.group[i], -1) if rows.group else -1
                                     for i in order], dtype=np.int64))
        for column, values in (("tokens", rows.tokens), ("sent", rows.sent)):
            parts[column].append(np.asarray(values, dtype=np.int64)[order] if values
                                 else np.full(n, -1, dtype=np.int64))
        start, dur = start[order], rows.dur_us[order]
        first = np.ones(n, dtype=bool)
        first[1:] = (step[1:] != step[:-1]) | (optype[1:] != optype[:-1])
        idx = np.arange(n)
        seq = idx - np.maximum.accumulate(np.where(first, idx, 0))
        is_compute = optype <= 1
        # Pipelines: the i-th forward (backward) of a step is microbatch i; otherwise one
        # microbatch (DDP's backward pieces between bucket launches are not microbatches).
        mb = seq if p.pp_size > 1 else np.zeros(n, dtype=np.int64)
        parts["rank"].append(np.full(n, r))
        parts["dp_rank"].append(np.full(n, p.dp_rank))
        parts["stage"].append(np.full(n, p.stage))
        parts["step"].append(step)
        parts["optype"].append(optype)
        parts["start_ts"].append(start)
        parts["duration"].append(dur / 1e6)
        parts["seq_id"].append(seq)
        parts["mb_id"].append(np.where(is_compute, mb, -1))
        parts["mc"].append(np.zeros(n))
        parts["gmc"].append(np.full(n, p.stage))
    out = {c: np.concatenate(parts[c]).astype(dt) for c, dt in COLUMNS.items()}
    if names:
        out["pg"] = np.concatenate(parts["pg"]).astype(OPTIONAL_COLUMNS["pg"])
    for column in ("tokens", "sent"):   # all-to-alls with split sizes: rows received, sent
        moved = np.concatenate(parts[column])
        if (moved >= 0).any():
            out[column] = moved.astype(OPTIONAL_COLUMNS[column])
    return out


def _default_name(paths, files: list[Path]) -> str:
    if isinstance(paths, (str, Path)) and Path(paths).is_dir():
        return Path(paths).resolve().name
    name = files[0].name
    for suffix in (".gz", ".json", ".pt.trace"):
        name = name.removesuffix(suffix)
    return name
