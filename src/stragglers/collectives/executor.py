"""StragglAR AllReduce on torch.distributed point-to-point operations (docs/stragglar.md §2).

Phase 1: the n-1 ready ranks reduce-scatter their buffers (the library collective on a
sub-group where the backend has it, else a ring of isend/irecv). Phase 2: the synthesised
schedule, one batch of isend/irecv per round. In place and SUM, like `dist.all_reduce`.

NCCL: every tensor that travels is the caller's (device) tensor or a device scratch buffer;
the up-front agreement check uses a control tensor on the backend's device; phase 1 uses the
library ReduceScatter; phase 2 rounds are `batch_isend_irecv` groups, posted in round order on
every rank (NCCL matches p2p in posting order, which is the same as the round order here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from stragglers.collectives.devices import backend_of, control_device
from stragglers.collectives.groups import create_ready_subgroups, group_ranks, ready_subgroups
from stragglers.collectives.schedule import Transfer, synthesize
from stragglers.errors import InputError

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
PHASE1_PATHS = ("auto", "library", "ring")
_DTYPE_CODES = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}


@dataclass(frozen=True)
class StragglarRun:
    """What one call did: the phase-1 path that ran, phase-2 rounds and mode, whether it padded."""

    phase1: str
    rounds: int
    padded: bool
    phase2: str = "dataflow"


def _library_reduce_scatter_preferred(group) -> bool:
    """NCCL/XCCL: the library ReduceScatter. gloo in torch 2.13 has reduce_scatter_tensor, but
    it measured slower than a whole AllReduce (32 MB, 3 of 4 ranks: 0.33-0.37 s vs 0.25-0.31 s),
    so on gloo "auto" picks the p2p ring."""
    backend = backend_of(group)
    return backend in ("nccl", "xccl")


def prepare_subgroups(group=None) -> None:
    """Create the n ready-rank sub-groups (one per possible straggler) of `group`.

    Collective over the *default* group: every rank of the job calls it at the same point
    (each with its own group, or one it is not in), as `dist.new_group` requires; see
    `groups.create_ready_subgroups`.
    `stragglar_all_reduce` does it on first library use when `group` is the whole job; for a
    smaller group it must be called up front (otherwise a hang would be the only outcome).
    """
    create_ready_subgroups(group)


def _ready_subgroup(group, straggler: int):
    subs = ready_subgroups(group)
    if subs is None and group_ranks(group) == tuple(range(dist.get_world_size())):
        create_ready_subgroups(group)  # every rank of the job is in this call: collective
        subs = ready_subgroups(group)
    if subs is None:
        raise InputError("stragglar_all_reduce", "phase1",
                         "the library phase 1 on a sub-group needs prepare_subgroups(group) "
                         "called on every rank of the job first")
    return subs[straggler]


def _metadata(tensor, straggler, device) -> torch.Tensor:
    is_tensor = isinstance(tensor, torch.Tensor)
    numel = tensor.numel() if is_tensor else -1
    dtype = _DTYPE_CODES.get(tensor.dtype, -1) if is_tensor else -2
    who = straggler if isinstance(straggler, int) and not isinstance(straggler, bool) else -1
    return torch.tensor([numel, dtype, who], dtype=torch.int64, device=device)


def _raise_on_mismatch(rows: list[list[int]]) -> None:
    for i, field in enumerate(("tensor.numel()", "tensor.dtype", "straggler")):
        values = [r[i] for r in rows]
        if len(set(values)) > 1:
            shown: list = values
            if field == "tensor.dtype":
                shown = [str(SUPPORTED_DTYPES[v]) if v >= 0 else
                         ("unsupported" if v == -1 else "not a tensor") for v in values]
            raise InputError("stragglar_all_reduce", field,
                             f"every rank must pass the same value; got {shown}")


class _Agreement:
    """The up-front input check, without making the ready ranks wait for the straggler.

    Every rank posts a tiny asynchronous all_gather of (length, dtype, straggler) over the
    group at once; the ready ranks also compare among themselves (a blocking all_gather on
    their sub-group, which they reach together) before phase 1, and everyone checks the full
    gather before phase 2, which needs the straggler anyway. A mismatch is the same InputError
    on every rank, never a hang or a wrong sum.
    """

    def __init__(self, tensor, straggler, group):
        self.n = dist.get_world_size(group)
        device = control_device(group, tensor if isinstance(tensor, torch.Tensor) else None)
        self.mine = _metadata(tensor, straggler, device)
        self.rows = torch.empty(self.n * 3, dtype=torch.int64, device=device)
        self.work = dist.all_gather_into_tensor(self.rows, self.mine, group=group, async_op=True)
        self.device = device

    def among_ready(self, subgroup) -> None:
        """Before phase 1, on a ready rank: the ready ranks agree with each other."""
        m = dist.get_world_size(subgroup)
        rows = torch.empty(m * 3, dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(rows, self.mine, group=subgroup)
        _raise_on_mismatch(rows.view(m, 3).tolist())

    def everyone(self) -> None:
        """Before phase 2: all ranks, the straggler included, agree."""
        self.work.wait()
        _raise_on_mismatch(self.rows.view(self.n, 3).tolist())


def _p2p(ops: list[tuple[str, torch.Tensor, int]], group) -> None:
    """Post one round of sends/receives as a batch and wait for all of them."""
    if not ops:
        return
    p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t, peer, group) for kind, t, peer in ops]
    for work in dist.batch_isend_irecv(p2p):
        work.wait()


def _ring_reduce_scatter(chunks: list[torch.Tensor], me: int, m: int, peer, group) -> None:
    """Ring ReduceScatter among logical ranks 0..m-1; afterwards chunks[me] holds the sum."""
    scratch = torch.empty_like(chunks[0]) if chunks else None
    for k in range(m - 1):
        send_c = (me - k - 1) % m
        recv_c = (me - k - 2) % m
        assert scratch is not None  # a ring of m > 1 ranks has chunks
        buf = scratch[: chunks[recv_c].numel()]
        _p2p([("send", chunks[send_c], peer((me + 1) % m)), ("recv", buf, peer((me - 1) % m))], group)
        chunks[recv_c].add_(buf)


def _phase2_lockstep(plan, chunks: list[torch.Tensor], peer, group) -> None:
    """Phase 2 round by round: post the round's batch, wait for all of it, add exchanges."""
    scratch = torch.empty_like(chunks[0])
    for sends, recvs in plan:
        ops, adds = [], []
        for t in sends:
            ops.append(("send", chunks[t.chunk], peer(t.dst)))
        for t in recvs:
            if t.exchange:
                buf = scratch[: chunks[t.chunk].numel()]
                ops.append(("recv", buf, peer(t.src)))
                adds.append((chunks[t.chunk], buf))
            else:
                ops.append(("recv", chunks[t.chunk], peer(t.src)))
        _p2p(ops, group)
        for dst, buf in adds:
            dst.add_(buf)


