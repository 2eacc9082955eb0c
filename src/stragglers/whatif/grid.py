"""Lay a trace on a grid: template op × DP rank × step, since DP ranks and steps share a schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.model import OPTYPE_CODES, Trace
from stragglers.wording import ranges

GC = OPTYPE_CODES["gc"]
FWD = OPTYPE_CODES["forward-compute"]
BWD = OPTYPE_CODES["backward-compute"]
# the weight-gradient half of a split backward (zero-bubble schedules): compute, like BWD
BWW = OPTYPE_CODES["backward-weight-compute"]
# compute a worker does between its communication ops (absent on one worker: zero)
_WORK = (FWD, BWD, BWW, OPTYPE_CODES["optimizer"])
_SEQ_BITS = 24
_OPTYPE_BITS = 5


@dataclass
class OpGrid:
    """Ops of complete steps on a dense grid; node = (stage, optype, seq) shared by DP ranks and steps."""

    node_stage: np.ndarray      # [N]
    node_optype: np.ndarray     # [N] optype codes
    node_seq: np.ndarray        # [N] seq_id, or for gc the number of fwd/bwd ops before it
    dp_ranks: np.ndarray        # [D] DP rank ids
    steps: np.ndarray           # [T] step ids
    start: np.ndarray           # [N, D, T] measured start (NaN where absent)
    duration: np.ndarray        # [N, D, T] measured duration (0 where absent)
    present: np.ndarray         # [N, D, T] bool
    row: np.ndarray             # [N, D, T] row index in the trace (-1 where absent)
    pp_size: int
    node_mc: np.ndarray         # [N] local model chunk (from the first replica)
    node_gmc: np.ndarray        # [N] global model chunk of compute ops (mc·pp + stage)
    vpp_size: int = 1
    warnings: list[str] = field(default_factory=list)
    # compute ops are pieces cut at collectives (profiler traces): the i-th piece of a step
    # is one kind of work, the pieces are not (idealise.identities)
    compute_by_index: bool = False
    # [N, D] the process group each template op ran in on each DP rank (a job-wide id; -1
    # unknown), where the trace says (its `pg` column); None: every collective syncs all DP ranks
    node_pg: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """(nodes, DP ranks, steps)."""
        return self.start.shape

    def select_steps(self, keep: np.ndarray) -> "OpGrid":
        """The same grid restricted to the steps where keep (bool [T]) is true."""
        from dataclasses import replace

        return replace(self, steps=self.steps[keep], start=self.start[:, :, keep],
                       duration=self.duration[:, :, keep], present=self.present[:, :, keep],
                       row=self.row[:, :, keep], warnings=list(self.warnings))

    def node_name(self, n: int) -> str:
        """A readable name of a template op, for errors."""
        from stragglers.trace.model import OPTYPES

        return f"{OPTYPES[self.node_optype[n]]} #{self.node_seq[n]} on stage {self.node_stage[n]}"


def dense_ids(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(sorted unique values, index of each value in them); a lookup table when the range is small."""
    lo, hi = int(values.min()), int(values.max())
    if hi - lo < 50_000_000:
        at = values - lo if lo else values          # (one offset copy, none from 0)
        seen = np.zeros(hi - lo + 1, dtype=bool)
        seen[at] = True
        uniq = np.flatnonzero(seen) + lo
        # 4-byte indices (fewer than 50M values): half the memory traffic of the gather
        lookup = np.cumsum(seen, dtype=np.int32) - 1
        return uniq.astype(values.dtype), lookup[at]
    uniq, inverse = np.unique(values, return_inverse=True)
    return uniq, inverse


def gc_slots(trace: Trace, worker_step: np.ndarray) -> np.ndarray:
    """For each gc row, the number of fwd/bwd compute ops before it on its worker in its step."""
    ops = trace.ops
    is_compute = (ops["optype"] == FWD) | (ops["optype"] == BWD)
    is_gc = ops["optype"] == GC
    rows = np.flatnonzero(is_compute | is_gc)
    comp = is_compute[rows]
    # gc sorts after a compute op that starts at the same time (its pause follows that op).
    order = rows[np.lexsort((~comp, ops["start_ts"][rows],
                             worker_step[rows]))]
    c = is_compute[order].astype(np.int64)
    csum = np.cumsum(c) - c                                   # compute ops before, globally
    ws = worker_step[order]
    first = np.ones(len(order), dtype=bool)
    first[1:] = ws[1:] != ws[:-1]
    base = np.maximum.accumulate(np.where(first, csum, 0))    # ... at the start of the group
    slots = np.zeros(len(ops["step"]), dtype=np.int64)
    slots[order] = csum - base
    return slots


