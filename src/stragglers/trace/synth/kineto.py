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
                                    # each after its chunk of attention; each microbatch's
                                    # backward passes dK/dV likewise at its start, its attention
                                    # kernels inside their autograd op); "all_to_all": torch's
                                    # all-to-all rotation (equal splits) in those rounds instead
    pp_size: int = 1                # pipeline stages (Megatron order: blocks of ranks/pp
                                    # consecutive ranks, pp slowest); each step runs
    microbatches: int = 1           # this many microbatches through them (GPipe), each stage
                                    # with its own TP, CP, EP and DP groups
    grad_norm: bool = False         # gradient clipping: one all-reduce of the norm over every
                                    # rank (the default group) before the optimizer
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
        if self.tp_size < 1 or self.cp_size < 1 or self.pp_size < 1 or self.ranks % (
                self.tp_size * self.cp_size * self.pp_size):
            raise ValueError(f"tp_size {self.tp_size} × cp_size {self.cp_size} × pp_size "
                             f"{self.pp_size} does not divide the {self.ranks} ranks")
        if self.microbatches < 1:
            raise ValueError(f"microbatches {self.microbatches}: expected 1 or more")
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
            group = next(m for m in _ep_groups(self) if self.slow_link[0] in m)
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
    sim = _Sim(job, ranks, rng, speed, sizes / sizes.sum())
    _pre_window(ranks, rng)
    t = 1_000_000.0                                  # step start (true time, µs)
    for s in range(job.steps):
        step = job.first_step + s
        host = t + late + rng.uniform(0, 30 + job.host_jitter_us, n)  # the step's begin
        for r in range(n):
            ranks[r].cpu = host[r] - 8.0
        gpu = host + 15.0                            # its first kernel can start
        if job.pp_size == 1:
            done = _backward(sim, _forward(sim, gpu, list(range(n))), list(range(n)))[1]
        else:
            done = _pipeline(sim, gpu)
        if job.grad_norm:   # every stage's norm, summed over the world: it waits for them all
            counter = "dp" if _dp_pg(job, 0) == "0" else "world"   # the default group's Seq
            sim.seq[counter] += 1
            done = _collective(ranks, "all_reduce", "ncclDevKernel_AllReduce_RING_LL_Sum_float",
                               sim.seq[counter], done + 5.0, 25.0, 4, rng, pg="0")
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


@dataclass
class _Sim:
    """One job's simulation state: its ranks' events, noise and collective sequence numbers."""

    job: GpuJob
    ranks: list[_Rank]
    rng: np.random.Generator
    speed: np.ndarray                 # compute factor per rank
    sizes: np.ndarray                 # DDP buckets' shares of the gradients
    seq: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ("dp", "ep", "tp", "cp", "pp", "world"), 0))


