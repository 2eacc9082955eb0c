"""Process groups created collectively: every rank of the default group creates the same groups
in the same order (as `dist.new_group` requires), and they are looked up by value (the ranks
they are made of), never by id().

Creating a group on the members only desynchronises group creation (a later world-wide
`new_group` then hangs), and a cache keyed by `id(group)` can hand a new group the entry of a
collected one. Here each rank contributes the ranks of the group it needs groups for (a small
`all_gather_object` over the default group; a rank outside every such group contributes
nothing but still takes part), and every rank then creates the groups of every distinct
parent, in sorted order — so ranks of different data-parallel groups can call at the same
time and still agree.
"""

from __future__ import annotations

import logging

import torch.distributed as dist

log = logging.getLogger(__name__)

# ready sub-groups: parent ranks -> {straggler group rank: group}; companions: key -> group
_READY: dict[tuple[int, ...], dict[int, dist.ProcessGroup]] = {}
_COMPANIONS: dict[tuple[str, tuple[int, ...]], object] = {}


def group_ranks(group=None) -> tuple[int, ...] | None:
    """Global ranks of `group` in group-rank order; None on a rank outside it."""
    if group is None or group is dist.GroupMember.WORLD:
        return tuple(range(dist.get_world_size()))
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        return None
    return tuple(dist.get_process_group_ranks(group))


def _alive(groups) -> bool:
    """Whether cached groups still exist (a destroy_process_group drops them all)."""
    live = dist.distributed_c10d._world.pg_names
    return all(g in live or g is dist.GroupMember.NON_GROUP_MEMBER for g in groups)


def _gather(purpose: str, mine) -> list:
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (purpose, mine))
    purposes = {p for p, _ in everyone}
    if purposes != {purpose}:
        raise RuntimeError(f"ranks are creating different groups at once: {sorted(purposes)}")
    return [m for _, m in everyone]


def companion_group(group=None, purpose: str = "comm"):
    """A new group with the same ranks as `group`, for traffic that must not interleave with
    the caller's own collectives on `group`. Collective over the default group: every rank
    calls it at the same point, each with its own group (or one it is not a member of)."""
    mine = group_ranks(group)
    parents = sorted({tuple(p) for p in _gather(purpose, mine) if p is not None})
    for ranks in parents:
        new = dist.new_group(list(ranks))
        if ranks == mine:
            _COMPANIONS[(purpose, ranks)] = new
    log.debug("created %s groups for %s", purpose, parents)
    if mine is None:    # a rank outside `group`
        return dist.GroupMember.NON_GROUP_MEMBER
    return _COMPANIONS.get((purpose, mine), dist.GroupMember.NON_GROUP_MEMBER)


def create_ready_subgroups(group=None) -> None:
    """Create {straggler: group of the other ranks} for `group` and for every other rank's
    group. Collective over the default group (see the module docstring)."""
    mine = group_ranks(group)
    parents = sorted({tuple(p) for p in _gather("ready", mine) if p is not None and len(p) > 1})
    for ranks in parents:
        cached = _READY.get(ranks)
        if cached is not None and _alive(cached.values()):
            continue  # every rank created these in an earlier collective call
        _READY[ranks] = {s: dist.new_group([r for i, r in enumerate(ranks) if i != s])
                         for s in range(len(ranks))}


def ready_subgroups(group=None) -> dict[int, dist.ProcessGroup] | None:
    """The ready sub-groups of `group` if they were created (a lookup, not collective)."""
    mine = group_ranks(group)
    cached = _READY.get(mine) if mine is not None else None
    if cached is None or not _alive(cached.values()):
        return None
    return cached
