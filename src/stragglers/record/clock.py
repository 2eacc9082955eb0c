"""Put all ranks on rank 0's clock: NTP-style ping-pong offset measurement over torch.distributed."""

from __future__ import annotations

import socket
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist


@dataclass
class ClockEstimate:
    """Offset of this rank's clock against rank 0 (add it to local times), with its error bound."""

    offset_ns: int
    error_ns: int
    rtt_ns: int
    rounds: int

    def to_dict(self) -> dict:
        """A JSON-serialisable dict."""
        return asdict(self)


def measure_offset(rounds: int = 8, group=None) -> ClockEstimate:
    """Measure every rank's offset to rank 0 (a collective: all ranks of the group must call it).

    Rank r sends its time t0 to rank 0, rank 0 answers with its time t1, rank r reads t2 on
    arrival: offset = t1 - (t0 + t2) / 2, error <= (t2 - t0) / 2. The round with the smallest
    round trip wins (the least queueing, so the tightest bound).
    """
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    buf = torch.zeros(1, dtype=torch.int64)
    if world == 1:
        return ClockEstimate(0, 0, 0, 0)
    if rank == 0:
        for peer in range(1, world):
            peer_global = dist.get_global_rank(group, peer) if group is not None else peer
            for _ in range(rounds):
                dist.recv(buf, src=peer_global, group=group)
                buf[0] = time.perf_counter_ns()
                dist.send(buf, dst=peer_global, group=group)
        return ClockEstimate(0, 0, 0, rounds)
    root = dist.get_global_rank(group, 0) if group is not None else 0
    best: tuple[int, int] | None = None  # (rtt, offset)
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        buf[0] = t0
        dist.send(buf, dst=root, group=group)
        dist.recv(buf, src=root, group=group)
        t2 = time.perf_counter_ns()
        t1 = int(buf[0].item())
        rtt = t2 - t0
        if best is None or rtt < best[0]:
            best = (rtt, t1 - (t0 + t2) // 2)
    assert best is not None
    return ClockEstimate(offset_ns=best[1], error_ns=best[0] // 2, rtt_ns=best[0], rounds=rounds)


def same_host_as_rank0(group=None) -> bool:
    """Whether this rank runs on rank 0's host (then both read the same monotonic clock)."""
    names: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, socket.gethostname(), group=group)
    return names[dist.get_rank(group)] == names[0]


def common_origin_ns(offset_ns: int, group=None) -> int:
    """Rank 0's current time, broadcast: the zero of every rank's trace timestamps."""
    t = torch.tensor([time.perf_counter_ns() + offset_ns], dtype=torch.int64)
    dist.broadcast(t, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return int(t.item())
