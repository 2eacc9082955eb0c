"""All-reduces that name no process group (gloo's profiler and older NCCL traces name none) in
a pipeline job: the ones that span every stage (a gradient norm for clipping), told from their
shapes and times.

Read as a stage's DP all-reduce, such an op's wait for the other stages became transfer time
and the work after it was not the optimizer's. Where a trace names the group,
`ops.cross_stage_optype` reads its members; here the evidence is what one collective must show
on every member: the same tensor shapes, and work in flight on all of them together (a member
ends only after every member started). The i-th unnamed all-reduce of a step that shows both on
every rank of every stage, in every step, is given a group of all ranks. The i-th is counted
from the step's end, where a gradient norm follows the stages' gradient collectives.
"""

from __future__ import annotations

from collections import defaultdict

from stragglers.trace.kineto.ops import Coll, Placement, RankParts
from stragglers.wording import ranges

WORLD = "all ranks (inferred)"   # the group given to them: no trace names a group so


def name_cross_stage(parts: dict[int, RankParts], placements: dict[int, Placement]
                     ) -> list[str]:
    """Give the unnamed all-reduces that span every stage the group WORLD; the notes."""
    pp = max((p.pp_size for p in placements.values()), default=1)
    if pp <= 1 or any(p.stage_of is None for p in placements.values()):
        return []
    per_rank = {r: _by_step(parts[r]) for r in sorted(parts) if r in placements}
    if not any(per_rank.values()):
        return []
    stages = {placements[r].stage for r in per_rank}
    none = sorted(r for r, v in per_rank.items() if not v)
    steps = set.intersection(*(set(v) for v in per_rank.values()))
    if len(stages) < pp or none or not steps:
        return [_unsure("not every stage has a rank read" if len(stages) < pp else
                        f"rank(s) {ranges(none)} have none (one over some stages, a tied "
                        "embedding's, is not told apart)" if none else
                        "the ranks share no step")]
    # Counted from the step's end: the gradient norm follows the gradient collectives, whose
    # number differs between stages (DDP's buckets of each stage's parameters)
    n_of = {r: {len(per_rank[r][s]) for s in steps} for r in per_rank}
    if any(len(n) != 1 for n in n_of.values()):
        return [_unsure("their number differs between a rank's steps")]
    n = min(min(v) for v in n_of.values())
    hosts = {parts[r].host for r in per_rank}
    one_clock = len(hosts) == 1 and None not in hosts
    across: list[int] = []
    undecided: list[int] = []
    for k in range(1, n + 1):
        ops = [[(parts[r], per_rank[r][s][-k]) for r in per_rank] for s in sorted(steps)]
        if not all(_same_shapes(step) for step in ops):
            continue   # a group's members pass the same shapes: this one is a stage's own
        if not one_clock:
            undecided.append(k)
        elif all(_in_flight_together(step) for step in ops):
            across.append(k)
    members = tuple(sorted(per_rank))
    for r, steps_of in per_rank.items():
        (n_r,) = n_of[r]
        for ops_of_step in steps_of.values():
            if len(ops_of_step) == n_r:   # steps at the window's edges may hold fewer
                for k in across:
                    ops_of_step[-k].pg = WORLD
        if across:
            parts[r].pg_ranks[WORLD] = members
    notes = []
    if across:
        notes.append(f"{_ordinals(across)} all-reduce of each step names no process group "
                     f"(gloo's and older NCCL traces name none) and shows one collective over "
                     f"all {len(members)} ranks (in flight on every stage together in all "
                     f"{len(steps)} common steps, the same shapes where recorded): read as "
                     "one group across the stages")
    if undecided:
        notes.append(_unsure(f"{_ordinals(undecided)} all-reduce of each step has the same "
                             "shapes on every stage, but the ranks share no clock (host_name)"))
    return notes


def _by_step(p: RankParts) -> dict[int, list[Coll]]:
    """The rank's all-reduces that name no group, per step id, in issue order."""
    out: dict[int, list[Coll]] = defaultdict(list)
    for c in sorted(p.colls, key=lambda c: c.launch):
        if c.kind == "allreduce" and c.pg is None:
            out[p.step_ids[c.step]].append(c)
    return dict(out)


def _same_shapes(ops: list[tuple[RankParts, Coll]]) -> bool:
    """No two ranks recorded different shapes for it (unrecorded shapes do not differ)."""
    return len({c.shapes for _, c in ops if c.shapes is not None}) <= 1


def _in_flight_together(ops: list[tuple[RankParts, Coll]]) -> bool:
    """Every rank's work started before any rank's ended (one clock: the files' epoch µs)."""
    starts = [p.base_ns / 1000 + c.start for p, c in ops]
    ends = [p.base_ns / 1000 + c.end for p, c in ops]
    return max(starts) <= min(ends)


def _ordinals(ks: list[int]) -> str:
    """'the last', 'the 2nd last' ... of a step's all-reduces."""
    return ", ".join("the last" if k == 1 else f"the {k}{_SUFFIX.get(k, 'th')} last" for k in ks)


_SUFFIX = {2: "nd", 3: "rd"}


def _unsure(why: str) -> str:
    return ("all-reduces name no process group (gloo's and older NCCL traces name none) and "
            + why + ": each is read as its stage's DP all-reduce, so one across the stages (a "
            "gradient norm) would count its wait for another stage as transfer time")
