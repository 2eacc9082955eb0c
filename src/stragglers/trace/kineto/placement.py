"""Which rank a profiler file belongs to and where that rank sits (DP rank, pipeline stage)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from stragglers.errors import InputError
from stragglers.trace.kineto.ops import Placement

_RANK_IN_NAME = re.compile(r"rank[-_]?(\d+)", re.IGNORECASE)
_PP_WORDS = {"pp", "pipe", "pipeline"}
_DP_WORDS = {"dp", "data"}
_TP_WORDS = {"tp", "tensor"}
# Words of process-group descriptions (Megatron's, torchtitan's mesh dims) that name model
# parallelism, by dimension: their collectives sit inside forward/backward.
_KIND_WORDS = {"tp": _TP_WORDS, "cp": {"cp", "context"}, "ep": {"ep", "expert", "moe"}}
_MODEL_PARALLEL_WORDS = set().union(*_KIND_WORDS.values())


def rank_of(ev, notes: list[str]) -> int:
    """distributedInfo.rank, else a rank-N / rank_N number in the file name, else an InputError."""
    if ev.rank is not None:
        if ev.rank >= 2**31:
            raise InputError(ev.source, "distributedInfo.rank", f"{ev.rank} is too large for a rank")
        return ev.rank
    name = Path(ev.source).name
    found = _RANK_IN_NAME.findall(name)
    if found and len(found[-1]) < 10:
        notes.append(f"{name}: no distributedInfo.rank; rank {found[-1]} taken from the file name")
        return int(found[-1])
    what = "no distributedInfo" if ev.distributed_info is None else "distributedInfo has no rank"
    raise InputError(ev.source, "distributedInfo.rank", f"missing ({what}) and the file name has "
                     "no rank number; rename the file to include it (e.g. trace_rank-3.json.gz) "
                     "or profile after torch.distributed.init_process_group so the profiler "
                     "records distributedInfo")


def single_process(ev) -> bool:
    """Whether a file names no rank anywhere (no distributedInfo, none in its name) and its
    trace holds no collective: the profile of a program that never joined a process group."""
    return (ev.rank is None and ev.distributed_info is None and not ev.colls
            and not _RANK_IN_NAME.findall(Path(ev.source).name))


def world_size_of(ev) -> int | None:
    """distributedInfo.world_size when it is a positive whole number."""
    return None if ev.distributed_info is None else ev.distributed_info.world_size


@dataclass
class JobShape:
    """The parallel sizes used to place ranks, and how they were found."""

    world_size: int
    dp_size: int
    pp_size: int
    tp_size: int
    how: str        # "given" (dp/pp passed) or "none"
    known: bool = True  # world size from distributedInfo (else from the number of files)


def job_shape(world: int, dp_size: int | None, pp_size: int | None, source: str,
              known: bool = True, tp_size: int | None = None) -> JobShape:
    """Sizes from the caller's dp/pp/tp and the world size (tensor parallel fills what is
    left when only dp is given; dp what is left when tp is)."""
    for label, value in (("pp_size", pp_size), ("dp_size", dp_size), ("tp_size", tp_size)):
        if value is not None and (not isinstance(value, int) or value < 1):
            raise InputError(source, label, f"expected a whole number >= 1, got {value!r}")
    pp = pp_size or 1
    if world % pp:
        raise InputError(source, "pp_size", f"{pp} does not divide the world size {world}")
    per_stage = world // pp
    if tp_size is not None:
        if per_stage % tp_size:
            raise InputError(source, "tp_size", f"{tp_size} does not divide the {per_stage} "
                             f"ranks per stage (world size {world}, pp_size {pp})")
        if dp_size is not None and dp_size * tp_size != per_stage:
            raise InputError(source, "tp_size", f"dp_size {dp_size} × tp_size {tp_size} is not "
                             f"the {per_stage} ranks per stage (world size {world}, pp_size "
                             f"{pp})")
        dp_size = per_stage // tp_size
    dp = dp_size or per_stage
    if per_stage % dp:
        raise InputError(source, "dp_size", f"{dp} does not divide the {per_stage} ranks per "
                         f"stage (world size {world}, pp_size {pp})")
    how = "given" if (pp_size or dp_size or tp_size) else "none"
    return JobShape(world, dp, pp, per_stage // dp, how, known)


def place(ev, rank: int, shape: JobShape) -> Placement:
    """DP rank and stage of a rank: from the given sizes (Megatron order: tp fastest, pp
    slowest), else from a pipeline group in distributedInfo.pg_config, else DP rank = rank."""
    if rank >= shape.world_size and (shape.known or shape.how == "given"):
        where = "" if shape.known else (" (no distributedInfo.world_size, so the world size is "
                                        "the number of files; pass the files of every rank)")
        raise InputError(ev.source, "distributedInfo.rank", f"rank {rank} is outside the world "
                         f"size {shape.world_size}{where}")
    per_stage = shape.world_size // shape.pp_size
    if shape.how == "given":
        # Tensor-parallel ranks of one replica (tp fastest) each keep their own column of the
        # grid: a slow one is named as the rank it is, not merged into its replica.
        return Placement(rank, rank % per_stage, rank // per_stage,
                         (lambda r: r // per_stage) if shape.pp_size > 1 else None,
                         shape.pp_size)
    pp_group, dp_group, tp_group = _named_groups(ev, rank)
    if pp_group is not None:
        stage = pp_group.index(rank)
        dp_rank = dp_group.index(rank) if dp_group is not None else rank % max(1, per_stage)
        if tp_group is not None and dp_group is not None:
            # each tensor-parallel rank of a replica is a worker of its own
            dp_rank = dp_rank * len(tp_group) + tp_group.index(rank)
        members = list(pp_group)
        return Placement(rank, dp_rank, stage,
                         lambda r: members.index(r) if r in members else -10, len(members))
    return Placement(rank, rank, 0, None)


def described_model_parallel(ev) -> dict[str, int]:
    """{dimension: size} of the subgroups pg_config describes as tensor, context or expert
    parallel (smaller than the world)."""
    world = ev.distributed_info.world_size if ev.distributed_info else None
    out: dict[str, int] = {}
    for _, ranks, words in _described(ev):
        for kind, names in _KIND_WORDS.items():
            if 1 < len(ranks) and (world is None or len(ranks) < world) and words & names \
                    and not words & _DP_WORDS:
                out[kind] = max(out.get(kind, 0), len(ranks))
    return out


def undescribed_blocks(parts: dict, tp_size: int, world: int) -> int | None:
    """The size of the consecutive-rank blocks whose all-reduces, all-gathers or
    reduce-scatters no pg_config describes (None: pg_config describes groups, tp is known, or
    the collectives' groups are not such blocks of one size). Read as data parallel; they may
    be tensor parallel, which only the caller can say (--tp-size)."""
    if tp_size > 1 or any(any(True for _ in _described(ev)) for ev in parts.values()):
        return None
    sizes = set()
    for ev in parts.values():
        for c in ev.colls:
            members = ev.pg_ranks.get(c.pg) if c.kind in _REDUCING else None
            if members and 1 < len(members) < world and world % len(members) == 0 \
                    and sorted(members) == list(range(min(members), min(members) + len(members))) \
                    and min(members) % len(members) == 0:
                sizes.add(len(members))
    return sizes.pop() if len(sizes) == 1 else None


_REDUCING = ("allreduce", "allgather", "reducescatter")


def _described(ev):
    """(name, ranks, words of the description) of every well-formed pg_config group."""
    for g in ev.distributed_info.groups if ev.distributed_info else ():
        ranks = g.whole_ranks()
        if not ranks and not g.unnamed:  # no list of ranks: those its collectives give
            ranks = list(ev.pg_ranks.get(g.name, ())) or None
        if ranks is not None and g.desc is not None:
            yield g.name, ranks, set(re.split(r"[^a-z]+", g.desc.lower()))


def _named_groups(ev, rank: int) -> tuple[list[int] | None, list[int] | None,
                                          list[int] | None]:
    """The pipeline, data- and tensor-parallel groups of this rank, when pg_config names them."""
    pp = dp = tp = None
    for _, ranks, words in _described(ev):
        if rank not in ranks or len(ranks) < 2:
            continue
        if words & _PP_WORDS:
            pp = ranks
        elif words & _DP_WORDS:
            dp = ranks
        elif words & _TP_WORDS:
            tp = ranks
    return pp, dp, tp


def model_parallel_groups(ev, rank: int, tp_size: int) -> frozenset:
    """Names of this rank's model-parallel process groups: those pg_config describes as tensor,
    context or expert parallel, and with tensor parallelism of `tp_size` (tp fastest), any
    group of two or more ranks inside the rank's own block of tp consecutive ranks."""
    out = set()
    # names pg_config gives a group of its own: never another group's by its ranks (an expert
    # group with the ranks of a data-parallel group: the gradient all-reduces stay data parallel)
    own = {g.name for g in ev.distributed_info.groups} if ev.distributed_info else set()
    for name, ranks, words in _described(ev):
        # expert-data-parallel groups (Megatron) and dp_shard_cp (torchtitan) sync gradients
        if rank in ranks and len(ranks) > 1 and words & _MODEL_PARALLEL_WORDS \
                and not words & _DP_WORDS:
            out.add(name)
            # and the collectives' groups of its ranks under another name (an entry without
            # pg_name, or collectives naming a group pg_config lists otherwise)
            out.update(str(n) for n, members in ev.pg_ranks.items()
                       if str(n) not in own and sorted(members) == sorted(ranks))
    if tp_size > 1:
        block = range(rank // tp_size * tp_size, rank // tp_size * tp_size + tp_size)
        for name, members in ev.pg_ranks.items():
            if rank in members and len(members) > 1 and all(m in block for m in members):
                out.add(str(name))
    return frozenset(out)



def group_sizes(parts: dict) -> dict[str, int]:
    """Sizes of the model-parallel dimensions the ranks' process groups show: tp, cp and ep from
    pg_config descriptions (not data parallel), ep also from the groups all-to-alls ran in.
    A dimension no group shows is left out."""
    sizes: dict[str, set] = {k: set() for k in _KIND_WORDS}
    for ev in parts.values():
        for _, ranks, words in _described(ev):
            for kind, names in _KIND_WORDS.items():
                if len(ranks) > 1 and words & names and not words & _DP_WORDS:
                    sizes[kind].add(len(ranks))
        if not sizes["ep"]:
            for c in ev.colls:
                members = ev.pg_ranks.get(c.pg) if c.kind in ("alltoall", "alltoallv") else None
                if members and 1 < len(members):
                    sizes["ep"].add(len(members))
    return {k: max(v) for k, v in sizes.items() if v}
