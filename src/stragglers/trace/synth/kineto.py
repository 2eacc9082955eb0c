"""Synthetic GPU jobs written as PyTorch-profiler (Kineto) JSON, one file per rank, with the
injected causes recorded as ground truth.

A data-parallel GPU job on NCCL is simulated step by step: each rank's host issues its work
(it can be late: a host stall), kernels run on a compute stream (slower on a faulty GPU or on a
slow group of devices), all-to-alls block the forward until every rank has arrived, DDP's
gradient buckets are all-reduced on a communication stream while backward runs, and the
optimizer follows the last bucket. Every collective ends on all ranks when its last member
arrived plus its transfer time, as on real hardware. The files then hold what Kineto writes:
`ProfilerStep#N` spans, `cudaLaunchKernel` events linked to kernels by correlation id,
autograd ops on their own thread, `record_param_comms` with `Collective name`, `Seq`, sizes
and the process group, NCCL kernels on their own stream, a clock offset per host, and kernels
still running from before the profiling window (no launch record).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import numpy as np

from stragglers.trace.jsontypes import JsonObject

_CPU, _GPU = 100, 0
_COMPUTE_STREAM, _NCCL_STREAM = 7, 20
_MAIN, _AUTOGRAD = 1, 2


class TruthCause(TypedDict):
    """One injected cause of truth.yaml: the diagnosis cause and the ranks it sits on."""

    cause: str
    ranks: list[int]


class GpuTruth(TypedDict):
    """truth.yaml: the injected causes ({"cause": "none", "ranks": []} for a clean job)."""

    causes: list[TruthCause]


class KinetoEvent(TypedDict):
    """One complete ('X') trace event as the profiler writes it (µs)."""

    ph: str
    cat: str
    name: str
    pid: int
    tid: int
    ts: float
    dur: float
    args: JsonObject


class GroupJson(TypedDict):
    """One entry of distributedInfo.pg_config, as torch writes it."""

    pg_name: str
    pg_desc: str
    pg_size: int
    ranks: list[int]


@dataclass
class GpuJob:
    """What to simulate; the injections are the ground truth of the job written."""

    ranks: int = 8
    steps: int = 6
    seed: int = 0
    first_step: int = 10
    all_to_alls: int = 2            # blocking all-to-alls in each forward
    buckets: int = 4                # DDP gradient buckets (unequal sizes)
    forward_us: float = 4000.0
    backward_us: float = 8000.0
    jitter: float = 0.02            # relative noise of every kernel
    clock_offset_us: float = 300.0  # hosts' clocks differ by up to this
    ranks_per_host: int = 0         # > 0: blocks of this many ranks share a host (host_name) and
                                    # its clock; 0: every rank on a host of its own, unnamed
    host_jitter_us: float = 0.0     # every host starts every step up to this late (noise)
    expert_groups: int = 1          # the all-to-alls run within this many groups of ranks
                                    # (expert parallelism); the gradient all-reduce spans all
    cp_size: int = 1                # context parallelism: after TP's all-reduce each forward
                                    # piece exchanges K/V in its CP group (ranks tp apart)
    cp_comm: str = "all_gather"     # how: one all-gather; "ring": ring attention (send to the
                                    # next CP rank, receive from the one before, cp - 1 rounds,
                                    # each after its chunk of attention; the backward's dK/dV
                                    # likewise at its start); "all_to_all": torch's all-to-all
                                    # rotation (equal splits) in those rounds instead
    tp_size: int = 1                # tensor parallelism: blocks of this many consecutive ranks
                                    # all-reduce after every forward piece (blocking); DDP's
                                    # buckets then run in the data-parallel groups
    late_rank: tuple[int, float] | None = None        # (rank, µs late at every step start)
    slow_rank: tuple[int, float] | None = None        # (rank, compute factor)
    slow_group: tuple[tuple[int, ...], float] | None = None   # (ranks, compute factor)
    # MoE routing: each all-to-all dispatches `rows` rows per rank in all, drawn over the
    # ranks of its group (uniformly: balanced routing with its sampling noise; the hot rank
    # `factor` times as likely); the compute after it scales with the rows received
    rows: int = 4096
    hot_expert: tuple[int, float] | None = None       # (rank, routing weight)
    # the combine: after the expert compute each dispatch's rows go back to their ranks in a
    # second all-to-all (a rank sends what it received, receives what it sent)
    combine: bool = False
    # all-to-all transfer per row moved: each member's transfer grows by this many µs per row
    # it moves (received + sent, the split sizes' sums: the ground truth of both), so a hot
    # expert's rank transfers longest and the others wait for it at the next collective
    a2a_us_per_row: float = 0.0
    # a slow link: the all-to-alls of the expert-parallel group holding the rank take this
    # many times as long to transfer (every member of a collective waits for its slowest link)
    slow_link: tuple[int, float] | None = None        # (rank, transfer factor)
    base_ns: int = 1_700_000_000_000_000_000
    truth: GpuTruth = field(default_factory=lambda: GpuTruth(causes=[]))

    def __post_init__(self) -> None:
        if self.cp_comm not in ("all_gather", "ring", "all_to_all"):
            raise ValueError(f"cp_comm {self.cp_comm!r}: expected all_gather, ring or all_to_all")
        if self.tp_size < 1 or self.cp_size < 1 or self.ranks % (self.tp_size * self.cp_size):
            raise ValueError(f"tp_size {self.tp_size} × cp_size {self.cp_size} does not divide "
                             f"the {self.ranks} ranks")
        found: list[TruthCause] = []
        if self.late_rank is not None:
            found.append({"cause": "host_stall", "ranks": [self.late_rank[0]]})
        if self.slow_rank is not None:
            found.append({"cause": "worker_fault", "ranks": [self.slow_rank[0]]})
        if self.slow_group is not None:
            found.append({"cause": "slow_group", "ranks": sorted(self.slow_group[0])})
        if self.slow_link is not None:
            if not self.all_to_alls:
                raise ValueError("slow_link needs all-to-alls (all_to_alls >= 1)")
            group = next(m for m in np.array_split(np.arange(self.ranks), self.expert_groups)
                         if self.slow_link[0] in m)
            found.append({"cause": "communication", "ranks": [int(r) for r in group]})
        if self.hot_expert is not None:
            if not self.all_to_alls:
                raise ValueError("hot_expert needs all-to-alls (all_to_alls >= 1)")
            found.append({"cause": "expert_imbalance", "ranks": [self.hot_expert[0]]})
        self.truth = {"causes": found or [{"cause": "none", "ranks": []}]}


class _Rank:
    """One rank's events as Kineto writes them (µs on its own clock)."""

    def __init__(self, rank: int, offset: float, corr: int) -> None:
        self.rank, self.offset, self.corr = rank, offset, corr
        self.events: list[KinetoEvent] = []
        self.cpu = 0.0      # the host's cursor: it issues work in program order, ahead of the GPU

    def issue(self, at_least: float = 0.0) -> float:
        """The time the host issues its next call (a few µs after the one before)."""
        self.cpu = max(self.cpu + 8.0, at_least)
        return self.cpu

    def x(self, cat: str, name: str, ts: float, dur: float, pid: int, tid: int,
          args: JsonObject | None = None) -> None:
        self.events.append({"ph": "X", "cat": cat, "name": name, "pid": pid, "tid": tid,
                            "ts": round(ts + self.offset, 3), "dur": round(max(dur, 0.0), 3),
                            "args": args or {}})

    def kernel(self, name: str, launch: float, start: float, dur: float, stream: int,
               tid: int = _MAIN, args: JsonObject | None = None, launched: bool = True) -> None:
        self.corr += 1
        if launched:
            self.x("cuda_runtime", "cudaLaunchKernel", launch, 4.0, _CPU, tid,
                   {"correlation": self.corr})
        self.x("kernel", name, start, dur, _GPU, stream, {"correlation": self.corr, **(args or {})})


