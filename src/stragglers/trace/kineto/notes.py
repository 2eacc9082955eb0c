"""What the Kineto reader assumed or left out, as (kind, message) notes for Trace.notes."""

from __future__ import annotations

from collections import Counter

import numpy as np

from stragglers.trace.kineto.exchanges import EXCHANGE
from stragglers.trace.kineto.layout import Pipelines, p2p_summary
from stragglers.trace.kineto.ops import RankParts, RankRows, ReadCounts
from stragglers.trace.kineto.placement import JobShape
from stragglers.trace.model import COMPUTE_OPTYPES, OPTYPE_CODES, OPTYPES
from stragglers.wording import ranges

_COMPUTE_CODES = [OPTYPE_CODES[n] for n in COMPUTE_OPTYPES]
# what a stage sends and the next one receives: (send on stage s, recv on stage s + 1)
_P2P_PAIRS = [(OPTYPE_CODES["forward-send"], OPTYPE_CODES["forward-recv"]),
              (OPTYPE_CODES["backward-recv"], OPTYPE_CODES["backward-send"])]


def reader_notes(per_rank: dict[int, RankRows], parts: dict[int, RankParts], shape: JobShape,
                 pp: int, found: Pipelines, notes: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """All notes, ranks first: the ones gathered while reading plus the per-rank counts."""
    ranks = sorted(per_rank)
    out = [("ranks", _ranks_note(ranks, shape))] + list(notes)
    out += _layout_notes(per_rank, parts, shape, pp, found)
    total = ReadCounts()
    for rows in per_rank.values():
        total.add(rows.counts)
    out += _dropped_notes(total)
    out += _uneven_steps(per_rank)
    out += _other_notes(per_rank, total)
    return out


def _uneven_steps(per_rank: dict[int, RankRows]) -> list:
    """Steps that some ranks' traces lack, and steps in which a rank holds fewer or more of a
    communication op than the other ranks of its stage, or a stage sends more or fewer than
    the next receives: the analysis leaves such a step out (a worker lacks its ops), so the
    reading says which and why."""
    counts: dict[tuple[int, int], Counter] = {}    # (stage, step) → (rank, optype) → n
    for r, rows in per_rank.items():
        comm = ~np.isin(rows.optype, _COMPUTE_CODES)
        for step, code in zip(rows.step[comm].tolist(), rows.optype[comm].tolist()):
            counts.setdefault((rows.placement.stage, step), Counter())[(r, code)] += 1
    steps_of = {r: set(np.unique(rows.step).tolist()) for r, rows in per_rank.items()}
    found: dict[int, str] = {}
    for (stage, step), c in sorted(counts.items()):
        ranks = sorted(r for r, rows in per_rank.items()
                       if rows.placement.stage == stage and step in steps_of[r])
        for code in sorted({k for _, k in c}):
            n = {r: c[(r, code)] for r in ranks}
            if len(set(n.values())) > 1 and step not in found:
                # the rarest count, and of two as common the smaller: a rank lacks an op
                odd = min(n, key=lambda r: (list(n.values()).count(n[r]), n[r]))
                found[step] = (f"rank {odd} has {n[odd]} {OPTYPES[code]} op(s) where the "
                               f"other ranks of stage {stage} have "
                               f"{max(set(n.values()) - {n[odd]})}")
        for send, recv in _P2P_PAIRS:
            here = sum(v for (r, k), v in c.items() if k == send)
            there = sum(v for (r, k), v in counts.get((stage + 1, step), Counter()).items()
                        if k == recv)
            if (stage + 1, step) in counts and here != there and step not in found:
                found[step] = (f"stage {stage} has {here} {OPTYPES[send]} op(s), stage "
                               f"{stage + 1} {there} {OPTYPES[recv]}")
    out = []
    every = set.union(*steps_of.values()) if steps_of else set()
    partial = sorted(s for s in every if any(s not in mine for mine in steps_of.values()))
    if partial:
        lacking = sorted(r for r, mine in steps_of.items() if partial[0] not in mine)
        out.append(("dropped", f"{len(partial)} step(s) ({ranges(partial)}) are in the traces "
                               f"of only some ranks (step {partial[0]} is not in rank(s) "
                               f"{ranges(lacking)}): the analysis leaves them out"))
    found = {s: why for s, why in found.items() if s not in partial}
    if found:
        first = min(found)
        out.append(("dropped", f"{len(found)} step(s) ({ranges(sorted(found))}) hold uneven "
                               f"communication: in step {first}, {found[first]}; the analysis "
                               "leaves a step out where a worker lacks an op the others have"))
    return out


def _ranks_note(ranks: list[int], shape: JobShape) -> str:
    missing = sorted(set(range(shape.world_size)) - set(ranks))
    if not shape.known:
        return (f"read {len(ranks)} rank(s) ({ranges(ranks)}); no distributedInfo.world_size, so "
                f"world size {shape.world_size} is assumed from the files and ranks given"
                + (f"; missing: {ranges(missing)}" if missing else ""))
    if not missing:
        return f"read all {shape.world_size} rank(s) of the job"
    return (f"read {len(ranks)} of {shape.world_size} ranks ({ranges(ranks)}); missing: "
            f"{ranges(missing)} — the analysis covers only the ranks read")


def _layout_notes(per_rank, parts, shape: JobShape, pp: int, found: Pipelines) -> list:
    out = []
    total, known = p2p_summary(parts)
    if shape.how == "p2p":
        chain = "→".join(map(str, found.chains[0]))
        out.append(("layout", f"pipeline stages from the send/recv pattern: {len(found.chains)} "
                              f"pipeline(s) of {found.pp} stages (e.g. ranks {chain})"))
    elif shape.how == "given":
        out.append(("layout", f"ranks placed from dp_size={shape.dp_size}, pp_size="
                              f"{shape.pp_size} (tp={shape.tp_size}) assuming Megatron rank order "
                              "(tp fastest, pp slowest)"))
        if shape.tp_size > 1:
            out.append(("layout", f"the {shape.tp_size} tensor-parallel ranks of each replica "
                                  "are analysed as workers of their own (dp_rank = dp·tp + tp "
                                  "rank); each collective synchronises its own process group"))
        if total and not found.chains:
            out.append(("layout", f"the layout could not be checked against the send/recv "
                                  f"pattern ({found.why_not})"))
    elif pp > 1:
        out.append(("layout", "pipeline stages taken from the pipeline group in "
                              "distributedInfo.pg_config"))
    else:
        what = ("no pipeline information (no pp_size given, no pipeline group in "
                "distributedInfo.pg_config")
        if total:
            what += f", and the send/recv pattern gives no layout: {found.why_not}"
        elif any(c.kind == EXCHANGE for r in parts.values() for c in r.colls):
            what += ", no send/recv but the exchanges above"
        else:
            what += ", no send/recv"
        out.append(("layout", what + "): every rank is a data-parallel rank at stage 0 with "
                              "dp_rank = rank"))
    if total and not known:
        out.append(("layout", f"none of the {total} send/recv op(s) names its peer rank (gloo "
                              "writes it only with record_shapes=True, as c10d::send/recv_ "
                              "'Concrete Inputs'): pairing by peer was impossible"))
    cpu = sorted(r for r, rows in per_rank.items() if rows.mode == "cpu")
    if cpu:
        out.append(("other", f"{len(cpu)} rank(s) have no GPU rows (e.g. rank {cpu[0]}): compute "
                             "is the busy time of top-level CPU ops and collectives come from "
                             "gloo:/nccl: annotations (or record_param_comms / c10d ops)"))
    return out


def _dropped_notes(total: ReadCounts) -> list:
    # in the order of the keys they were counted under before ("<kind> left out",
    # "p2p <kind> left out: <why>"), so the notes read as they did
    keyed: list[tuple[str, str, str | None, int]] = [
        (f"{kind} left out", kind, None, n) for kind, n in total.left_out.items()]
    keyed += [(f"p2p {kind} left out: {why}", kind, why, n)
              for (kind, why), n in total.p2p_left_out.items()]
    out = []
    for _, kind, why, n in sorted(keyed, key=lambda k: k[0]):
        if why is not None:
            out.append(("dropped", f"{n} point-to-point {kind} op(s) left out: {why}, so their "
                                   "direction (forward/backward) and partner are unknown"))
        else:
            out.append(("dropped", f"{n} collective(s) of unknown kind ({kind}) left out: no "
                                   "'Collective name', enclosing collective op or kernel name "
                                   "says what they are (their time shows as gaps between "
                                   "compute ops); they still align clocks"))
    if total.outside_steps:
        out.append(("dropped", f"{total.outside_steps} kernel(s)/op(s) outside every "
                               "ProfilerStep#N span were left out"))
    if total.pre_window_kernels:
        out.append(("dropped", f"{total.pre_window_kernels} GPU kernel(s) launched before the "
                               "profiling window (correlation ids below its first recorded "
                               "launch) belong to the step before the first traced one and "
                               "were left out"))
    if total.unpaired_annotations:
        out.append(("dropped", f"{total.unpaired_annotations} collective annotation(s) could "
                               "not be paired with the op that issued them: no process group, "
                               "sequence number or peer for them"))
    return out


def _other_notes(per_rank, total: ReadCounts) -> list:
    out = []
    if total.nccl_without_device_rows:
        out.append(("other", "an NCCL job traced without GPU rows: CPU-side collective spans "
                             "measure the launch, not the transfer"))
    if total.steps_from_optimizer:
        out.append(("other", "no ProfilerStep#N annotations (profiled without schedule or "
                             "prof.step()): a step ends with its Optimizer.step#, so steps are "
                             "numbered 1, 2, … from the window's start on every rank, and ranks "
                             "are matched by that order"))
    if total.host_collectives_on_device:
        out.append(("other", f"{total.host_collectives_on_device} rank(s) have device rows but "
                             "no collective kernel (MTIA's hccl, gloo): their collectives are "
                             "the host-side hccl:/gloo: annotations, which span the work"))
    if total.kernels_without_launch:
        out.append(("other", f"{total.kernels_without_launch} GPU kernel(s) had no launch "
                             "record (correlation id): their step came from the step span and "
                             "their phase from the kernel before them"))
    if total.no_backward_marker:
        out.append(("other", f"{total.no_backward_marker} rank(s) have no autograd::engine::"
                             "evaluate_function ops nor backward annotation: compute before "
                             "the optimizer counts as forward-compute"))
    if total.backward_from_annotation:
        out.append(("other", f"{total.backward_from_annotation} rank(s) have no autograd ops: "
                             "backward starts at a user annotation naming 'backward'"))
    if total.runs_clipped:
        out.append(("other", f"{total.runs_clipped} compute run(s) overlapped the next one on "
                             "another stream and were cut at its start"))
    if total.tail_work_between_collectives:
        out.append(("other", f"{total.tail_work_between_collectives} op(s) issued between "
                             "two of a step's gradient collectives (e.g. a gradient norm) have "
                             "no op type: they show as launch delay of the next collective"))
    if total.data_loading_ops:
        out.append(("other", f"{total.data_loading_ops} CPU op(s) under enumerate(DataLoader) "
                             "annotations count as host time before the step's compute, not as "
                             "compute"))
    out.append(("other", "compute ops are busy time (the union of their kernels' or CPU ops' "
                         "intervals; on CPU traces gaps under 1 ms between ops count as Python "
                         "dispatch); idle gaps inside a phase are launch delays of the next op. "
                         "Work issued after a step's last gradient collective (DDP's bucket "
                         "copy, clipping, optimizer) is the optimizer op"))
    return out