def one_op_per_cell(flat: np.ndarray, cells: int, trace: Trace) -> np.ndarray:
    """Ops per (template op, DP rank, step) cell; two on one cell are refused, the first named."""
    counts = np.bincount(flat, minlength=cells)
    if counts.max() > 1:
        ops = trace.ops
        dup = int(np.flatnonzero(counts[flat] > 1)[0])
        raise InputError(trace.source, "seq_id", f"two ops share (dp_rank={ops['dp_rank'][dup]}, "
                         f"stage={ops['stage'][dup]}, step={ops['step'][dup]}, "
                         f"optype={trace.optype_names()[dup]}, seq_id={ops['seq_id'][dup]}); "
                         "expected seq_id to number each op type within a step and worker")
    return counts


def build_grid(trace: Trace, steps: list[int] | None = None) -> OpGrid:
    """Place every op on the grid, drop incomplete steps with a warning, reject duplicates."""
    ops = trace.ops
    source_rows = None   # grid.row indexes the caller's trace, whatever steps were selected
    if steps is not None:
        keep = np.isin(ops["step"], np.asarray(steps))
        if not keep.any():
            have = np.unique(ops["step"])
            raise InputError(trace.source, "step", f"none of the requested steps are in the trace "
                             f"(it has {len(have)} steps, {int(have.min())}–{int(have.max())})")
        source_rows = np.flatnonzero(keep)
        trace = trace.select(keep)
        ops = trace.ops
    dp_ranks, d_idx = dense_ids(ops["dp_rank"])
    step_ids, t_idx = dense_ids(ops["step"])
    seq = ops["seq_id"].astype(np.int64)
    is_gc = ops["optype"] == GC
    if is_gc.any():
        worker_step = (d_idx.astype(np.int64) * (int(ops["stage"].max()) + 1)
                       + ops["stage"]) * len(step_ids) + t_idx
        seq = np.where(is_gc, gc_slots(trace, worker_step), seq)
    if seq.min() < 0 or seq.max() >= (1 << _SEQ_BITS):
        raise InputError(trace.source, "seq_id", f"expected 0 ≤ seq_id < {1 << _SEQ_BITS}")
    key = ((ops["stage"].astype(np.int64) << (_SEQ_BITS + _OPTYPE_BITS))
           | (ops["optype"].astype(np.int64) << _SEQ_BITS) | seq)
    compact = (ops["stage"].astype(np.int64) * 32 + ops["optype"]) * (int(seq.max()) + 1) + seq
    _, node = dense_ids(compact)
    keys = np.zeros(int(node.max()) + 1, dtype=np.int64)
    keys[node] = key
    n, d, t = len(keys), len(dp_ranks), len(step_ids)
    flat = (node.astype(np.int64) * d + d_idx) * t + t_idx
    present = (one_op_per_cell(flat, n * d * t, trace) > 0).reshape(n, d, t)
    node_stage = (keys >> (_SEQ_BITS + _OPTYPE_BITS)).astype(np.int32)
    node_optype = ((keys >> _SEQ_BITS) & ((1 << _OPTYPE_BITS) - 1)).astype(np.int8)
    node_seq = (keys & ((1 << _SEQ_BITS) - 1)).astype(np.int64)
    warnings: list[str] = []
    complete = _complete_steps(present, node_optype, node_stage, dp_ranks, step_ids, warnings)
    if not complete.any():
        raise InputError(trace.source, None, "no step has ops from every worker; "
                         + (warnings[0] if warnings else "cannot analyse"))
    start = np.full(n * d * t, np.nan)
    start[flat] = ops["start_ts"]
    duration = np.zeros(n * d * t)
    duration[flat] = ops["duration"]
    row = np.full(n * d * t, -1, dtype=np.int64)
    row[flat] = np.arange(len(flat)) if source_rows is None else source_rows
    shape = (n, d, t)
    pp = max(trace.meta.pp_size, int(node_stage.max()) + 1)
    node_mc, node_gmc = _chunks(ops, node, n, node_stage, pp)
    vpp = max(trace.meta.vpp_size, int(node_mc.max()) + 1)
    node_pg = None
    if "pg" in ops:
        pg = np.full(n * d * t, -1, dtype=np.int64)
        pg[flat] = ops["pg"]
        node_pg = pg.reshape(n, d, t).max(axis=2)      # the same group in every step
    grid = OpGrid(node_stage, node_optype, node_seq, dp_ranks, step_ids[complete],
                  start.reshape(shape)[:, :, complete], duration.reshape(shape)[:, :, complete],
                  present[:, :, complete], row.reshape(shape)[:, :, complete],
                  pp_size=pp, node_mc=node_mc, node_gmc=node_gmc, vpp_size=vpp, warnings=warnings,
                  compute_by_index=bool(trace.meta.extra.get("compute_split_at_collectives")),
                  node_pg=node_pg)
    _check_stages(grid, trace)
    return grid