def write_gpu_job(job: GpuJob, out: Path | str) -> GpuTruth:
    """Simulate the job and write rank-N.json.gz files (and truth.yaml) into `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(job.seed)
    n = job.ranks
    speed = np.ones(n)
    if job.slow_rank is not None:
        speed[job.slow_rank[0]] = job.slow_rank[1]
    if job.slow_group is not None:
        speed[list(job.slow_group[0])] = job.slow_group[1]
    late = np.zeros(n)
    if job.late_rank is not None:
        late[job.late_rank[0]] = job.late_rank[1]
    offsets = rng.uniform(-job.clock_offset_us, job.clock_offset_us, n)
    if job.ranks_per_host > 0:  # one clock per host: its first rank's
        offsets = offsets[np.arange(n) // job.ranks_per_host * job.ranks_per_host]
    ranks = [_Rank(r, offsets[r], 10_000 * (r + 1)) for r in range(n)]
    sizes = rng.uniform(0.3, 1.7, job.buckets)
    sizes = sizes / sizes.sum()
    seq = ep_seq = tp_seq = cp_seq = 0
    _pre_window(ranks, rng)
    t = 1_000_000.0                                  # step start (true time, µs)
    for s in range(job.steps):
        step = job.first_step + s
        host = t + late + rng.uniform(0, 30 + job.host_jitter_us, n)  # the step's begin
        for r in range(n):
            ranks[r].cpu = host[r] - 8.0
        gpu = host + 15.0                            # its first kernel can start
        pieces = job.all_to_alls + 1
        load = np.ones(n)                            # the first piece routes nothing
        for k in range(pieces):
            dur = job.forward_us / pieces * speed * load * (1 + job.jitter * rng.standard_normal(n))
            for r in range(n):
                ranks[r].kernel(f"volta_sgemm_fwd_{k}", ranks[r].issue(), gpu[r], dur[r],
                                _COMPUTE_STREAM)
            gpu = gpu + dur
            for gi, members in enumerate(_tp_groups(job)):
                gpu[members] = _collective(
                    ranks, "all_reduce", "ncclDevKernel_AllReduce_RING_LL_Sum_bf16", tp_seq + 1,
                    gpu, 40.0 + 20.0 * rng.random(), 1 << 18, rng, members=members,
                    pg=_tp_pg(job, gi), desc="tensor_model_parallel")
            tp_seq += 1 if job.tp_size > 1 else 0
            ring = job.cp_comm != "all_gather"
            if ring:
                # attention: its chunks take what the piece takes, not what the routing sent it
                gpu, cp_seq = _ring_attention(job, ranks, gpu, dur / load / job.cp_size, rng,
                                              _MAIN, cp_seq)
            for gi, members in enumerate(_cp_groups(job) if not ring else []):
                gpu[members] = _collective(
                    ranks, "all_gather", "ncclDevKernel_AllGather_RING_LL", cp_seq + 1, gpu,
                    50.0 + 30.0 * rng.random(), 1 << 19, rng, members=members,
                    pg=_cp_pg(job, gi), desc="context_parallel")
            cp_seq += 1 if job.cp_size > 1 and not ring else 0
            if job.combine and 0 < k <= job.all_to_alls:   # the expert results go back
                ep_seq += 1
                transfer = 60.0 + 40.0 * rng.random()
                for gi, group in enumerate(np.array_split(np.arange(n), job.expert_groups)):
                    sent = np.rint(load[group] * job.rows).astype(np.int64)
                    back = np.full(len(group), job.rows, dtype=np.int64)
                    gpu[group] = _collective(
                        ranks, "all_to_all", "ncclDevKernel_SendRecv", ep_seq, gpu,
                        _slow_link(job, group) * transfer, 1 << 20, rng,
                        members=[int(m) for m in group], pg=_ep_pg(job, gi), received=back,
                        sent=sent, per_row=job.a2a_us_per_row)
            if k < job.all_to_alls:
                ep_seq += 1
                transfer = 60.0 + 40.0 * rng.random()
                for gi, group in enumerate(np.array_split(np.arange(n), job.expert_groups)):
                    got = _routed(job, group, rng)
                    load[group] = got / job.rows
                    gpu[group] = _collective(
                        ranks, "all_to_all", "ncclDevKernel_SendRecv", ep_seq, gpu,
                        _slow_link(job, group) * transfer, 1 << 20, rng,
                        members=[int(m) for m in group], pg=_ep_pg(job, gi), received=got,
                        sent=np.full(len(group), job.rows, dtype=np.int64),
                        per_row=job.a2a_us_per_row)
        # backward with DDP buckets on the NCCL stream
        bwd = job.backward_us * speed * (1 + job.jitter * rng.standard_normal(n))
        if job.cp_comm != "all_gather":     # attention's backward passes dK/dV around the ring first
            gpu, cp_seq = _ring_attention(job, ranks, gpu, 0.1 * bwd / job.cp_size, rng,
                                          _AUTOGRAD, cp_seq)
        bstart = gpu
        ready = np.cumsum(sizes)[:, None] * bwd[None, :] + bstart[None, :]        # [B, n]
        chunks = np.diff(np.concatenate([bstart[None, :], ready]), axis=0)
        comm = np.full(n, -np.inf)
        for b in range(job.buckets):
            for r in range(n):
                # the autograd engine launches each backward kernel inside its function's op
                at = ranks[r].issue()
                ranks[r].x("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0",
                           at, 12.0, _CPU, _AUTOGRAD)
                ranks[r].kernel(f"volta_sgemm_bwd_{b}", at + 2.0, ready[b, r] - chunks[b, r],
                                chunks[b, r], _COMPUTE_STREAM, tid=_AUTOGRAD)
            seq += 1
            arrive = np.maximum(ready[b] + 5.0, comm)
            transfer = 150.0 + 900.0 * sizes[b] * job.buckets / 2
            for gi, members in enumerate(_dp_groups(job)):
                comm[members] = _collective(
                    ranks, "all_reduce", "ncclDevKernel_AllReduce_RING_LL_Sum_float", seq,
                    arrive, transfer, int(sizes[b] * (1 << 26)), rng, tid=_AUTOGRAD,
                    members=members, pg=_dp_pg(job, gi),
                    desc="default_pg" if job.tp_size * job.cp_size == 1 else "data_parallel")
        done = np.maximum(comm, ready[-1])
        opt = 300.0 * (1 + job.jitter * rng.standard_normal(n))
        for r in range(n):
            at = ranks[r].issue()
            ranks[r].x("user_annotation", "Optimizer.step#SGD.step", at, 20.0, _CPU, _MAIN)
            ranks[r].kernel("multi_tensor_apply_kernel", ranks[r].issue(), done[r], opt[r],
                            _COMPUTE_STREAM)
        end = done + opt
        for r in range(n):
            ranks[r].x("user_annotation", f"ProfilerStep#{step}", host[r], end[r] + 10 - host[r],
                       _CPU, _MAIN)
        t = float(end.max()) + 50.0
    for rk in ranks:
        _write_rank(rk, job, out / f"rank-{rk.rank}.json.gz")
    (out / "truth.yaml").write_text(json.dumps(job.truth, indent=2))  # JSON is YAML; not *.json: the reader takes those as ranks
    return job.truth


def _ring_attention(job: GpuJob, ranks: list[_Rank], gpu: np.ndarray, chunk: np.ndarray,
                    rng, tid: int, seq: int) -> tuple[np.ndarray, int]:
    """Context parallelism's exchange in every CP group, cp - 1 rounds of a chunk of attention
    then K/V (or dK/dV) passed on: as ring attention (sent to the next CP rank, received from
    the one before; each transfer ends when the later of its pair arrived plus its time) or
    as torch's all-to-all rotation (one exchange of equal splits). Returns the ranks' ends
    and the CP groups' last sequence number."""
    gpu = gpu.copy()
    groups = _cp_groups(job)
    for _ in range(job.cp_size - 1):
        seq += 1
        for r in range(len(ranks)):
            ranks[r].kernel("flash_fwd_kernel" if tid == _MAIN else "flash_bwd_kernel",
                            ranks[r].issue(), gpu[r], chunk[r], _COMPUTE_STREAM, tid=tid)
        gpu = gpu + chunk
        if job.cp_comm == "all_to_all":
            rows = np.full(job.cp_size, 1024, dtype=np.int64)
            for gi, members in enumerate(groups):
                gpu[members] = _collective(
                    ranks, "all_to_all", "ncclDevKernel_SendRecv", seq, gpu,
                    40.0 + 20.0 * rng.random(), 1 << 19, rng, tid=tid, members=members,
                    pg=_cp_pg(job, gi), desc="context_parallel", received=rows, sent=rows)
            continue
        done = gpu.copy()
        for members in groups:
            for i, src in enumerate(members):
                dst = members[(i + 1) % len(members)]
                end = max(gpu[src], gpu[dst]) + (30.0 + 20.0 * rng.random())
                done[src], done[dst] = max(done[src], end), max(done[dst], end)
        for gi, members in enumerate(groups):
            for i, me in enumerate(members):
                # one grouped launch (batch_isend_irecv): both end when the later transfer
                # has; as Transformer Engine posts them, an even CP rank sends first
                pair = [("send", "Dst Rank", members[(i + 1) % len(members)]),
                        ("recv", "Src Rank", members[i - 1])]
                for kind, key, peer in pair if i % 2 == 0 else pair[::-1]:
                    args: JsonObject = {
                        "Collective name": kind, "Process Group Name": _cp_pg(job, gi),
                        "Process Group Description": "context_parallel",
                        "Process Group Ranks": str(members), "Group size": len(members),
                        "In msg nelems": 1 << 17, "Out msg nelems": 1 << 17,
                        "dtype": "BFloat16", key: peer}
                    at = ranks[me].issue()
                    ranks[me].x("cpu_op", "record_param_comms", at, 6.0, _CPU, tid, args)
                    ranks[me].kernel("ncclDevKernel_SendRecv", at + 1.0, gpu[me],
                                     done[me] - gpu[me], _NCCL_STREAM, tid=tid, args=args)
        gpu = done
    return gpu, seq