def _forward(sim: _Sim, gpu: np.ndarray, stage: list[int], share: float = 1.0) -> np.ndarray:
    """One forward (`share` of the step's, a microbatch's in a pipeline) on the ranks of
    `stage`: compute pieces cut by the TP all-reduces, the CP exchange and the MoE all-to-alls
    of their groups. Returns the ranks' GPU times after it (others' left as they were)."""
    job, ranks, rng, n = sim.job, sim.ranks, sim.rng, sim.job.ranks
    gpu = gpu.copy()
    mine = set(stage)
    pieces = job.all_to_alls + 1
    load = np.ones(n)                            # the first piece routes nothing
    for k in range(pieces):
        dur = share * job.forward_us / pieces * sim.speed * load * (
            1 + job.jitter * rng.standard_normal(n))
        for r in stage:
            ranks[r].kernel(f"volta_sgemm_fwd_{k}", ranks[r].issue(), gpu[r], dur[r],
                            _COMPUTE_STREAM)
        gpu[stage] = gpu[stage] + dur[stage]
        for gi, members in _in_stage(_tp_groups(job), mine):
            gpu[members] = _collective(
                ranks, "all_reduce", "ncclDevKernel_AllReduce_RING_LL_Sum_bf16",
                sim.seq["tp"] + 1, gpu, 40.0 + 20.0 * rng.random(), 1 << 18, rng,
                members=members, pg=_tp_pg(job, gi), desc="tensor_model_parallel")
        sim.seq["tp"] += 1 if job.tp_size > 1 else 0
        ring = job.cp_comm != "all_gather"
        if ring:
            # attention: its chunks take what the piece takes, not what the routing sent it
            gpu = _ring_attention(sim, gpu, dur / load / job.cp_size, _MAIN, mine)
        for gi, members in _in_stage(_cp_groups(job) if not ring else [], mine):
            gpu[members] = _collective(
                ranks, "all_gather", "ncclDevKernel_AllGather_RING_LL", sim.seq["cp"] + 1, gpu,
                50.0 + 30.0 * rng.random(), 1 << 19, rng, members=members,
                pg=_cp_pg(job, gi), desc="context_parallel")
        sim.seq["cp"] += 1 if job.cp_size > 1 and not ring else 0
        if job.combine and 0 < k <= job.all_to_alls:   # the expert results go back
            sim.seq["ep"] += 1
            transfer = 60.0 + 40.0 * rng.random()
            for gi, group in _in_stage(_ep_groups(job), mine):
                sent = np.rint(load[group] * job.rows).astype(np.int64)
                back = np.full(len(group), job.rows, dtype=np.int64)
                gpu[group] = _collective(
                    ranks, "all_to_all", "ncclDevKernel_SendRecv", sim.seq["ep"], gpu,
                    _slow_link(job, group) * transfer, 1 << 20, rng, members=group,
                    pg=_ep_pg(job, gi), received=back, sent=sent, per_row=job.a2a_us_per_row)
        if k < job.all_to_alls:
            sim.seq["ep"] += 1
            transfer = 60.0 + 40.0 * rng.random()
            for gi, group in _in_stage(_ep_groups(job), mine):
                got = _routed(job, group, rng)
                load[group] = got / job.rows
                gpu[group] = _collective(
                    ranks, "all_to_all", "ncclDevKernel_SendRecv", sim.seq["ep"], gpu,
                    _slow_link(job, group) * transfer, 1 << 20, rng, members=group,
                    pg=_ep_pg(job, gi), received=got,
                    sent=np.full(len(group), job.rows, dtype=np.int64),
                    per_row=job.a2a_us_per_row)
    return gpu


