"""Lay a trace on a grid: template op × DP rank × step, since DP ranks and steps share a schedule."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from stragglers.errors import InputError
from stragglers.trace.model import OPTYPE_CODES, OPTYPES, P2P_OPTYPES, Trace
from stragglers.whatif.realign import PARTNER, realigned_seq
from stragglers.whatif.rebuild import rebuild_lost, with_group
from stragglers.whatif.result import LeftOut
from stragglers.wording import ranges

GC = OPTYPE_CODES["gc"]
FWD = OPTYPE_CODES["forward-compute"]
BWD = OPTYPE_CODES["backward-compute"]
# the weight-gradient half of a split backward (zero-bubble schedules): compute, like BWD
BWW = OPTYPE_CODES["backward-weight-compute"]
# compute a worker does between its communication ops (absent on one worker: zero)
_WORK = (FWD, BWD, BWW, OPTYPE_CODES["optimizer"])
_P2P = [OPTYPE_CODES[x] for x in P2P_OPTYPES]
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
    # workers left out because their ops differ from their stage peers' (with the other
    # workers of their DP replicas): leave_out_odd
    left_out: list[LeftOut] = field(default_factory=list)

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

    def held(self) -> np.ndarray:
        """bool [N]: the template ops that most of their replica-steps hold (a spurious row
        of one rank, a run some traces cut once more, is held by few: no slot of the job's
        schedule, which the model, the ideal and the judgements of workers do not build on)."""
        _, d, t = self.present.shape
        return 2 * np.count_nonzero(self.present.reshape(len(self.present), -1), axis=1) > d * t

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


# The k-th GC pause of one slot (k ≥ 1: a gen-0 collection and the gen-2 one it set off, side
# by side) is numbered slot + k·GC_WITHIN: a cell of its own, after the slot's earlier pauses.
GC_WITHIN = 1 << 16


def gc_slots(trace: Trace, worker_step: np.ndarray) -> np.ndarray:
    """For each gc row, the number of fwd/bwd compute ops before it on its worker in its step
    (its slot), plus k·GC_WITHIN for the k-th pause after the first in that slot."""
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
    # (order is by worker-step and start: pauses of one slot are consecutive gc rows there)
    pauses = order[~is_compute[order]]
    if len(pauses) > 1:
        ws, slot = worker_step[pauses], slots[pauses]
        new = np.ones(len(pauses), dtype=bool)
        new[1:] = (ws[1:] != ws[:-1]) | (slot[1:] != slot[:-1])
        at = np.arange(len(pauses))
        k = at - np.maximum.accumulate(np.where(new, at, 0))
        slots[pauses] = slot + np.minimum(k, (1 << 24) // GC_WITHIN - 1) * GC_WITHIN
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
    d, t = len(dp_ranks), len(step_ids)
    # (virtual chunks: the last stage's forward transfers go on to the first)
    interleaved = trace.meta.vpp_size > 1 or int(ops["mc"].max(initial=0)) > 0
    node, flat, present, node_stage, node_optype, node_seq = _laid(trace, seq, d_idx, t_idx, d, t)
    warnings: list[str] = []
    complete = _complete_steps(present, node_optype, node_stage, dp_ranks, step_ids, warnings,
                               node_seq, interleaved)
    # a stray transfer renumbering its worker's later ones: those realigned with their other
    # ends (whatif/realign.py), the stray then left out like one numbered past the schedule
    again = None if complete.all() else realigned_seq(ops, seq, d_idx, t_idx, d, t, interleaved)
    if again is not None:
        node, flat, present, node_stage, node_optype, node_seq = _laid(trace, again, d_idx,
                                                                       t_idx, d, t)
        warnings = []
        complete = _complete_steps(present, node_optype, node_stage, dp_ranks, step_ids,
                                   warnings, node_seq, interleaved)
    n = len(node_stage)
    odd = None
    present_all = present
    if not complete.any():
        odd = leave_out_odd(present, node_optype, node_stage, node_seq, dp_ranks, step_ids,
                            _ranks_of(ops, d_idx, len(dp_ranks)), interleaved)
        if odd is None:
            raise InputError(trace.source, None, "no step has ops from every worker; "
                             + (warnings[0] if warnings else "cannot analyse"))
        present, complete = odd.present, odd.complete
        warnings = odd.warnings
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
    cells = [a.reshape(shape) for a in (start, duration, row)]
    if odd is not None and odd.lost is not None and odd.lost.any():
        whole = present_all.copy()
        rebuilt = rebuild_lost(cells[0], cells[1], cells[2], whole, node_stage, node_optype,
                               node_seq, odd.lost, complete)
        if rebuilt.any():   # (the rebuilt collectives kept, with every worker's cell, and a
            # cross-stage group's op at the other stages, left out for its sake only)
            rebuilt = with_group(rebuilt, odd.keep_nodes, node_optype, node_seq)
            odd.keep_nodes = odd.keep_nodes | rebuilt
            present = whole[odd.keep_nodes]
            warnings[0] = ops_warning(odd.said, ~odd.keep_nodes | rebuilt, rebuilt)
    cells = [c[:, :, complete] for c in cells]
    if odd is not None:   # (the odd workers' replicas, and ops only they ran, left out)
        at = np.ix_(odd.keep_nodes, odd.keep_dp)
        cells = [c[at] for c in cells]
        node_stage, node_optype, node_seq, node_mc, node_gmc = (
            a[odd.keep_nodes] for a in (node_stage, node_optype, node_seq, node_mc, node_gmc))
        node_pg = None if node_pg is None else node_pg[at]
        dp_ranks = dp_ranks[odd.keep_dp]
    grid = OpGrid(node_stage, node_optype, node_seq, dp_ranks, step_ids[complete],
                  cells[0], cells[1], present[:, :, complete], cells[2],
                  pp_size=pp, node_mc=node_mc, node_gmc=node_gmc, vpp_size=vpp, warnings=warnings,
                  compute_by_index=bool(trace.meta.extra.get("compute_split_at_collectives")),
                  node_pg=node_pg, left_out=[] if odd is None else odd.left_out)
    reference_chunks(grid, ops["mc"], ops["gmc"], source_rows)
    _check_stages(grid, trace)
    return grid


def _laid(trace: Trace, seq: np.ndarray, d_idx: np.ndarray, t_idx: np.ndarray, d: int, t: int):
    """(node of each row, its flat cell, present [N, D, T], node_stage, node_optype, node_seq):
    each row on its template op (stage, optype, seq), DP rank and step."""
    ops = trace.ops
    key = ((ops["stage"].astype(np.int64) << (_SEQ_BITS + _OPTYPE_BITS))
           | (ops["optype"].astype(np.int64) << _SEQ_BITS) | seq)
    compact = (ops["stage"].astype(np.int64) * 32 + ops["optype"]) * (int(seq.max()) + 1) + seq
    _, node = dense_ids(compact)
    keys = np.zeros(int(node.max()) + 1, dtype=np.int64)
    keys[node] = key
    n = len(keys)
    flat = (node.astype(np.int64) * d + d_idx) * t + t_idx
    present = (one_op_per_cell(flat, n * d * t, trace) > 0).reshape(n, d, t)
    node_stage = (keys >> (_SEQ_BITS + _OPTYPE_BITS)).astype(np.int32)
    node_optype = ((keys >> _SEQ_BITS) & ((1 << _OPTYPE_BITS) - 1)).astype(np.int8)
    node_seq = (keys & ((1 << _SEQ_BITS) - 1)).astype(np.int64)
    return node, flat, present, node_stage, node_optype, node_seq


def _chunks(ops, node, n, node_stage, pp) -> tuple[np.ndarray, np.ndarray]:
    """Model chunk and global chunk per template op, from any of its rows (`reference_chunks`
    then reads them where the model reads its order)."""
    node_mc = np.zeros(n, dtype=np.int64)
    node_gmc = np.full(n, -1, dtype=np.int64)
    node_mc[node] = np.maximum(ops["mc"], 0)
    node_gmc[node] = ops["gmc"]
    # Traces without chunk ids: the global chunk of a compute op is mc·pp + stage.
    node_gmc = np.where(node_gmc < 0, node_mc * pp + node_stage, node_gmc)
    return node_mc, node_gmc


def reference_chunks(grid: OpGrid, mc: np.ndarray, gmc: np.ndarray | None,
                     source_rows: np.ndarray | None = None) -> None:
    """Each template op's model chunk and global chunk (in place) read from its row in its
    stage's reference replica-step (dependencies.reference_cells: where the model reads its
    order), where it has one; `mc`, `gmc`: the columns `grid.row` indexes (through
    `source_rows`, the rows a step selection kept, where given). A replica numbering its ops
    otherwise (an interleaved schedule's seq_ids swapped at one rank) holds another chunk at a
    template op, and from any one row its chunk decided every replica's transfers."""
    from stragglers.whatif.dependencies import reference_cells   # (it reads this module)

    d_ref, t_ref = reference_cells(grid)
    stage = grid.node_stage
    nodes = np.arange(len(stage))
    row = grid.row[nodes, d_ref[stage], t_ref[stage]]
    has = (row >= 0) & grid.present[nodes, d_ref[stage], t_ref[stage]]
    if not has.any():
        return
    at = row[has] if source_rows is None else np.searchsorted(source_rows, row[has])
    own = np.maximum(mc[at], 0).astype(np.int64)
    grid.node_mc[has] = own
    if gmc is not None:
        g = gmc[at].astype(np.int64)
        grid.node_gmc[has] = np.where(g < 0, own * grid.pp_size + stage[has], g)


def _complete_steps(present, node_optype, node_stage, dp_ranks, step_ids, warnings,
                    node_seq=None, interleaved: bool = False) -> np.ndarray:
    """Steps where every communication op of the schedule is present on every DP rank, and
    every worker computes.

    A compute op absent on one worker in a step whose communication it all did is taken as
    zero (like a gc slot without a pause): profilers split a rank's work into runs at its
    collectives and at phase changes, and a rank whose trace lost or merged a run has one
    fewer than its peers; its collectives still say that the step was whole. The warning
    names the workers odd_workers judges (with `node_seq`): a worker's extra op makes its
    peers lack it, but it is the odd one.
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
        short, over = worker_missing[:, :, bad_steps], np.zeros((0, 0, 0), bool)
        if node_seq is not None:
            odd = odd_workers(present[:, :, bad_steps], node_optype, node_stage, node_seq,
                              interleaved)
            # (where nobody there is judged — an op with no majority, or no worker of the
            # stage with rows — the workers lacking ops are named as before)
            short = odd.short | (short & odd.undecided & ~odd.over)
            over = odd.over
        steps = [int(s) for s in step_ids[bad_steps]]
        text = "; ".join(f"{what} {_workers(flags, dp_ranks)}" for what, flags in (
            ("ops missing from workers", short),
            ("ops that no majority of their stage's workers ran, at workers", over))
            if flags.any())
        if node_seq is not None and odd.disputed.any():
            text = _disputed(odd.disputed, present[:, :, bad_steps], node_optype, node_stage,
                             node_seq, dp_ranks) + "; " + text
        warnings.append(f"{len(steps)} of {len(step_ids)} steps are incomplete and were left out "
                        f"(steps {ranges(steps)}): {text}")
    absent = ~present[compute][:, :, ~bad_steps]
    if absent.any():
        warnings.append(f"{int(absent.sum())} compute op(s) absent on some workers in complete "
                        "steps (their traces hold fewer compute runs there than their peers') "
                        "were taken as zero")
    return np.logical_not(bad_steps)


def _disputed(disputed, present, node_optype, node_stage, node_seq, dp_ranks) -> str:
    """Two workers disagreeing with nothing else to tell (one stage of two DP ranks): each is
    named with what it ran or lacks, either the possible culprit (never the honest one alone:
    an extra all-reduce at one rank named its peer as missing ops)."""
    ran = np.zeros((len(dp_ranks), int(node_stage.max()) + 1, 1), bool)
    for s in np.unique(node_stage[disputed.any(axis=1)]):   # (its workers with rows then)
        at = node_stage == s
        ran[:, s, 0] = present[at][:, :, disputed[at].any(axis=0)].any(axis=(0, 2))
    ops = ", ".join(_names(disputed.any(axis=1), node_optype, node_seq)[:3])
    return (f"workers {_workers(ran, dp_ranks)} disagree on {ops} (some ran it, some not) and "
            "no majority, other stage or transfer's other end tells which is the odd one: "
            "each may be (a lost row, or an extra one)")


def _workers(flags: np.ndarray, dp_ranks: np.ndarray) -> str:
    """'(dp 0, pp 1), (dp 1, pp 1)' for the workers set in flags [D, P, T] (eight, then …)."""
    workers = sorted({(int(dp_ranks[a]), int(b)) for a, b in zip(*np.nonzero(flags.any(axis=2)))})
    return (", ".join(f"(dp {a}, pp {b})" for a, b in workers[:8])
            + (" …" if len(workers) > 8 else ""))


@dataclass
class OddWorkers:
    """Each worker judged against its stage's workers, per step (odd_workers)."""

    odd: np.ndarray        # [D, P, T] its ops differ from its stage's majority
    short: np.ndarray      # [D, P, T] it lacks ops (or all its rows, or its compute) they ran
    over: np.ndarray       # [D, P, T] it ran ops no majority of them ran
    lacks: np.ndarray      # [N, D, T] which ops it lacks
    extra: np.ndarray      # [N, D, T] which ops it ran that no majority did
    undecided: np.ndarray  # [1, P, T] an op at the stage with no majority (it judges nobody),
                           # or no worker of the stage with rows
    disputed: np.ndarray   # [N, T] an op with no majority of its stage's workers and nothing
                           # else to tell (one stage of two workers: either may be the odd one)


def odd_workers(present, node_optype, node_stage, node_seq,
                interleaved: bool = False) -> OddWorkers:
    """Judge each worker's communication ops per step against its stage's workers: an op is
    the schedule's where more than half of the stage's workers with rows ran it. A tie (two
    workers disagreeing) is broken by the rest of the job, where it can be: an op a majority
    of another stage's workers ran (the same type and seq_id: a gradient collective every
    stage runs) is the schedule's; a collective no other stage ran is an extra; a pipeline
    transfer (each stage's own) is judged at each worker by its other end (paired_transfers:
    a recv its partner sent is the schedule's, one nobody sent is an extra); otherwise (one
    stage) there is no majority: that op judges nobody (`undecided` says where). A worker
    with no rows in a step, or no compute where most compute, lacks them. `interleaved`: the
    last stage's forward transfers go on to the first (virtual pipeline chunks)."""
    n, d, t = present.shape
    pp = int(node_stage.max()) + 1
    compute = np.isin(node_optype, _WORK)
    required = (node_optype != GC) & ~compute
    voters = np.zeros((d, pp, t), bool)
    computes = np.zeros((d, pp, t), bool)
    for s in range(pp):
        at = node_stage == s
        voters[:, s] = present[at].any(axis=0)
        computes[:, s] = present[at & compute].any(axis=0)
    votes = voters.sum(axis=0)                                    # [P, T]
    held = present.sum(axis=1)                                    # [N, T] (holders vote)
    of = votes[node_stage]
    majority = 2 * held > of
    tie = (2 * held == of) & (held > 0)
    _, ident = np.unique((node_optype.astype(np.int64) << _SEQ_BITS) | node_seq,
                         return_inverse=True)
    ident = ident.ravel()
    # per op identity and step: the stages where a majority ran it, the stages where any did
    # (one node per stage and identity: the others are the other stages)
    maj_at = np.zeros((int(ident.max()) + 1, t), np.int64)
    np.add.at(maj_at, ident, majority)
    held_at = np.zeros_like(maj_at)
    np.add.at(held_at, ident, held > 0)
    collective = ~np.isin(node_optype, _P2P)[:, None]
    # (a transfer is its stage's own: another stage's forward-send says nothing of this one's)
    elsewhere = (maj_at[ident] - majority > 0) & collective
    nowhere_else = held_at[ident] - (held > 0) == 0
    expected = np.broadcast_to((majority | (tie & elsewhere))[:, None, :], (n, d, t))
    settled = ~tie | elsewhere | (nowhere_else & collective & (pp > 1))
    p2p_tie = tie & ~collective
    if p2p_tie.any():   # a transfer's tie: each worker judged by its partner (paired_transfers)
        paired, known = paired_transfers(present, node_optype, node_stage, node_seq, interleaved)
        # (a pair whose both ends agree everywhere — both lost at one DP rank — tells nobody)
        by_pair = p2p_tie & known[:, None] & (paired != present).any(axis=1)
        expected = np.where(by_pair[:, None, :], paired, expected)
        settled = settled | by_pair
    undecided = (votes == 0)[None]            # (a stage without rows in a step: no vote)
    for s in range(pp):
        undecided[0, s] |= (~settled[required & (node_stage == s)]).any(axis=0)
    voted = voters.transpose(1, 0, 2)[node_stage]                 # [N, D, T]
    judged = (settled & required[:, None])[:, None, :]            # (no majority: no say)
    lacks = expected & ~present & voted & judged
    extra = ~expected & present & judged
    short = np.zeros((d, pp, t), bool)
    over = np.zeros((d, pp, t), bool)
    for s in range(pp):
        at = node_stage == s
        short[:, s] = lacks[at].any(axis=0)
        over[:, s] = extra[at].any(axis=0)
    most_compute = 2 * (computes & voters).sum(axis=0) > votes    # [P, T]
    short |= (voters & most_compute & ~computes) | (~voters & (votes > 0))
    disputed = ~settled & required[:, None] & (held > 0)
    return OddWorkers(short | over, short, over, lacks, extra, undecided, disputed)


def paired_transfers(present, node_optype, node_stage, node_seq,
                     interleaved: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """([N, D, T] the other end of each pipeline transfer ran at the same DP rank — a send at
    stage p pairs with the recv of the same seq_id at p + 1 —, [N] a transfer with an other
    end to ask). Without virtual chunks a transfer past the first or last stage has none (a
    forward-send at the last stage pairs with nothing: False); with them it wraps round."""
    n, d, t = present.shape
    pp = int(node_stage.max()) + 1
    paired = np.zeros((n, d, t), bool)
    known = np.zeros(n, bool)
    key = ((node_stage.astype(np.int64) << (_SEQ_BITS + _OPTYPE_BITS))
           | (node_optype.astype(np.int64) << _SEQ_BITS) | node_seq)
    order = np.argsort(key)
    for code, (other, step) in PARTNER.items():
        at = np.flatnonzero(node_optype == code)
        if not len(at):
            continue
        to = node_stage[at].astype(np.int64) + step
        inside = (to >= 0) & (to < pp)
        if interleaved:
            to, inside = to % pp, np.ones(len(at), bool)
        known[at] = True
        want = (to << (_SEQ_BITS + _OPTYPE_BITS)) | (np.int64(other) << _SEQ_BITS) | node_seq[at]
        pos = np.minimum(np.searchsorted(key[order], want), n - 1)
        found = inside & (key[order][pos] == want)
        paired[at[found]] = present[order[pos[found]]]
    return paired, known


@dataclass
class LeftOdd:
    """The grid less the DP replicas of workers whose ops differ, or less the collectives that
    differ (leave_out_odd, leave_out_ops)."""

    keep_nodes: np.ndarray     # [N] template ops still run by some worker kept
    keep_dp: np.ndarray        # [D] DP ranks kept
    present: np.ndarray        # [N', D', T]
    complete: np.ndarray       # [T] complete steps of what is kept
    left_out: list[LeftOut]
    warnings: list[str]
    # [N] collectives left out (every worker kept) that some workers lack: build_grid
    # rebuilds them there from their group's ends where they fit (whatif/rebuild.py)
    lost: np.ndarray | None = None
    said: dict[int, str] = field(default_factory=dict)   # node → what workers ran it (warning)


# Ops a LeftOut names at most in each of its lists (a rank of another schedule lacks all).
MAX_NAMED_OPS = 16


def leave_out_odd(present, node_optype, node_stage, node_seq, dp_ranks, step_ids,
                  ranks: np.ndarray, interleaved: bool = False) -> LeftOdd | None:
    """Where no step has ops from every worker: the grid less the collectives that differ
    (leave_out_ops: every worker kept) where that settles it; else less the DP replicas of the
    workers whose ops differ from their stage's majority (odd_workers), as a trace without those
    replicas would be analysed (a partial one), with each worker left out and why; None where
    no majority tells the odd workers, or leaving them out leaves no replica or no complete
    step (the caller's error stands). `ranks` [D, P]: each worker's global rank (-1: none)."""
    judged = odd_workers(present, node_optype, node_stage, node_seq, interleaved)
    ops = leave_out_ops(present, node_optype, node_stage, node_seq, dp_ranks, step_ids, judged,
                        interleaved)
    if ops is not None:
        return ops
    bad = np.asarray(judged.odd.any(axis=(1, 2)))
    if not bad.any() or bad.all():
        return None
    keep_dp = ~bad
    kept = present[:, keep_dp]
    keep_nodes = kept.any(axis=(1, 2))
    kept = kept[keep_nodes]
    warnings: list[str] = []
    complete = _complete_steps(kept, node_optype[keep_nodes], node_stage[keep_nodes],
                               dp_ranks[keep_dp], step_ids, warnings, node_seq[keep_nodes],
                               interleaved)
    if not complete.any():
        return None
    left: list[LeftOut] = []
    shown = []
    for a in np.flatnonzero(bad).tolist():
        for p in range(int(node_stage.max()) + 1):
            rank = int(ranks[a, p]) if ranks[a, p] >= 0 else None
            steps = step_ids[judged.odd[a, p]]
            if not len(steps):
                left.append(LeftOut(int(dp_ranks[a]), p, rank, reason="replica"))
                continue
            # this stage's ops only: a replica odd at two stages named each worker with the
            # other's ops (a lost collective blamed on the rank that ran it)
            here = node_stage == p
            missing, extra = (_names(np.asarray(flags[:, a].any(axis=1)) & here, node_optype,
                                     node_seq) for flags in (judged.lacks, judged.extra))
            if not (judged.lacks[here, a].any() or judged.extra[here, a].any()):
                missing = ["its rows or its compute"]
            left.append(LeftOut(int(dp_ranks[a]), p, rank, missing=missing, extra=extra,
                                steps=[int(x) for x in steps]))
            shown.append(left[-1])
    said = "; ".join(
        f"(dp {w.dp}, pp {w.pp}{f', rank {w.rank}' if w.rank is not None else ''})"
        + (f" lacks {', '.join(w.missing[:3])}" if w.missing else "")
        + (" and" if w.missing and w.extra else "")
        + (f" ran {', '.join(w.extra[:3])} that no majority of its stage's workers ran"
           if w.extra else "")
        + f" in steps {ranges(w.steps)}" for w in shown[:4]) + (" …" if len(shown) > 4 else "")
    gone = [int(x) for x in dp_ranks[bad]]
    warnings.insert(0, f"no step had ops from every worker: {len(shown)} worker(s) whose ops "
                    f"differ from their stage's other workers were left out with their DP "
                    f"replicas ({len(gone)} of {len(dp_ranks)}: DP rank(s) {ranges(gone)}), "
                    f"the others analysed: {said}" + _unjudged(left))
    return LeftOdd(keep_nodes, keep_dp, kept, complete, left, warnings)


# Collectives whose group spans stages (dependencies.build_dependencies groups the first and
# last stages' embedding all-reduce, every stage's clip): one left out at a stage is left out
# at every stage, the whole group's op.
_CROSS_STAGE = (OPTYPE_CODES["embedding-grads-all-reduce"],
                OPTYPE_CODES["optimizer-clip-main-grad"])
# The window's warning (and the monitor's note) that names collectives left out or rebuilt.
OPS_LEFT_OUT = "ops some workers lack"


def leave_out_ops(present, node_optype, node_stage, node_seq, dp_ranks, step_ids,
                  judged: OddWorkers, interleaved: bool = False) -> LeftOdd | None:
    """Where workers' ops differ only in collectives (one lost at a rank, one no peer ran, or
    one two workers of a lone stage disagree on): the grid less those collectives, at every
    worker of their stage, every worker kept; `lost` marks those some workers lack (the
    schedule's by majority or another stage, or disputed), which build_grid rebuilds there
    from their group's ends where they fit (whatif/rebuild.py: the wait in a lost collective
    stays a wait; left out, it became a launch delay, and a healthy rank waiting for a 3x
    straggler was named a host stall). A stray transfer (stray_transfers) is left out like an
    extra. None where another transfer differs (each stage's own, paired at its other end:
    the odd worker's replica goes), a worker lacks its rows or its compute,
    more than half of a stage's collectives would go (a rank of another schedule), or no step
    is complete even then.

    Leaving a replica out for one lost row hid the 3x straggler beside it (S 1.00), and a lone
    stage of two workers, where nothing tells which is odd, was an error in every window. An
    op left out (an extra no majority ran; one that does not fit where it would be rebuilt)
    takes with it the time each worker spent in it, which becomes the gap before its next
    op: a launch delay, which S leaves out (T_nodelay), never compute."""
    collective = (node_optype != GC) & ~np.isin(node_optype, _WORK) & ~np.isin(node_optype, _P2P)
    differ = (judged.lacks | judged.extra).any(axis=(1, 2)) | judged.disputed.any(axis=1)
    stray = differ & stray_transfers(present, node_optype, node_stage, node_seq, judged,
                                     interleaved)
    if not differ.any() or (differ & ~collective & ~stray).any():
        return None
    d, pp, t = judged.odd.shape
    by_op = np.zeros((d, pp, t), bool)
    for s in range(pp):
        at = node_stage == s
        by_op[:, s] = (judged.lacks[at] | judged.extra[at]).any(axis=0)
    if (judged.odd & ~by_op).any():   # (no rows, or no compute: no op to leave out)
        return None
    ident = (node_optype.astype(np.int64) << _SEQ_BITS) | node_seq
    drop = differ | np.isin(ident, ident[differ & np.isin(node_optype, _CROSS_STAGE)])
    for s in np.unique(node_stage[drop]):
        at = collective & (node_stage == s)
        if 2 * (drop & at).sum() > at.sum():
            return None
    keep = ~drop
    warnings: list[str] = []
    complete = _complete_steps(present[keep], node_optype[keep], node_stage[keep], dp_ranks,
                               step_ids, warnings, node_seq[keep], interleaved)
    if not complete.any():
        return None
    said = {}
    for n in np.flatnonzero(differ).tolist():
        ran = present[n].any(axis=1)                                    # [D] ran it somewhere
        held = present[node_stage == node_stage[n]].any(axis=(0, 2))    # [D] rows there
        said[n] = (f"{OPTYPES[node_optype[n]]} #{node_seq[n]} on stage {node_stage[n]} (run by "
                   f"DP rank(s) {ranges(dp_ranks[ran].tolist())}, not by "
                   f"{ranges(dp_ranks[~ran & held].tolist())}"
                   + ("; a stray transfer: none of the schedule's ran at its other end"
                      if stray[n] else "")
                   + ")")
    # (an op no majority ran, and none elsewhere, is an extra: nothing to rebuild it from)
    lost = differ & (judged.lacks.any(axis=(1, 2)) | judged.disputed.any(axis=1))
    return LeftOdd(keep, np.ones(d, bool), present[keep], complete, [],
                   [ops_warning(said, drop, np.zeros_like(drop))] + warnings, lost, said)


def stray_transfers(present, node_optype, node_stage, node_seq, judged: OddWorkers,
                    interleaved: bool = False) -> np.ndarray:
    """[N] pipeline transfers that are only extras (no worker lacks one, none disputed), that
    most of their replica-steps lack, and whose other end, where it ran beside them, is such a
    transfer too (a duplicate or stray row, or pair of rows, a seq_id the schedule has not):
    left out at every worker like an extra collective, where that stage's transfers are not
    mostly such (a rank of another schedule). A transfer lacked where its other end ran it is
    lost (odd_workers: its worker's replica goes), never a stray."""
    n, d, t = present.shape
    transfer = np.isin(node_optype, _P2P)
    rare = (transfer & judged.extra.any(axis=(1, 2)) & ~judged.lacks.any(axis=(1, 2))
            & ~judged.disputed.any(axis=1)
            & (2 * present.reshape(n, -1).sum(axis=1) <= d * t))
    paired, _ = paired_transfers(present, node_optype, node_stage, node_seq, interleaved)
    to_rare, _ = paired_transfers(present & rare[:, None, None], node_optype, node_stage,
                                  node_seq, interleaved)
    stray = rare & ~(present & paired & ~to_rare).any(axis=(1, 2))
    for s in np.unique(node_stage[stray]):
        at = transfer & (node_stage == s)
        if 2 * (stray & at).sum() > at.sum():
            stray[at] = False
    return stray


def ops_warning(said: dict[int, str], drop: np.ndarray, rebuilt: np.ndarray) -> str:
    """The first warning of a grid whose collectives some workers lack (leave_out_ops): which
    were rebuilt at those workers and which left out at every worker of their stage."""
    def named(nodes) -> str:   # (a cross-stage group's op at its other stages unnamed)
        at = [said[n] for n in np.flatnonzero(nodes).tolist() if n in said]
        shown = at[:MAX_NAMED_OPS]
        return "; ".join(shown) + (f" and {len(at) - len(shown)} more" if len(at) > len(shown)
                                   else "")
    out = [f"{OPS_LEFT_OUT}: no step had ops from every worker, for collectives (or stray "
           "transfers) that some workers of their stage ran and others not; every worker analysed"]
    if rebuilt.any():
        out.append(f"rebuilt at the workers that lack them, ending with their group and begun "
                   f"after the worker's previous op (its wait kept as a wait): {named(rebuilt)}")
    if (drop & ~rebuilt).any():
        out.append(f"left out at every worker of their stage (of every stage for the embedding "
                   f"all-reduce and the clip; the time spent in them counted "
                   f"as the gap before the next op, never as compute): {named(drop & ~rebuilt)}")
    return "; ".join(out[:1]) + ". " + ". ".join(x[0].upper() + x[1:] for x in out[1:])


def _unjudged(left: list[LeftOut]) -> str:
    """'; … not judged' naming the healthy workers left out with an odd one's replica."""
    rest = [w for w in left if w.reason == "replica"]
    if not rest:
        return ""
    named = ", ".join(f"(dp {w.dp}, pp {w.pp}{f', rank {w.rank}' if w.rank is not None else ''})"
                      for w in rest[:8]) + (" …" if len(rest) > 8 else "")
    return (f"; their replicas' other workers {named} were not judged: a straggler among them "
            "would not be seen")


def _names(nodes: np.ndarray, node_optype, node_seq) -> list[str]:
    """'barrier #0' for each template op set in nodes [N] (MAX_NAMED_OPS of them, then …)."""
    at = np.flatnonzero(nodes)
    out = [f"{OPTYPES[node_optype[n]]} #{node_seq[n]}" for n in at[:MAX_NAMED_OPS]]
    return out + (["…"] if len(at) > MAX_NAMED_OPS else [])


def _ranks_of(ops, d_idx: np.ndarray, d: int) -> np.ndarray:
    """[D, P] the global rank of each worker (-1 where it has no row)."""
    out = np.full((d, int(ops["stage"].max()) + 1), -1, dtype=np.int64)
    out[d_idx, ops["stage"]] = ops["rank"]
    return out


def _check_stages(grid: OpGrid, trace: Trace) -> None:
    """Every stage must hold compute ops; otherwise the trace is not a training step."""
    # (to the layout's last stage: a trace of the first stage only passed here and failed
    # deep in a cause detector, a zero-size reduction, where the last stage only was refused)
    for s in range(max(grid.pp_size, int(grid.node_stage.max()) + 1)):
        sel = grid.node_stage == s
        if not np.any(np.isin(grid.node_optype[sel], (FWD, BWD))):
            raise InputError(trace.source, "optype", f"stage {s} has no forward/backward-compute "
                             "ops; expected compute on every pipeline stage")