def _slow_link(job: GpuJob, members: np.ndarray) -> float:
    """The transfer factor of a group's collectives (every member waits for its slowest link)."""
    link = job.slow_link
    return link[1] if link is not None and link[0] in members else 1.0


def _ep_pg(job: GpuJob, i: int) -> str:
    return str(i + 1) if job.expert_groups > 1 else "0"


def _routed(job: GpuJob, members: np.ndarray, rng) -> np.ndarray:
    """Rows each member receives at one dispatch: the group's rows drawn over its ranks."""
    weight = np.ones(len(members))
    if job.hot_expert is not None and job.hot_expert[0] in members:
        weight[list(members).index(job.hot_expert[0])] = job.hot_expert[1]
    return rng.multinomial(job.rows * len(members), weight / weight.sum()).astype(np.int64)


def _tp_groups(job: GpuJob) -> list[list[int]]:
    """Tensor-parallel groups: blocks of tp consecutive ranks (none without TP)."""
    if job.tp_size == 1:
        return []
    return [list(range(b, b + job.tp_size)) for b in range(0, job.ranks, job.tp_size)]


def _cp_groups(job: GpuJob) -> list[list[int]]:
    """Context-parallel groups (Megatron order: tp fastest, then cp): ranks tp apart."""
    if job.cp_size == 1:
        return []
    block = job.tp_size * job.cp_size
    return [[b + t + k * job.tp_size for k in range(job.cp_size)]
            for b in range(0, job.ranks, block) for t in range(job.tp_size)]