def _backward(sim: _Sim, gpu: np.ndarray, stage: list[int],
              share: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """A backward with DDP's buckets all-reduced on the NCCL stream in the data-parallel groups
    of the ranks of `stage`. Returns (its compute's end, the end of its last all-reduce)."""
    job, ranks, rng, n = sim.job, sim.ranks, sim.rng, sim.job.ranks
    mine = set(stage)
    bwd = share * job.backward_us * sim.speed * (1 + job.jitter * rng.standard_normal(n))
    if job.cp_comm != "all_gather":     # attention's backward passes dK/dV around the ring first
        gpu = _ring_attention(sim, gpu, 0.1 * bwd / job.cp_size, _AUTOGRAD, mine)
    bstart = gpu
    ready = np.cumsum(sim.sizes)[:, None] * bwd[None, :] + bstart[None, :]        # [B, n]
    chunks = np.diff(np.concatenate([bstart[None, :], ready]), axis=0)
    comm = np.full(n, -np.inf)
    for b in range(job.buckets):
        for r in stage:
            # the autograd engine launches each backward kernel inside its function's op
            at = ranks[r].issue()
            ranks[r].x("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0",
                       at, 12.0, _CPU, _AUTOGRAD)
            ranks[r].kernel(f"volta_sgemm_bwd_{b}", at + 2.0, ready[b, r] - chunks[b, r],
                            chunks[b, r], _COMPUTE_STREAM, tid=_AUTOGRAD)
        sim.seq["dp"] += 1
        arrive = np.maximum(ready[b] + 5.0, comm)
        transfer = 150.0 + 900.0 * sim.sizes[b] * job.buckets / 2
        for gi, members in _in_stage(_dp_groups(job), mine):
            comm[members] = _collective(
                ranks, "all_reduce", "ncclDevKernel_AllReduce_RING_LL_Sum_float", sim.seq["dp"],
                arrive, transfer, int(sim.sizes[b] * (1 << 26)), rng, tid=_AUTOGRAD,
                members=members, pg=_dp_pg(job, gi),
                desc="default_pg" if _dp_pg(job, gi) == "0" else "data_parallel")
    return ready[-1], np.maximum(comm, ready[-1])


def _pipeline(sim: _Sim, gpu: np.ndarray) -> np.ndarray:
    """One step of a pipeline (GPipe: every microbatch's forward, then their backwards, the
    last one's with DDP's buckets): each stage receives a microbatch's activations (gradients)
    from the stage before (after) it, runs it and sends it on. A send ends its transfer after
    it was posted; the receive ends at the later of that and its own posting. No collective
    spans stages (the Kineto reader aligns clocks on collectives: keep a pipeline job on one
    clock, `ranks_per_host`). Returns the ranks' ends of their last all-reduce."""
    job, ranks, rng = sim.job, sim.ranks, sim.rng
    per, m = job.ranks // job.pp_size, job.microbatches
    stages = [list(range(s * per, (s + 1) * per)) for s in range(job.pp_size)]
    gpu, done = gpu.copy(), gpu.copy()
    sent: dict[tuple[int, int], float] = {}        # (microbatch, sending rank) → arrival
    for forward in (True, False):
        order = range(job.pp_size) if forward else range(job.pp_size - 1, -1, -1)
        for s in order:
            src = s - 1 if forward else s + 1
            dst = s + 1 if forward else s - 1
            for j in range(m):
                if 0 <= src < job.pp_size:
                    for r in stages[s]:
                        peer = r + (src - s) * per
                        end = max(gpu[r], sent[(j, peer)]) + 10.0
                        _p2p(sim, r, "recv", peer, gpu[r], end, forward)
                        gpu[r] = end
                if forward:
                    gpu = _forward(sim, gpu, stages[s], 1 / m)
                elif j < m - 1:
                    gpu[stages[s]] = _backward_piece(sim, gpu, stages[s], 1 / m)
                else:
                    ready, comm = _backward(sim, gpu, stages[s], 1 / m)
                    gpu[stages[s]], done[stages[s]] = ready[stages[s]], comm[stages[s]]
                if 0 <= dst < job.pp_size:
                    for r in stages[s]:
                        end = gpu[r] + 40.0 + 20.0 * rng.random()
                        _p2p(sim, r, "send", r + (dst - s) * per, gpu[r], end, forward)
                        sent[(j, r)], gpu[r] = end, end
    return done


def _backward_piece(sim: _Sim, gpu: np.ndarray, stage: list[int], share: float) -> np.ndarray:
    """A microbatch's backward without gradient all-reduces (they follow the last one's)."""
    job = sim.job
    bwd = share * job.backward_us * sim.speed * (1 + job.jitter * sim.rng.standard_normal(
        job.ranks))
    if job.cp_comm != "all_gather":     # every microbatch's attention passes dK/dV on first
        gpu = _ring_attention(sim, gpu, 0.1 * bwd / job.cp_size, _AUTOGRAD, set(stage))
    for r in stage:
        at = sim.ranks[r].issue()
        sim.ranks[r].x("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", at,
                       12.0, _CPU, _AUTOGRAD)
        sim.ranks[r].kernel("volta_sgemm_bwd", at + 2.0, gpu[r], bwd[r], _COMPUTE_STREAM,
                            tid=_AUTOGRAD)
    return gpu[stage] + bwd[stage]


def _p2p(sim: _Sim, rank: int, kind: str, peer: int, start: float, end: float,
         forward: bool) -> None:
    """A pipeline send or receive between neighbouring stages, as the profiler records it."""
    job = sim.job
    sim.seq["pp"] += 1
    per = job.ranks // job.pp_size
    args: JsonObject = {"Collective name": kind, "Process Group Name": _pp_pg(job, rank % per),
                        "Process Group Description": "pipeline_model_parallel",
                        "Process Group Ranks": str(_pp_groups(job)[rank % per]),
                        "Group size": job.pp_size, "In msg nelems": 1 << 18,
                        "Out msg nelems": 1 << 18, "dtype": "BFloat16",
                        ("Dst Rank" if kind == "send" else "Src Rank"): peer}
    rk = sim.ranks[rank]
    tid = _MAIN if forward else _AUTOGRAD
    at = rk.issue()
    rk.x("cpu_op", "record_param_comms", at, 6.0, _CPU, tid, args)
    rk.kernel("ncclDevKernel_SendRecv", at + 1.0, start, end - start, _NCCL_STREAM, tid=tid,
              args=args)


def _in_stage(groups: list[list[int]], stage: set[int]) -> list[tuple[int, list[int]]]:
    """(index among all groups, members) of the groups whose ranks are in `stage`."""
    return [(gi, g) for gi, g in enumerate(groups) if g[0] in stage]


def _ring_attention(sim: _Sim, gpu: np.ndarray, chunk: np.ndarray, tid: int,
                    stage: set[int]) -> np.ndarray:
    """Context parallelism's exchange in the CP groups of `stage`, cp - 1 rounds of a chunk of
    attention then K/V (or dK/dV) passed on: as ring attention (sent to the next CP rank,
    received from the one before; each transfer ends when the later of its pair arrived plus
    its time) or as torch's all-to-all rotation (one exchange of equal splits). Returns the
    ranks' ends."""
    job, ranks, rng = sim.job, sim.ranks, sim.rng
    gpu = gpu.copy()
    groups = _in_stage(_cp_groups(job), stage)
    for _ in range(job.cp_size - 1):
        sim.seq["cp"] += 1
        for r in sorted(stage):
            at = ranks[r].issue()
            if tid == _AUTOGRAD:    # launched inside its autograd function's op, as profiled
                ranks[r].x("cpu_op", "autograd::engine::evaluate_function: "
                           "ScaledDotProductFlashAttentionBackward0", at, 12.0, _CPU, _AUTOGRAD)
                at += 2.0
            ranks[r].kernel("flash_fwd_kernel" if tid == _MAIN else "flash_bwd_kernel",
                            at, gpu[r], chunk[r], _COMPUTE_STREAM, tid=tid)
            gpu[r] += chunk[r]
        if job.cp_comm == "all_to_all":
            rows = np.full(job.cp_size, 1024, dtype=np.int64)
            for gi, members in groups:
                gpu[members] = _collective(
                    ranks, "all_to_all", "ncclDevKernel_SendRecv", sim.seq["cp"], gpu,
                    40.0 + 20.0 * rng.random(), 1 << 19, rng, tid=tid, members=members,
                    pg=_cp_pg(job, gi), desc="context_parallel", received=rows, sent=rows)
            continue
        done = gpu.copy()
        for _, members in groups:
            for i, src in enumerate(members):
                dst = members[(i + 1) % len(members)]
                end = max(gpu[src], gpu[dst]) + (30.0 + 20.0 * rng.random())
                done[src], done[dst] = max(done[src], end), max(done[dst], end)
        for gi, members in groups:
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
    return gpu


def _slow_link(job: GpuJob, members: list[int]) -> float:
    """The transfer factor of a group's collectives (every member waits for its slowest link)."""
    link = job.slow_link
    return link[1] if link is not None and link[0] in members else 1.0


def _ep_pg(job: GpuJob, i: int) -> str:
    return str(i + 1) if _ep_count(job) > 1 else "0"


def _ep_count(job: GpuJob) -> int:
    """Expert-parallel groups in all (expert_groups in each pipeline stage)."""
    return job.expert_groups * job.pp_size


def _ep_groups(job: GpuJob) -> list[list[int]]:
    """Expert-parallel groups: each stage's ranks split into expert_groups blocks."""
    per = job.ranks // job.pp_size
    return [[int(r) for r in m] for s in range(job.pp_size)
            for m in np.array_split(np.arange(s * per, (s + 1) * per), job.expert_groups)]


def _routed(job: GpuJob, members: list[int], rng) -> np.ndarray:
    """Rows each member receives at one dispatch: the group's rows drawn over its ranks."""
    weight = np.ones(len(members))
    if job.hot_expert is not None and job.hot_expert[0] in members:
        weight[members.index(job.hot_expert[0])] = job.hot_expert[1]
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
    """Data-parallel groups: the ranks of a stage with one tensor- and context-parallel index."""
    block, per = job.tp_size * job.cp_size, job.ranks // job.pp_size
    return [list(range(s * per + i, (s + 1) * per, block)) for s in range(job.pp_size)
            for i in range(block)]


def _pp_groups(job: GpuJob) -> list[list[int]]:
    """Pipeline groups: the ranks of one place in every stage (Megatron order: pp slowest)."""
    per = job.ranks // job.pp_size
    return [[i + s * per for s in range(job.pp_size)] for i in range(per)]


def _tp_pg(job: GpuJob, i: int) -> str:
    return str(1 + _ep_count(job) + i)


def _cp_pg(job: GpuJob, i: int) -> str:
    return str(1 + _ep_count(job) + job.ranks // job.tp_size + i)


def _dp_pg(job: GpuJob, i: int) -> str:
    if job.tp_size * job.cp_size * job.pp_size == 1:
        return "0"
    return str(1 + _ep_count(job) + job.ranks // job.tp_size + job.ranks // job.cp_size + i)


def _pp_pg(job: GpuJob, i: int) -> str:
    return str(1 + _ep_count(job) + 3 * job.ranks + i)


def _groups(job: GpuJob) -> list[GroupJson]:
    """distributedInfo.pg_config: the world, the EP, TP and DP groups, as torch writes it."""
    out: list[GroupJson] = [{"pg_name": "0", "pg_desc": "default_pg", "pg_size": job.ranks,
            "ranks": list(range(job.ranks))}]
    if _ep_count(job) > 1 and job.all_to_alls:
        # no all-to-alls, no expert parallelism: a pipeline's per-stage "expert groups" held
        # its data-parallel groups' ranks
        out += [{"pg_name": _ep_pg(job, i), "pg_desc": "ep_group", "pg_size": len(m),
                 "ranks": m} for i, m in enumerate(_ep_groups(job))]
    out += [{"pg_name": _tp_pg(job, i), "pg_desc": "tensor_model_parallel",
             "pg_size": len(m), "ranks": m} for i, m in enumerate(_tp_groups(job))]
    out += [{"pg_name": _cp_pg(job, i), "pg_desc": "context_parallel",
             "pg_size": len(m), "ranks": m} for i, m in enumerate(_cp_groups(job))]
    if _dp_pg(job, 0) != "0":
        out += [{"pg_name": _dp_pg(job, i), "pg_desc": "data_parallel", "pg_size": len(m),
                 "ranks": m} for i, m in enumerate(_dp_groups(job))]
    if job.pp_size > 1:
        out += [{"pg_name": _pp_pg(job, i), "pg_desc": "pipeline_model_parallel",
                 "pg_size": job.pp_size, "ranks": m} for i, m in enumerate(_pp_groups(job))]
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
