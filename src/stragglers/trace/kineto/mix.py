"""Refuse files of different runs read as one job (one directory holding two profiling runs).

Files of one job agree on run identifiers and process groups, record overlapping step
numbers, and, on one clock, every collective they share is in flight on all of them at once
(a collective ends only after the last member started it). Files from different runs break
at least one of these.
"""

from __future__ import annotations

from stragglers.errors import InputError
from stragglers.trace.kineto.ops import RankParts

# Scheduling jitter allowed when asking whether two ranks' spans of one collective overlap.
OVERLAP_TOLERANCE_S = 2e-3


# One profiling window of one job: its ranks' first steps lie within this much of each other.
SAME_WINDOW_S = 3600.0


def check_metadata(parts: dict[int, RankParts]) -> None:
    """Run identifiers, process groups and step numbers must agree across files."""
    ranks = sorted(parts)
    ref = parts[ranks[0]]
    for r in ranks[1:]:
        p = parts[r]
        apart = _start_s(p) - _start_s(ref)
        if abs(apart) > SAME_WINDOW_S:
            raise InputError(p.source, "traceEvents", f"these are two jobs: its steps were "
                             f"recorded on {_day(p)}, {_duration(abs(apart))} "
                             f"{'after' if apart > 0 else 'before'} those of {ref.source} "
                             f"({_day(ref)}); pass the files of one profiling window of one job")
        for key in ref.run_ids.keys() & p.run_ids.keys():
            if ref.run_ids[key] != p.run_ids[key]:
                raise InputError(p.source, key, f"{p.run_ids[key]!r}, but {ref.source} says "
                                 f"{ref.run_ids[key]!r}: the files are from different runs; pass "
                                 "the files of one run")
    groups: dict[str, tuple[tuple, str]] = {}
    for r in ranks:
        p = parts[r]
        check_group_ranks(p)
        check_collective_groups(p)
        for g in p.distributed_info.groups if p.distributed_info else ():
            name, members = g.name, g.ranks
            if g.unnamed:  # no pg_name: nothing refers to it by name, nothing to compare
                continue
            seen = groups.setdefault(name, (members, p.source))
            if seen[0] != members and members and seen[0]:
                if seen[1] == p.source:
                    raise InputError(p.source, "distributedInfo.pg_config", f"process group "
                                     f"{name} is listed twice, with ranks {_short(seen[0])} and "
                                     f"{_short(members)}; expected one entry per pg_name")
                raise InputError(p.source, "distributedInfo.pg_config", f"process group {name} "
                                 f"has ranks {_short(members)}, but in {seen[1]} "
                                 f"{_short(seen[0])}: the files are from different runs")
    steps = {r: set(parts[r].step_ids) for r in ranks}
    for r in ranks[1:]:
        if not steps[r] & steps[ranks[0]]:
            raise InputError(parts[r].source, "traceEvents", f"records steps {_span(steps[r])}, "
                             f"but {ref.source} records steps {_span(steps[ranks[0]])}: no step "
                             "in common, so the files are not one profiling window of one run")


def check_group_ranks(p: RankParts) -> None:
    """A process group (pg_config, a collective's "Process Group Ranks") names ranks of the
    world only: a group of ranks outside it would place collectives among ranks that are not
    there (its size read as a tensor- or expert-parallel degree)."""
    info = p.distributed_info
    world = info.world_size if info is not None else None
    if world is None:
        return
    listed = [(f"distributedInfo.pg_config[{i}].ranks", g.name, g.whole_ranks())
              for i, g in enumerate(info.groups if info is not None else ())]
    listed += [("Process Group Ranks", name, list(members))
               for name, members in sorted(p.pg_ranks.items())]
    for field, name, members in listed:
        bad = [m for m in members or () if not 0 <= m < world]
        if bad:
            raise InputError(p.source, field, f"process group {name} lists rank {bad[0]}, "
                             f"outside the world size {world} (distributedInfo.world_size); "
                             "expected ranks 0.." + str(world - 1))


def check_collective_groups(p: RankParts) -> None:
    """Collectives that name no process group, where pg_config shows model-parallel subgroups:
    which ranks each one synchronises is unknown (read as spanning every rank, a tensor-
    parallel all-reduce waits for the whole job and the diagnosis names the wrong rank)."""
    from stragglers.trace.kineto.placement import described_model_parallel

    colls = [c for c in p.colls if c.kind not in ("send", "recv", "sendrecv")]
    if not colls or any(c.pg is not None for c in colls):
        return
    dims = described_model_parallel(p)
    if dims:
        shown = ", ".join(f"{k} {v}" for k, v in sorted(dims.items()))
        raise InputError(p.source, "Process Group Name", f"none of its {len(colls)} "
                         f"collectives names its process group, but distributedInfo.pg_config "
                         f"shows model-parallel groups ({shown}): which ranks each collective "
                         "synchronises is unknown; expected the profiler's 'Process Group Name' "
                         "on every collective (torch >= 2.2 records it)")


def check_overlap(spans: dict[int, dict[tuple, tuple[float, float]]],
                  offsets: dict[int, float], sources: dict[int, str]) -> None:
    """On the aligned clock, collectives matched between ranks must be in flight together."""
    ranks = sorted(spans)
    if len(ranks) < 2:
        return
    ref = ranks[0]
    for r in ranks[1:]:
        common = spans[r].keys() & spans[ref].keys()
        if not common:
            continue
        shift = offsets.get(r, 0.0) - offsets.get(ref, 0.0)
        together = 0
        for k in common:
            a0, a1 = spans[ref][k]
            b0, b1 = spans[r][k][0] - shift, spans[r][k][1] - shift
            together += b1 + OVERLAP_TOLERANCE_S >= a0 and a1 + OVERLAP_TOLERANCE_S >= b0
        if together * 2 < len(common):
            raise InputError(sources[r], "traceEvents", f"only {together} of {len(common)} "
                             f"collectives it shares with rank {ref} ({sources[ref]}) overlap in "
                             "time, even after clock alignment: the files are from different "
                             "runs; pass the files of one run")


def _start_s(p: RankParts) -> float:
    """Unix seconds at which the file's first step began."""
    first = min((a for a, _ in p.step_spans), default=0.0)
    return p.base_ns / 1e9 + first / 1e6


def _day(p: RankParts) -> str:
    import datetime

    try:
        return datetime.datetime.fromtimestamp(_start_s(p), datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC")
    except (OverflowError, OSError, ValueError):   # beyond the year 9999: no calendar date
        return f"{_start_s(p):.4g} s after 1970"


def _duration(seconds: float) -> str:
    """'16 months', '3 days', '5 hours'."""
    for unit, size in (("month", 30.44 * 86400), ("day", 86400.0), ("hour", 3600.0)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''}"
    return f"{seconds:.0f} s"


def _span(steps: set[int]) -> str:
    return f"{min(steps)}–{max(steps)}" if len(steps) > 1 else str(min(steps))


def _short(members: tuple) -> str:
    text = str(list(members))
    return text if len(text) <= 40 else text[:37] + "...]"