def _dp_groups(job: GpuJob) -> list[list[int]]:
    """Data-parallel groups: the ranks with one tensor- and context-parallel index."""
    block = job.tp_size * job.cp_size
    return [list(range(i, job.ranks, block)) for i in range(block)]


def _tp_pg(job: GpuJob, i: int) -> str:
    return str(1 + job.expert_groups + i)


def _cp_pg(job: GpuJob, i: int) -> str:
    return str(1 + job.expert_groups + job.ranks // job.tp_size + i)


def _dp_pg(job: GpuJob, i: int) -> str:
    if job.tp_size * job.cp_size == 1:
        return "0"
    return str(1 + job.expert_groups + job.ranks // job.tp_size + job.ranks // job.cp_size + i)


def _groups(job: GpuJob) -> list[GroupJson]:
    """distributedInfo.pg_config: the world, the EP, TP and DP groups, as torch writes it."""
    out: list[GroupJson] = [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": job.ranks,
            "ranks": list(range(job.ranks))}]
    if job.expert_groups > 1:
        out += [{"pg_name": str(i + 1), "pg_desc": "ep_group", "pg_size": len(m),
                 "ranks": [int(x) for x in m]}
                for i, m in enumerate(np.array_split(np.arange(job.ranks), job.expert_groups))]
    out += [{"pg_name": _tp_pg(job, i), "pg_desc": "tensor_model_parallel",
             "pg_size": len(m), "ranks": m} for i, m in enumerate(_tp_groups(job))]
    out += [{"pg_name": _cp_pg(job, i), "pg_desc": "context_parallel",
             "pg_size": len(m), "ranks": m} for i, m in enumerate(_cp_groups(job))]
    if job.tp_size * job.cp_size > 1:
        out += [{"pg_name": _dp_pg(job, i), "pg_desc": "data_parallel", "pg_size": len(m),
                 "ranks": m} for i, m in enumerate(_dp_groups(job))]
    return out


def _collective(ranks: list[_Rank], name: str, kernel: str, seq: int, arrive: np.ndarray,
                transfer: float, nbytes: int, rng, tid: int = _MAIN,
                members: list[int] | None = None, pg: str = "0",
                desc: str | None = None, received: np.ndarray | None = None,
                sent: np.ndarray | None = None, per_row: float = 0.0) -> np.ndarray:
    """A collective of its process group (all ranks by default): each member arrives when it
    can, all end together. An all-to-all's split sizes sum to the rows each member
    `received` and `sent`; with `per_row` µs a row, each member ends that much later per row
    it moved. Returns the members' ends."""
    members = list(range(len(ranks))) if members is None else members
    end = float(arrive[members].max()) + transfer * (1 + 0.02 * rng.standard_normal())
    ends = np.full(len(members), end)
    if per_row and received is not None and sent is not None:
        ends = ends + per_row * (received + sent)
    args: JsonObject = {"Collective name": name, "Process Group Name": pg,
                        "Process Group Description": desc or ("default_pg" if pg == "0"
                                                              else "ep_group"),
                        "Process Group Ranks": str(members), "Group size": len(members),
                        "Seq": seq, "In msg nelems": nbytes // 4, "Out msg nelems": nbytes // 4,
                        "dtype": "Float"}
    for i, r in enumerate(members):
        rk = ranks[r]
        at = rk.issue()
        if received is not None and sent is not None:   # rows from / to each member
            args = {**args, "Out split size": str(_split(int(received[i]), len(members))),
                    "In split size": str(_split(int(sent[i]), len(members)))}
        rk.x("cpu_op", "record_param_comms", at, 6.0, _CPU, tid, args)
        rk.kernel(kernel, at + 1.0, arrive[r], ends[i] - arrive[r], _NCCL_STREAM, tid=tid,
                  args=args)
        rk.cpu = at + 1.0
    return ends


def _split(rows: int, parts: int) -> list[int]:
    """`rows` in `parts` near-equal split sizes (the first ones one larger)."""
    return [rows // parts + (j < rows % parts) for j in range(parts)]


def _pre_window(ranks: list[_Rank], rng) -> None:
    """Kernels of the step before the window, still running when it opened (no launch)."""
    for rk in ranks:
        first = rk.corr
        rk.corr -= 5
        for i in range(3):
            rk.kernel("volta_sgemm_bwd_prev", 0, 1_000_000.0 + 20 * i, 15.0, _COMPUTE_STREAM,
                      launched=False)
        rk.corr = first


def _write_rank(rk: _Rank, job: GpuJob, path: Path) -> None:
    """One rank's Kineto document."""
    doc = {"schemaVersion": 1,
           "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
           "distributedInfo": {"backend": "nccl", "rank": rk.rank, "world_size": job.ranks,
                               "pg_config": _groups(job)},
           "baseTimeNanoseconds": job.base_ns,
           **({"host_name": f"node-{rk.rank // job.ranks_per_host}"} if job.ranks_per_host > 0
              else {}),
           "traceEvents": sorted(rk.events, key=lambda e: e["ts"])}
    path.write_bytes(gzip.compress(json.dumps(doc).encode(), compresslevel=1))