def _chunks(ops, node, n, node_stage, pp) -> tuple[np.ndarray, np.ndarray]:
    """Model chunk and global chunk per template op (any replica holds the same values)."""
    node_mc = np.zeros(n, dtype=np.int64)
    node_gmc = np.full(n, -1, dtype=np.int64)
    node_mc[node] = np.maximum(ops["mc"], 0)
    node_gmc[node] = ops["gmc"]
    # Traces without chunk ids: the global chunk of a compute op is mc·pp + stage.
    node_gmc = np.where(node_gmc < 0, node_mc * pp + node_stage, node_gmc)
    return node_mc, node_gmc


def _complete_steps(present, node_optype, node_stage, dp_ranks, step_ids, warnings) -> np.ndarray:
    """Steps where every communication op of the schedule is present on every DP rank, and
    every worker computes.

    A compute op absent on one worker in a step whose communication it all did is taken as
    zero (like a gc slot without a pause): profilers split a rank's work into runs at its
    collectives and at phase changes, and a rank whose trace lost or merged a run has one
    fewer than its peers; its collectives still say that the step was whole.
    """
    compute = np.isin(node_optype, _WORK)
    required = (node_optype != GC) & ~compute
    worker_missing = np.zeros((len(dp_ranks), int(node_stage.max()) + 1, len(step_ids)), bool)
    for s in np.unique(node_stage):
        sel = required & (node_stage == s)
        worker_missing[:, s, :] = ~present[sel].all(axis=0)
        if (compute & (node_stage == s)).any():   # none at all: _check_stages says so
            worker_missing[:, s, :] |= ~present[compute & (node_stage == s)].any(axis=0)
    bad_steps = worker_missing.any(axis=(0, 1))
    if bad_steps.any():
        workers = sorted({(int(dp_ranks[a]), int(b)) for a, b, _ in zip(*np.nonzero(worker_missing))})
        steps = [int(s) for s in step_ids[bad_steps]]
        shown = ", ".join(f"(dp {a}, pp {b})" for a, b in workers[:8])
        warnings.append(f"{len(steps)} of {len(step_ids)} steps are incomplete and were left out "
                        f"(steps {ranges(steps)}): ops missing from workers {shown}"
                        + (" …" if len(workers) > 8 else ""))
    absent = ~present[compute][:, :, ~bad_steps]
    if absent.any():
        warnings.append(f"{int(absent.sum())} compute op(s) absent on some workers in complete "
                        "steps (their traces hold fewer compute runs there than their peers') "
                        "were taken as zero")
    return np.logical_not(bad_steps)


def _check_stages(grid: OpGrid, trace: Trace) -> None:
    """Every stage must hold compute ops; otherwise the trace is not a training step."""
    for s in range(int(grid.node_stage.max()) + 1):
        sel = grid.node_stage == s
        if not np.any(np.isin(grid.node_optype[sel], (FWD, BWD))):
            raise InputError(trace.source, "optype", f"stage {s} has no forward/backward-compute "
                             "ops; expected compute on every pipeline stage")