def _phase2_dataflow(plan, chunks: list[torch.Tensor], peer, group) -> None:
    """Phase 2 without the lock-step: each round is still one batch_isend_irecv (NCCL needs a
    send and a receive with the same peer grouped), but it is posted as soon as the chunks its
    sends need have arrived, without waiting for the rest of the previous round.

    Deadlock-free: round k is posted after waiting only on receives of rounds < k, whose sends
    were posted by the same argument. Tags carry the round, so messages match whatever the timing.
    """
    pending: dict[int, tuple[object, torch.Tensor | None, object]] = {}  # chunk -> recv, scratch, own send
    outstanding: list[object] = []
    waited: set[int] = set()

    def wait_once(work) -> None:
        if id(work) not in waited:  # a gloo work must not be waited twice
            waited.add(id(work))
            work.wait()

    def ensure(c: int) -> None:
        if c in pending:
            work, buf, my_send = pending.pop(c)
            wait_once(work)
            if buf is not None:
                if my_send is not None:
                    wait_once(my_send)  # the chunk we add into must have left first
                chunks[c].add_(buf)

    for k, (sends, recvs) in enumerate(plan):
        for t in sends:
            if not t.exchange:
                ensure(t.chunk)
        ops: list[dist.P2POp] = []
        roles: list[tuple[str, Transfer, torch.Tensor | None]] = []   # (kind, transfer, scratch)
        for t in sends:
            ops.append(dist.P2POp(dist.isend, chunks[t.chunk], peer(t.dst), group, tag=k + 1))
            roles.append(("send", t, None))
        for t in recvs:
            # exchanges receive into scratch (S needs n-1 of them: one buffer-size in all)
            buf = torch.empty_like(chunks[t.chunk]) if t.exchange else None
            ops.append(dist.P2POp(dist.irecv, chunks[t.chunk] if buf is None else buf, peer(t.src), group,
                                  tag=k + 1))
            roles.append(("recv", t, buf))
        if not ops:
            continue
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # a coalesced backend returns one work for the whole batch
            works = [works[-1]] * len(ops)
        outstanding += works
        own = {t.chunk: w for (kind, t, _), w in zip(roles, works) if kind == "send" and t.exchange}
        for (kind, t, buf), w in zip(roles, works):
            if kind == "recv":
                pending[t.chunk] = (w, buf, own.get(t.chunk) if t.exchange else None)
    for c in list(pending):
        ensure(c)
    for work in outstanding:
        wait_once(work)


