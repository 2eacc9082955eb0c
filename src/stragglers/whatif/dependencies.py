"""The dependency model of docs/whatif.md §3: in-worker edges and cross-worker comm groups."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stragglers.errors import DependencyCycleError
from stragglers.trace.model import BLOCKING_COLLECTIVES, DP_COLLECTIVES, OPTYPE_CODES as C
from stragglers.whatif.buckets import bucket_producers
from stragglers.whatif.grid import BWD, BWW, FWD, GC as _GC, GC_WITHIN, OpGrid

P2P_PEER = {  # optype → (peer optype, stage delta of the peer)
    "forward-send": ("forward-recv", +1), "forward-recv": ("forward-send", -1),
    "backward-send": ("backward-recv", -1), "backward-recv": ("backward-send", +1),
}
# Rows recorded per pipeline action (record/pipelining.py) name the peer's stage in gmc; this
# rank's own stage is the peer's plus this offset.
OWN_FROM_PEER = {"forward-send": -1, "forward-recv": +1, "backward-send": +1, "backward-recv": -1}
_COMPUTE = (FWD, BWD, BWW)
_FB = (FWD, BWD)
_DP_COLL = tuple(C[o] for o in DP_COLLECTIVES)
_BLOCKING = tuple(C[o] for o in BLOCKING_COLLECTIVES)
_SEPARATE, _GATHER, _RS, _AR = (C[o] for o in ("separate-grads-all-reduce", "params-all-gather",
                                          "grads-reduce-scatter", "grads-all-reduce"))
_GRADS = (_RS, _AR)
_EPS = 5e-5  # seconds of clock error tolerated when deciding whether a p2p op was launched


@dataclass
class DependencyModel:
    """Edges between template ops and the comm groups that synchronise them."""

    deps: list[list[int]]          # deps[n] = template ops n waits for (same DP rank and step)
    groups: list[list[int]]        # comm groups (members end together)
    group_dp_sync: list[bool]      # group also synchronises DP ranks (all, or its parts)
    group_of: np.ndarray           # [N] group id or -1
    no_op: np.ndarray              # [N] p2p op recorded but never launched (no peer)
    order: list[int]               # super-node order: group ids as -(g+1), plain ops as n
    # per group: None (a dp-sync group synchronises all DP ranks) or labels [D]: DP ranks with
    # one label synchronise together (the process groups the collective ran in)
    group_parts: list = None  # type: ignore[assignment]
    # per stage, the (DP rank index, step index) whose order the model read (reference_cells):
    # where detectors look up what a template op is (its microbatch), not the first replica
    ref_cells: tuple[np.ndarray, np.ndarray] | None = None

    def __post_init__(self) -> None:
        if self.group_parts is None:
            self.group_parts = [None] * len(self.groups)


def build_dependencies(grid: OpGrid, dsp_size: int = 1,
                       schedule_order: bool | None = None) -> DependencyModel:
    """Build the model from each stage's reference replica-step (`reference_cells`: one whose
    order of ops most replica-steps share; the first DP rank's first step where it is one).

    `schedule_order`: pipeline transfers follow the recorded action order (rows recorded per
    schedule action, see recorded_per_action) instead of Megatron's 1F1B rules; None decides
    from the trace.
    """
    if schedule_order is None:
        schedule_order = recorded_per_action(grid)
    n_nodes = len(grid.node_stage)
    deps: list[list[int]] = [[] for _ in range(n_nodes)]
    groups: list[list[int]] = []
    dp_sync: list[bool] = []
    no_op = np.zeros(n_nodes, dtype=bool)
    cells = reference_cells(grid)
    ref_start, ref_end = reference_times(grid, cells)
    pp = grid.pp_size
    use_dp = len(grid.dp_ranks) * dsp_size > 1
    by_stage = {s: np.flatnonzero(grid.node_stage == s) for s in range(pp)}
    p2p_launched: dict[tuple[int, str], list[int]] = {}
    held = grid.held()

    def of_type(stage: int, name: str) -> list[int]:
        """Nodes of one optype on one stage, in observed start order."""
        sel = by_stage.get(stage, np.array([], int))
        sel = sel[grid.node_optype[sel] == C[name]]
        return [int(x) for x in sel[np.lexsort((grid.node_seq[sel], ref_start[sel]))]]

    def chain(nodes: list[int], after: list[int] | None = None) -> None:
        prev = list(after or [])
        for n in nodes:
            deps[n].extend(prev)
            prev = [n]

    for stage in range(pp):
        nodes = by_stage.get(stage, np.array([], int))
        found = nodes[np.isin(grid.node_optype[nodes], _COMPUTE)]
        comp = [int(x) for x in found[np.lexsort((grid.node_optype[found], grid.node_seq[found],
                                                  ref_start[found]))]]
        # Compute stream: fwd/bwd in observed order, gc pauses at their slot (fwd/bwd before them).
        gcs = nodes[grid.node_optype[nodes] == _GC]
        gc_at: dict[int, list[int]] = {}   # slot → its pauses in order (grid.gc_slots)
        for g in gcs[np.argsort(grid.node_seq[gcs], kind="stable")]:
            gc_at.setdefault(int(grid.node_seq[g]) % GC_WITHIN, []).append(int(g))
        for pauses in gc_at.values():      # pauses side by side in one slot: one after another
            chain(pauses)
        stream, n_fb = [], 0  # gc slots count forward/backward ops only (grid.gc_slots)
        for c in _with_blocking(grid, nodes, comp, ref_start):
            if grid.node_optype[c] in _FB:
                if n_fb in gc_at and n_fb > 0:
                    stream.extend(gc_at[n_fb])
                n_fb += 1
            stream.append(c)
        _chain_stream(grid, stream, deps)
        if 0 in gc_at:  # a pause before the first compute op: it leads the stream
            deps[comp[0]].append(gc_at[0][-1])
        # The op a recv is posted after: the training thread's previous compute op (`comp`, the
        # stream without its pauses). A gc pause is no poster: it falls wherever an allocation
        # triggers it, often while the recv already waits, and a recv chained behind it would
        # count that wait twice.
        stream_before = {c: comp[k - 1] for k, c in enumerate(comp) if k > 0}
        # ... unless the pause in the slot before the recv's compute op, where it is recorded,
        # mostly ends before the recv starts: then the thread was collecting when it would have
        # posted the recv (a schedule that collects before each forward), and chained after the
        # compute op the recv would take the pause as its launch delay (host-side work)
        pause_before = {c: stream[k - 1] for k, c in enumerate(stream)
                        if k > 0 and grid.node_optype[stream[k - 1]] == _GC}
        if 0 in gc_at and comp:   # the pause that leads the stream (not in `stream`)
            pause_before[comp[0]] = gc_at[0][-1]
        # ... and the blocking collectives between that op and the recv's compute op (a tensor-
        # parallel all-reduce ending a microbatch's forward): where the recv started after one
        # ended, the thread posted it once past that one; chained after the compute op the recv
        # would take the wait at the collective (its group peers' lateness) as its launch delay.
        # Likewise a send after the collectives that follow its compute op.
        colls_before, colls_after = _blocking_runs(grid, stream)
        pauses = gc_at.get(n_fb, [])
        tail_gc = pauses[-1] if pauses else None
        # the schedule's compute ops: those most replica-steps hold (a spurious row of one
        # rank is no microbatch's: paired with a transfer, it shifted every pairing by one)
        sched = [c for c in comp if held[c]] or comp
        last_compute = max(sched, key=lambda c: ref_end[c]) if sched else None
        if pauses and last_compute is not None:
            deps[pauses[0]].append(last_compute)
        # compute cut into pieces by blocking collectives or by DDP's buckets (gradient
        # collectives launched before the last backward op ended): transfers are then paired
        # with compute ops by time
        bwds = [c for c in comp if grid.node_optype[c] == BWD]
        grads_here = nodes[np.isin(grid.node_optype[nodes], _GRADS)]
        in_pieces = bool(colls_before or colls_after) or (bool(bwds) and bool(np.any(
            ref_start[grads_here] < max(ref_end[c] for c in bwds) - _EPS)))

        # Pipeline p2p: match launched sends/recvs to the compute op they feed or follow.
        if schedule_order:
            _schedule_p2p(grid, stage, stream, of_type, chain, deps, ref_start, ref_end,
                          p2p_launched)
        for direction in (() if schedule_order else ("forward", "backward")):
            t_comp = sorted((c for c in of_type(stage, f"{direction}-compute") if held[c]),
                            key=lambda c: grid.node_seq[c])
            if not t_comp:
                continue
            last_comp_start = max(ref_start[c] for c in t_comp)
            first_comp_end = min(ref_end[c] for c in t_comp)
            for kind in ("send", "recv"):
                name = f"{direction}-{kind}"
                ops = of_type(stage, name)
                chain(ops)  # each p2p direction is its own in-order stream
                # Recorded but never launched at the edges of a step (recv after the last compute
                # started, send done before the first compute ended): no-ops.
                cand = [o for o in ops if not (
                    (kind == "recv" and ref_start[o] > last_comp_start + _EPS) or
                    (kind == "send" and ref_end[o] < first_comp_end - _EPS))]
                for o in ops:
                    no_op[o] = o not in cand
                delta = P2P_PEER[name][1]
                targets = _p2p_targets(grid, t_comp, cand, kind, delta, pp,
                                       (ref_start, ref_end) if in_pieces else None)
                for k, o in enumerate(cand[:len(targets)]):
                    c = targets[k]
                    peer_gmc = grid.node_gmc[c] + delta
                    if peer_gmc < 0 or peer_gmc >= grid.vpp_size * pp:
                        no_op[o] = True  # first/last chunk of the whole model: no peer
                    if kind == "send":
                        deps[o].append(_last_posted_after(grid, colls_after.get(c, []), o, c))
                    else:
                        deps[c].append(o)
                        # posted after the op right before c on the compute stream (docs/whatif.md §3;
                        # in 1F1B a forward's recv follows the backward before it)
                        before = stream_before.get(c)
                        pause = pause_before.get(c)
                        if pause is not None and _posted_after(grid, pause, o):
                            before = pause   # the pause held the post up: its wait is GC's
                        else:
                            before = _last_posted_after(grid, colls_before.get(c, []), o,
                                                        before)
                        if before is not None:
                            deps[o].append(before)
                p2p_launched[(stage, name)] = [o for o in cand if not no_op[o]]
        # The first backward send/recv waits for the second-to-last forward before the first backward.
        kinds = [grid.node_optype[c] for c in comp]
        if BWD in kinds and not schedule_order:
            fb = kinds.index(BWD)
            if fb >= 2:
                anchor = comp[fb - 2]
                for name in ("backward-recv", "backward-send"):
                    ops = p2p_launched.get((stage, name), [])
                    if ops:
                        deps[ops[0]].append(anchor)

        # DP-comm stream and its links to compute.
        found = nodes[np.isin(grid.node_optype[nodes], _DP_COLL)]
        coll = [int(x) for x in found[np.lexsort((grid.node_seq[found], ref_start[found]))]]
        overlapped = any(grid.node_optype[x] == _SEPARATE for x in nodes)
        gathers = [x for x in coll if grid.node_optype[x] == _GATHER]
        grads = [x for x in coll if grid.node_optype[x] in _GRADS]
        # DDP-style bucketed sync: gradient collectives launched while backward still runs,
        # each after the compute run that produced its bucket.
        bucketed = (not overlapped and bool(grads) and last_compute is not None
                    and _launched_inside(grid, grads[0], last_compute))
        # One communication stream runs its collectives in issue order, however many ranks
        # the trace holds: one rank of a job read alone (a partial trace) had its 404 bucket
        # all-reduces replayed up to 21 at once, its step without launch delays 129 ms where
        # the GPU was busy 200 ms.
        chain(gathers)
        if overlapped or bucketed:
            chain(grads)
        if use_dp:
            _link_gathers(grid, gathers, comp, ref_start, deps)
            if overlapped:
                _link_grads(grid, grads, comp, ref_end, deps)
        if bucketed:
            # the producer that holds on every replica, not on the first one only (buckets.py)
            for g, c in bucket_producers(grid, grads, comp).items():
                deps[g].append(c)
        waited = (_link_waited(grid, coll, grads, comp, ref_start, ref_end, deps, bucketed)
                  if grid.compute_by_index and use_dp and not overlapped else set())
        # Step tail: last compute → gc → layernorm → embedding → DP grads → clip → optimizer.
        tail: list[int] = []
        tail += of_type(stage, "layernorm-grads-all-reduce")
        tail += of_type(stage, "embedding-grads-all-reduce")
        if overlapped:
            tail += of_type(stage, "separate-grads-all-reduce")
        elif not bucketed:
            tail += [x for x in grads if x not in waited]
        tail += of_type(stage, "optimizer-clip-main-grad")
        tail += of_type(stage, "optimizer")
        # the pauses of the last slot lead the tail where they ran before it (most replica-steps
        # holding them), else follow it where they ran after it: a slot counts forward and
        # backward ops only, so a pause after the optimizer shares the slot of one before the
        # tail, and led the tail there its successors replayed after it, later than recorded
        place = _tail_place(grid, pauses, tail)
        if place == "after":
            deps[pauses[0]].append(tail[-1])
        lead = [tail_gc] if tail_gc is not None and place == "before" else (
            [last_compute] if last_compute is not None else [])
        if (overlapped or bucketed) and grads:
            lead.append(grads[-1])
        chain(tail, lead)

    # Cross-worker groups.
    group_of = np.full(n_nodes, -1, dtype=np.int64)

    def add_group(members: list[int], sync: bool) -> None:
        for m in members:
            group_of[m] = len(groups)
        groups.append(members)
        dp_sync.append(sync)

    if schedule_order:
        for members in _schedule_pairs(grid, p2p_launched):
            add_group(members, False)
    for stage in (() if schedule_order else range(pp)):
        for name in ("forward-send", "backward-send"):
            peer_name, delta = P2P_PEER[name]
            mine = p2p_launched.get((stage, name), [])
            theirs = p2p_launched.get(((stage + delta) % pp, peer_name), [])
            for a, b in zip(mine, theirs):
                add_group([a, b], False)
    for n in range(n_nodes):
        name_code = grid.node_optype[n]
        if group_of[n] >= 0:
            continue
        if no_op[n] or (name_code in (C[x] for x in P2P_PEER)):
            add_group([n], False)  # unmatched p2p: a singleton of its own transfer time
        elif name_code in _DP_COLL + _BLOCKING and use_dp:
            add_group([n], True)
    emb = [x for s in sorted({0, pp - 1}) for x in of_type(s, "embedding-grads-all-reduce")[:1]]
    if emb:
        add_group(emb, False)
    clip = [x for s in range(pp) for x in of_type(s, "optimizer-clip-main-grad")[:1]]
    if clip:
        add_group(clip, True)
    order = _topological_order(grid, deps, groups, group_of)
    parts = [_sync_parts(grid, members) if sync else None for members, sync in zip(groups, dp_sync)]
    model = DependencyModel(deps, groups, dp_sync, group_of, no_op, order, parts, cells)
    from stragglers.whatif.timing import clip_to_own_timeline   # (timing reads this module)

    clip_to_own_timeline(grid, model)
    return model


_CANDIDATES = 8  # replica-steps whose orders are tried as a stage's reference (_VOTE's too)


def reference_cells(grid: OpGrid) -> tuple[np.ndarray, np.ndarray]:
    """Per stage, the (DP rank index, step index) whose op order the model reads: the first DP
    rank's first step unless another replica-step's order is shared by more of the stage's
    replica-steps (of the first `_VOTE` steps). An order is that of each stream the model
    chains (`_streams`), not the races between them. One replica recorded out of the schedule's
    order (a rank whose seq_ids lie) cannot define every replica's model: from the first one,
    two microbatches numbered the other way round there made cyclic dependencies, or read a
    3x backward straggler's S 1.60 as 1.47 (dp 3). With two replicas nothing says which is
    right: the first stays."""
    pp = grid.pp_size
    d_ref, t_ref = np.zeros(pp, np.int64), np.zeros(pp, np.int64)
    d, t = grid.start.shape[1], min(grid.start.shape[2], _VOTE)
    if d * t < 3:
        return d_ref, t_ref
    cands = [(0, 0)] + [(a, 0) for a in range(1, min(d, _CANDIDATES))] \
        + [(0, b) for b in range(1, min(t, _CANDIDATES))]
    for stage in range(pp):
        streams = [grid.start[x, :, :t] for x in _streams(grid, stage) if len(x) > 1]
        if not streams:
            continue
        best, best_n = 0, _agreeing(streams, 0, 0)
        if 2 * best_n > d * t:          # (most agree with the first: the usual, cheap case)
            continue
        for k, (a, b) in enumerate(cands[1:], 1):
            n = _agreeing(streams, a, b)
            if n > best_n:
                best, best_n = k, n
        d_ref[stage], t_ref[stage] = cands[best]
    return d_ref, t_ref


def _streams(grid: OpGrid, stage: int) -> list[np.ndarray]:
    """A stage's ops by the stream the model chains them in: compute with the blocking
    collectives among it, each pipeline transfer type, the rest (DP collectives, optimizer);
    GC pauses, which fall wherever an allocation triggers them, in none."""
    nodes = np.flatnonzero(grid.node_stage == stage)
    kind = grid.node_optype[nodes]
    compute = np.isin(kind, _COMPUTE + _BLOCKING)
    p2p = [C[name] for name in P2P_PEER]
    out = [nodes[compute]] + [nodes[kind == code] for code in p2p]
    return out + [nodes[~compute & ~np.isin(kind, p2p + [_GC])]]


def _agreeing(streams: list[np.ndarray], a: int, b: int) -> int:
    """How many replica-steps (each stream's starts [n, D, T']) run every stream's ops in cell
    (a, b)'s order: each op started no earlier than `_EPS` before the ops that (a, b) started
    before it (ops absent there are ordered last, so a replica-step holding them where (a, b)
    does not disagrees)."""
    agree = np.ones(streams[0].shape[1:], bool)
    for start in streams:
        x = start[np.argsort(start[:, a, b], kind="stable")]
        prev = np.fmax.accumulate(x, axis=0)[:-1]
        with np.errstate(invalid="ignore"):
            agree &= ~(x[1:] < prev - _EPS).any(axis=0)
    return int(np.count_nonzero(agree))


def reference_times(grid: OpGrid, cells: tuple[np.ndarray, np.ndarray] | None = None
                    ) -> tuple[np.ndarray, np.ndarray]:
    """[N] starts and ends of each op in its stage's reference replica-step (`cells`, else
    reference_cells)."""
    d_ref, t_ref = reference_cells(grid) if cells is None else cells
    nodes = np.arange(len(grid.node_stage))
    d, t = d_ref[grid.node_stage], t_ref[grid.node_stage]
    start = grid.start[nodes, d, t]
    return start, start + grid.duration[nodes, d, t]


def reference_rows(grid: OpGrid, model: DependencyModel, nodes: np.ndarray) -> np.ndarray:
    """Trace rows of `nodes` in their stage's reference replica-step (the model's
    `ref_cells`; the first DP rank's first step where it has none): what a template op is
    (its microbatch, model chunk), read where the model read its order."""
    if model.ref_cells is None:
        return grid.row[nodes, 0, 0]
    d_ref, t_ref = model.ref_cells
    stage = grid.node_stage[nodes]
    return grid.row[nodes, d_ref[stage], t_ref[stage]]


def _sync_parts(grid: OpGrid, members: list[int]) -> np.ndarray | None:
    """Labels [D] of the DP ranks that a collective synchronises together, from the process
    groups it ran in (None: all of them, the group unknown somewhere or the same everywhere)."""
    if grid.node_pg is None:
        return None
    labels = grid.node_pg[members[0]]
    if (labels < 0).any() or len(np.unique(labels)) == 1:
        return None
    if any(not np.array_equal(grid.node_pg[m], labels) for m in members[1:]):
        return None
    return labels.astype(np.int64)


def sync_max(values: np.ndarray, parts: np.ndarray | None) -> np.ndarray:
    """The max over the DP ranks that synchronise together ([D, T] → [D, T] or [1, T])."""
    if parts is None or len(values) != len(parts):
        # (a replay broadcast over identical DP ranks, the ideal one, has a single row)
        return values.max(axis=0, keepdims=True)
    out = np.empty_like(values)
    for label in np.unique(parts):
        cols = parts == label
        out[cols] = values[cols].max(axis=0, keepdims=True)
    return out


def _chain_stream(grid: OpGrid, stream: list[int], deps: list[list[int]]) -> None:
    """Each op of the compute stream after the one before it; a blocking collective after the
    work it needs and after the collective before it (one communication stream, in order).

    On a GPU a collective waits only for the work issued before it that it reads, and the
    program goes on issuing work after an asynchronous collective, which runs beside it until
    the stream waits for the result (or never does). So an edge between a collective and the
    work around it is kept only where it holds in every replica and step: the collective after
    the latest work that ended before it started, the next op after the collective only where
    it started once the collective had ended (else after the work before the collective).
    """
    last = prev_coll = None
    work: list[int] = []
    for k, n in enumerate(stream):
        if grid.node_optype[n] not in _BLOCKING:
            if last is not None:
                deps[n].append(last)
            last = n
            work.append(n)
            continue
        if last is not None and (last == prev_coll or _waited(grid, last, n)):
            deps[n].append(last)
        else:
            poster = next((h for h in reversed(work[-64:]) if _waited(grid, h, n)), None)
            if poster is not None:
                deps[n].append(poster)
        if prev_coll is not None and prev_coll not in deps[n]:
            deps[n].append(prev_coll)
        prev_coll = n
        # the work after the collective; a GC pause in between falls wherever an allocation
        # triggers it (often inside the collective's wait), so the work after it decides
        nxt = next((m for m in stream[k + 1:] if grid.node_optype[m] != _GC), None)
        if nxt is None or grid.node_optype[nxt] in _BLOCKING or _waited(grid, n, nxt):
            last = n


def _waited(grid: OpGrid, coll: int, nxt: int) -> bool:
    """Whether `nxt` started after `coll` ended wherever both were recorded."""
    both = grid.present[coll] & grid.present[nxt]
    end = grid.start[coll] + grid.duration[coll]
    return bool(np.all(np.where(both, grid.start[nxt] >= end - _EPS, True)))


def _with_blocking(grid: OpGrid, nodes: np.ndarray, comp: list[int], ref_start) -> list[int]:
    """The compute ops with the stage's blocking collectives (all-to-all, broadcast, barrier)
    among them in observed order: the work after one needs its result, the one after the
    work before it."""
    blocking = nodes[np.isin(grid.node_optype[nodes], _BLOCKING)]
    if not len(blocking):
        return comp
    merged = comp + [int(x) for x in blocking]
    return sorted(merged, key=lambda n: (ref_start[n], grid.node_optype[n] not in _BLOCKING))


def _blocking_runs(grid: OpGrid, stream: list[int]) -> tuple[dict[int, list[int]],
                                                             dict[int, list[int]]]:
    """Per compute op of the stream, the run of blocking collectives right before it and the
    run right after it (gc pauses skipped), in stream order."""
    plain = [x for x in stream if grid.node_optype[x] != _GC]
    before: dict[int, list[int]] = {}
    after: dict[int, list[int]] = {}
    run: list[int] = []
    last_compute = None
    for x in plain:
        if grid.node_optype[x] in _BLOCKING:
            run.append(x)
            continue
        if grid.node_optype[x] in _COMPUTE:
            if run:
                before[x] = run
                if last_compute is not None:
                    after[last_compute] = run
            last_compute = x
        run = []
    if run and last_compute is not None:
        after[last_compute] = run
    return before, after


def _last_posted_after(grid: OpGrid, colls: list[int], p2p: int, default):
    """The last of `colls` that ended before the p2p op started (`_posted_after`), else
    `default`."""
    return next((x for x in reversed(colls) if _posted_after(grid, x, p2p)), default)


def recorded_per_action(grid: OpGrid) -> bool:
    """Whether the pipeline transfers were recorded per schedule action (record/pipelining.py).

    Those rows name the peer stage in gmc (never the row's own pipeline rank); every other
    source gives a transfer its own stage there. The transfers decide: a weight-gradient op (W),
    recorded only so, decides only where there are none (one spurious W row at one rank read
    a 1F1B trace per action, its transfers unpaired: a straggler's S 1.60 → 1.78).
    """
    p2p = np.isin(grid.node_optype, [C[n] for n in P2P_PEER])
    if not p2p.any():
        return bool(np.any(grid.node_optype == BWW))
    return not np.any(grid.node_gmc[p2p] == grid.node_stage[p2p])


def _most(yes: np.ndarray, held: np.ndarray) -> bool:
    """Whether yes holds in more than half the replica-steps that hold the ops asked about
    (a tie or none: no); every majority vote of the dependency model is this one."""
    # one replica-step may differ; one missing an op has no say (counted as "no", the
    # replica-steps without an action's pieces split it)
    return 2 * int((yes & held).sum()) > int(held.sum())


def _tail_place(grid: OpGrid, pauses: list[int], tail: list[int]) -> str | None:
    """Where a stage's last-slot GC pauses (`pauses`, in order) ran beside its step tail:
    "before" (they ended before its first op started), "after" (they began after its last op
    ended), each in most replica-steps holding both (`_most`), else None (beside it: they
    follow the last compute, nothing waits on them); "before" without a tail."""
    if not pauses:
        return None
    if not tail:
        return "before"
    first, last = pauses[0], pauses[-1]
    end = grid.start[last] + grid.duration[last]
    held = grid.present[first] & grid.present[last]
    if _most(end <= grid.start[tail[0]] + _EPS, held & grid.present[tail[0]]):
        return "before"
    tail_end = grid.start[tail[-1]] + grid.duration[tail[-1]]
    if _most(grid.start[first] >= tail_end - _EPS, held & grid.present[tail[-1]]):
        return "after"
    return None


def _posted_after(grid: OpGrid, pause: int, recv: int) -> bool:
    """Whether a recv was posted after the gc pause before its compute op: the pause ended
    before the recv started in most replica-steps holding both (`_most`)."""
    pause_end = grid.start[pause] + grid.duration[pause]
    return _most(pause_end <= grid.start[recv] + _EPS,
                 grid.present[pause] & grid.present[recv])


def _schedule_p2p(grid: OpGrid, stage: int, stream: list[int], of_type, chain, deps, ref_start,
                  ref_end, launched: dict) -> None:
    """Transfers recorded per action: the k-th transfer of a stage with one peer in one
    direction feeds (or follows) the k-th action of that kind (F or B) of its own stage: a
    receive its first compute piece, a send its last; each was posted after the compute-stream
    op that ended last before it.
    """
    # Post edges must hold in every step: a transfer row may start later than its post (the
    # recorder starts a transfer queued behind the previous one when that one ends).
    posters = [c for c in stream if grid.node_optype[c] != _GC]
    ends = (grid.start[posters] + grid.duration[posters]) if posters else np.zeros((0, 1, 1))
    nodes = np.flatnonzero(grid.node_stage == stage)
    for name, offset in OWN_FROM_PEER.items():
        ops = of_type(stage, name)
        chain(ops)  # each p2p direction is its own in-order stream
        code = FWD if name.startswith("forward") else BWD
        by_own: dict[int, list[int]] = {}
        for o in ops:
            by_own.setdefault(int(grid.node_gmc[o]) + offset, []).append(o)
        for own, lst in by_own.items():
            comp = [c for c in stream if grid.node_optype[c] == code and grid.node_gmc[c] == own]
            actions = _actions(grid, nodes, comp)
            for k, o in enumerate(lst):
                if actions:  # several tensors of one action share it
                    act = actions[min(k * len(actions) // len(lst), len(actions) - 1)]
                    if name.endswith("send"):
                        deps[o].append(act[-1])
                    else:
                        deps[act[0]].append(o)
                # posted by the training thread after the op it had just finished
                start = grid.start[o][None]
                ok = ((ends <= start) | np.isnan(ends) | np.isnan(start)).all(axis=(1, 2))
                done = np.flatnonzero(ok)
                if len(done):
                    before = posters[int(done[-1])]
                    if before not in deps[o]:
                        deps[o].append(before)
            launched[(stage, name, own)] = lst


_CUTTING = tuple(sorted(set(_BLOCKING) | set(_DP_COLL)))
_VOTE = 8  # replicas and steps whose layout decides how pieces form actions


def _actions(grid: OpGrid, nodes: np.ndarray, comp: list[int]) -> list[list[int]]:
    """The compute pieces of one kind of action (F or B of one stage), grouped by action.

    The recorder cuts an action's compute where a collective blocks it (TP all-reduces, FSDP2's
    gathers, which run in a step's first microbatch only, so actions differ in their number of
    pieces): a piece continues the action of the piece before it when only collectives (and GC
    pauses) lie between the two, at least one of them. Between two actions the schedule posts
    a transfer, or runs other compute. Decided by the majority of the replica-steps holding
    both pieces (of the first `_VOTE` of each; `_most`), as a transfer row queued behind an
    earlier one may start anywhere; pieces never cut are actions of one piece each, as before.
    """
    if not comp:
        return []
    kinds = grid.node_optype[nodes]
    coll = nodes[np.isin(kinds, _CUTTING)]
    other = nodes[~np.isin(kinds, _CUTTING + (_GC,))]
    if not len(coll):
        return [[c] for c in comp]
    cells = (slice(None), slice(0, _VOTE), slice(0, _VOTE))
    start, dur, present = grid.start[cells], grid.duration[cells], grid.present[cells]
    actions = [[comp[0]]]
    for p, q in zip(comp, comp[1:]):
        lo, hi = start[p] + dur[p] - _EPS, start[q] + _EPS                   # [D', T']
        cs = start[coll]
        cut = ((cs >= lo) & (cs + dur[coll] <= hi)).any(axis=0)
        mid = other[(other != p) & (other != q)]
        between = ((start[mid] >= lo) & (start[mid] < start[q] - _EPS)).any(axis=0)
        if _most(cut & ~between, present[p] & present[q]):
            actions[-1].append(q)
        else:
            actions.append([q])
    return actions


def _schedule_pairs(grid: OpGrid, launched: dict) -> list[list[int]]:
    """Each send with the peer's receive of the same pair of stages, in posting order."""
    pairs = []
    for (stage, name, own), sends in launched.items():
        if not name.endswith("send"):
            continue
        peer_name, _ = P2P_PEER[name]
        peer = int(grid.node_gmc[sends[0]])
        sends = sorted(sends, key=lambda o: grid.node_seq[o])
        recvs = [o for (_s, n, g), lst in launched.items() if n == peer_name and g == peer
                 for o in lst if int(grid.node_gmc[o]) == own]
        recvs.sort(key=lambda o: grid.node_seq[o])
        pairs += [[a, b] for a, b in zip(sends, recvs)]
    return pairs


def _p2p_targets(grid: OpGrid, t_comp: list[int], ops: list[int], kind: str, delta: int,
                 pp: int, times: tuple | None = None) -> list[int]:
    """The compute ops that the recorded sends/recvs of one direction belong to, in order.

    Profilers either record a p2p op for every compute op (no-ops included) or only the
    launched ones; which one is told by the count. Where neither fits and blocking collectives
    cut the stage's compute into pieces (`times`: the ops' reference starts and ends), by time
    in the stage's reference replica-step (reference_cells).
    """
    n_ops = len(ops)
    if n_ops >= len(t_comp):
        return t_comp
    eligible = [c for c in t_comp if 0 <= grid.node_gmc[c] + delta < grid.vpp_size * pp]
    if n_ops == len(eligible):
        return eligible
    # (before the count rule below: a microbatch's backward cut into DDP's buckets is one more
    # compute op too, and the recvs taken one compute op late left the first backward unlinked)
    by_time = _targets_by_time(t_comp, ops, kind, *times) if times is not None else None
    if by_time:
        return by_time
    if kind == "recv" and n_ops + 1 == len(t_comp):
        return t_comp[1:]  # the first forward-recv no-op was not recorded
    return t_comp[:n_ops]


def _targets_by_time(t_comp: list[int], ops: list[int], kind: str, ref_start,
                     ref_end) -> list[int] | None:
    """A recv's compute op: the first that started once it had ended; a send's: the last that
    ended before it started. None unless each op has one, in order, none shared."""
    out: list[int] = []
    at = -1                                  # index in t_comp of the last one taken
    for o in ops:
        if kind == "recv":
            k = next((k for k in range(at + 1, len(t_comp))
                      if ref_start[t_comp[k]] >= ref_end[o] - _EPS), None)
        else:
            k = next((k for k in range(len(t_comp) - 1, at, -1)
                      if ref_end[t_comp[k]] <= ref_start[o] + _EPS), None)
        if k is None:
            return None
        out.append(t_comp[k])
        at = k
    return out


def _link_gathers(grid: OpGrid, gathers: list[int], comp: list[int], ref_start, deps) -> None:
    """The last params all-gather of chunk c precedes the first forward of chunk c."""
    done = set()
    for g in reversed(gathers):
        mc = grid.node_mc[g]
        fwds = [c for c in comp if grid.node_optype[c] == FWD and grid.node_mc[c] == mc]
        if mc in done or not fwds:
            continue
        first = min(fwds, key=lambda c: ref_start[c])
        if ref_start[g] <= ref_start[first]:  # a gather after the forward is not its prefetch
            deps[first].append(g)
        done.add(mc)


def _link_waited(grid: OpGrid, coll: list[int], grads: list[int], comp: list[int], ref_start,
                 ref_end, deps, bucketed: bool) -> set[int]:
    """Compute that waited for a DP collective, where the trace cuts compute at collectives.

    A collective the program waits for before its next compute (FSDP2 on gloo unshards and
    reduces in line) holds that compute up: kept where the next compute started once the
    collective had ended in most replicas and steps (a synchronous collective is waited for
    in all but the odd cell a recorder's clock reads late; on a GPU the next kernels run
    beside an overlapped one in nearly all, and no edge is kept). A collective so
    waited for is issued by the program after the compute before it (where that held in
    every replica and step): a gradient collective then follows the compute that produced
    its gradients, not the step's last compute. Returns the gradient collectives linked so
    (bucketed ones are linked to their producers already)."""
    linked = set()
    prev_grad = None
    for g in coll:
        after = [c for c in comp if ref_start[c] >= ref_start[g]]
        nxt = min(after, key=lambda c: ref_start[c]) if after else None
        is_grad = g in grads
        if nxt is None or not _mostly_waited(grid, g, nxt):
            continue
        if not (is_grad and bucketed):
            before = [c for c in comp if ref_end[c] <= ref_start[g] + _EPS]
            poster = max(before, key=lambda c: ref_end[c]) if before else None
            if poster is not None and _waited(grid, poster, g) and not _reaches(deps, poster, g):
                deps[g].append(poster)
            if is_grad and prev_grad is not None:
                deps[g].append(prev_grad)
        if is_grad:
            prev_grad = g
        if _reaches(deps, g, nxt):
            continue
        deps[nxt].append(g)
        if is_grad:
            linked.add(g)
    return linked


def _mostly_waited(grid: OpGrid, coll: int, nxt: int) -> bool:
    """Whether `nxt` started after `coll` ended in most replica-steps where both ran (`_most`)."""
    gap = grid.start[nxt] - grid.start[coll] - grid.duration[coll]
    return _most(gap >= -_EPS, grid.present[coll] & grid.present[nxt])


def _reaches(deps, start: int, target: int) -> bool:
    """Whether `start` depends on `target`, directly or through others."""
    seen, todo = set(), [start]
    while todo:
        n = todo.pop()
        if n == target:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(deps[n])
    return False


def _link_grads(grid: OpGrid, grads: list[int], comp: list[int], ref_end, deps) -> None:
    """With overlapped gradient sync, a chunk's last backward precedes its first reduce-scatter."""
    done = set()
    for g in grads:
        mc = grid.node_mc[g]
        bwds = [c for c in comp if grid.node_optype[c] == BWD and grid.node_mc[c] == mc]
        if mc in done or not bwds:
            continue
        deps[g].append(max(bwds, key=lambda c: ref_end[c]))
        done.add(mc)


def _topological_order(grid: OpGrid, deps, groups, group_of) -> list[int]:
    """Order super-nodes (a comm group counts as one); report a cycle by naming its ops."""
    n_nodes = len(deps)

    def sn(n: int) -> int:
        return -(int(group_of[n]) + 1) if group_of[n] >= 0 else n

    members: dict[int, list[int]] = {}
    for n in range(n_nodes):
        members.setdefault(sn(n), []).append(n)
    preds: dict[int, set[int]] = {k: set() for k in members}
    succs: dict[int, set[int]] = {k: set() for k in members}
    for n in range(n_nodes):
        for d in deps[n]:
            a, b = sn(d), sn(n)
            if a != b:
                preds[b].add(a)
                succs[a].add(b)
            else:
                raise DependencyCycleError(f"cyclic dependencies: {grid.node_name(d)} and "
                                           f"{grid.node_name(n)} are in one comm group but one waits "
                                           "for the other")
    indeg = {k: len(v) for k, v in preds.items()}
    ready = sorted([k for k, v in indeg.items() if v == 0], key=lambda k: min(members[k]))
    order = []
    while ready:
        k = ready.pop()
        order.append(k)
        for s in succs[k]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    if len(order) != len(members):
        left = {k for k, v in indeg.items() if v > 0}
        cycle = _find_cycle(left, preds)[::-1]
        names = " → ".join(grid.node_name(members[k][0]) for k in cycle)
        raise DependencyCycleError(f"cyclic dependencies between ops: {names}")
    return order


def _find_cycle(nodes: set, preds: dict) -> list:
    """One cycle among the nodes left after Kahn's algorithm (each has a predecessor left)."""
    start = next(iter(nodes))
    seen: dict = {}
    path: list = []
    k = start
    while k not in seen:
        seen[k] = len(path)
        path.append(k)
        k = next(p for p in preds[k] if p in nodes)
    return path[seen[k]:] + [k]


def _launched_inside(grid: OpGrid, coll: int, last_compute: int) -> bool:
    """The collective started before the last compute op ended on some DP rank in some step.

    Decided over every replica, not the first one's first step: a gradient all-reduce that a
    healthy rank launches at the end of its backward is launched mid-backward on a rank whose
    backward goes on past its gradients' buckets, and an edge "after the backward" on that
    rank points forward in time (a negative launch delay, clamped: the replay runs late).
    """
    both = grid.present[coll] & grid.present[last_compute]
    end = grid.start[last_compute] + grid.duration[last_compute]
    return bool(np.any(both & (grid.start[coll] < end - _EPS)))