PHASE2_MODES = ("dataflow", "lockstep")


def stragglar_all_reduce(tensor: torch.Tensor, straggler: int, group=None,
                         phase1: str = "auto", phase2: str = "dataflow",
                         check: bool = True) -> StragglarRun:
    """Sum `tensor` over the group in place, treating rank `straggler` (group rank) as late.

    Every rank must pass the same `straggler`. Any length, float32/float64/bfloat16/float16.
    `phase1`: "library" (reduce_scatter_tensor on the ready ranks), "ring" (p2p ring) or "auto"
    (library on NCCL, ring on gloo). `phase2`: "lockstep" (one batch_isend_irecv per round, wait
    for all of it) or "dataflow" (per-round batches, each send waits only for its own chunk).
    `check` (default): first agree on length, dtype and straggler with one tiny all_gather, so
    a mismatch is the same InputError on every rank instead of a hang or a wrong sum (callers
    that guarantee agreement, like the DDP hook, pass False; after such an error the ready
    ranks' tensors are unspecified, as after a failed collective). Tensors that require grad are
    reduced like `dist.all_reduce` does (outside autograd). The StragglarRun says what ran.
    """
    with torch.no_grad():
        return _stragglar_all_reduce(tensor, straggler, group, phase1, phase2, check)


def _stragglar_all_reduce(tensor, straggler, group, phase1, phase2, check) -> StragglarRun:
    agreement = None
    if check and dist.get_world_size(group) > 1:
        # first: an error raised on one rank only would leave the others hanging
        agreement = _Agreement(tensor, straggler, group)
        if not (isinstance(straggler, int) and 0 <= straggler < dist.get_world_size(group)):
            agreement.everyone()  # the same error everywhere if ranks disagree, else below
    if not isinstance(tensor, torch.Tensor):
        raise InputError("stragglar_all_reduce", "tensor", f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise InputError("stragglar_all_reduce", "tensor.dtype",
                         f"expected one of float32/float64/bfloat16/float16, got {tensor.dtype}")
    if phase2 not in PHASE2_MODES:
        raise InputError("stragglar_all_reduce", "phase2", f"expected one of {PHASE2_MODES}, got {phase2!r}")
    if phase1 not in PHASE1_PATHS:
        raise InputError("stragglar_all_reduce", "phase1", f"expected one of {PHASE1_PATHS}, got {phase1!r}")
    n = dist.get_world_size(group)
    me = dist.get_rank(group)
    if isinstance(straggler, bool) or not isinstance(straggler, int) or not 0 <= straggler < n:
        raise InputError("stragglar_all_reduce", "straggler", f"expected a rank in 0..{n - 1}, got {straggler!r}")
    if n == 1:
        return StragglarRun("none", 0, False)

    ready = [r for r in range(n) if r != straggler]
    logical = n - 1 if me == straggler else ready.index(me)
    to_group = lambda lg: straggler if lg == n - 1 else ready[lg]  # noqa: E731
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    peer = lambda lg: to_global(to_group(lg))  # noqa: E731
    ready_peer = lambda lg: to_global(ready[lg])  # noqa: E731

    path = phase1
    if path == "auto":
        path = "library" if _library_reduce_scatter_preferred(group) else "ring"
    m = n - 1
    numel = tensor.numel()
    padded = path == "library" and numel % m != 0
    if padded or not tensor.is_contiguous():
        per = -(-numel // m) if path == "library" else None
        work = torch.zeros((per * m) if per else numel, dtype=tensor.dtype, device=tensor.device)
        work[:numel].copy_(tensor.reshape(-1))
    else:
        work = tensor.view(-1)
    chunks = list(work.tensor_split(m))

    if path == "library" or (agreement is not None and m > 1):
        subgroup = _ready_subgroup(group, straggler)  # every rank, the straggler too, the first time
    if logical != n - 1 and m > 1:
        if agreement is not None:
            agreement.among_ready(subgroup)
        if path == "library":
            out = torch.empty_like(chunks[logical])
            dist.reduce_scatter_tensor(out, work, group=subgroup)
            chunks[logical].copy_(out)
        else:
            _ring_reduce_scatter(chunks, logical, m, ready_peer, group)

    if agreement is not None:
        agreement.everyone()
    sched = synthesize(n)
    plan = sched.rank_plan(logical)
    if phase2 == "lockstep":
        _phase2_lockstep(plan, chunks, peer, group)
    else:
        _phase2_dataflow(plan, chunks, peer, group)

    if work.data_ptr() != tensor.data_ptr() or padded:
        tensor.copy_(work[:numel].view_as(tensor))
    return StragglarRun(path, sched.num_rounds, padded, phase2)
