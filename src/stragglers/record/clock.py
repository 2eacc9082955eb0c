"""Put all ranks on rank 0's clock: NTP-style ping-pong offset measurement over torch.distributed.

Control traffic (the ping-pong, the common origin) never goes through NCCL with CPU tensors:
`control_channel` picks a gloo group (the job's own when its backend has gloo, else a gloo side
group created once per process) or, for a non-gloo subgroup, the backend's device with an
explicit synchronise so host times are read after the data has really arrived.
"""

from __future__ import annotations

import pickle
import socket
import time
from dataclasses import dataclass
from typing import NotRequired, TypedDict

import torch
import torch.distributed as dist

_SIDE_GROUPS: dict[int | None, dist.ProcessGroup] = {}  # (id of the group, None for the world) → gloo side group, made once


@dataclass
class ClockEstimate:
    """Offset of this rank's clock against rank 0 (add it to local times), with its error bound."""

    offset_ns: int
    error_ns: int
    rtt_ns: int
    rounds: int

    def to_dict(self) -> ClockEstimateJson:
        """A JSON-serialisable dict."""
        return ClockEstimateJson(offset_ns=self.offset_ns, error_ns=self.error_ns,
                                 rtt_ns=self.rtt_ns, rounds=self.rounds)


class ClockEstimateJson(TypedDict):
    """A ClockEstimate in meta.extra["clock"] (its fields, in order)."""

    offset_ns: int
    error_ns: int
    rtt_ns: int
    rounds: int


class ClockRecord(TypedDict):
    """meta.extra["clock"]; the `end` keys once the end was measured (Recorder.close)."""

    start: list[ClockEstimateJson]
    max_error_start_s: float
    end: NotRequired[list[ClockEstimateJson]]
    max_error_end_s: NotRequired[float]
    max_drift_s: NotRequired[float]


def clock_record(start: list[ClockEstimate], end: list[ClockEstimate]) -> ClockRecord:
    """meta.extra["clock"]: every rank's estimate at start (and at end, once measured), the
    largest error of each, and the largest change of a rank's offset between them (drift)."""
    out = ClockRecord(start=[e.to_dict() for e in start],
                      max_error_start_s=max(e.error_ns for e in start) / 1e9)
    if end:
        out.update({"end": [e.to_dict() for e in end],
                    "max_error_end_s": max(e.error_ns for e in end) / 1e9,
                    "max_drift_s": max(abs(a.offset_ns - b.offset_ns)
                                       for a, b in zip(start, end)) / 1e9})
    return out


@dataclass(frozen=True)
class ControlChannel:
    """Where control tensors go: a process group and the device its backend accepts."""

    group: dist.ProcessGroup | None
    device: torch.device

    def tensor(self, value: int) -> torch.Tensor:
        """A one-element int64 control tensor on the channel's device."""
        return torch.tensor([value], dtype=torch.int64, device=self.device)

    def settle(self) -> None:
        """Wait until device-side traffic is done, so the host clock may be read (GPU only)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def read(self, t: torch.Tensor) -> int:
        """A control tensor's value on the host (synchronises on GPU)."""
        return int(t.item())


def control_channel(group: dist.ProcessGroup | None = None) -> ControlChannel:
    """The group and device for the recorder's control traffic (a collective the first time).

    A backend that includes gloo takes CPU tensors. For the world group on any other backend
    (NCCL), a gloo side group is created once per process — `dist.new_group` is collective over
    the world, so every rank must reach this in the same order, as `Recorder.start()` does. A
    non-gloo subgroup gets tensors on the current CUDA device.
    """
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend:
        return ControlChannel(group, torch.device("cpu"))
    if group is None:
        side = _SIDE_GROUPS.get(None)
        if side is None:
            side = _SIDE_GROUPS[None] = dist.new_group(backend="gloo")
        return ControlChannel(side, torch.device("cpu"))
    if not torch.cuda.is_available():
        raise RuntimeError(f"process group backend {backend!r} without gloo needs CUDA for "
                           "control tensors, and CUDA is not available")
    return ControlChannel(group, torch.device("cuda", torch.cuda.current_device()))


def release_control_channel(channel: ControlChannel) -> None:
    """Destroy the gloo side group behind `channel`, if control_channel created one.

    Called by Recorder.close() after its last control collective, so that the side group's
    worker threads are joined before the caller destroys the job's process group (a gloo
    thread still alive at interpreter exit can abort the process).
    """
    for key, side in list(_SIDE_GROUPS.items()):
        if side is channel.group:
            del _SIDE_GROUPS[key]
            dist.destroy_process_group(side)


def measure_offset(rounds: int = 8, group=None, channel: ControlChannel | None = None
                   ) -> ClockEstimate:
    """Measure every rank's offset to rank 0 (a collective: all ranks of the group must call it).

    Rank r sends its time t0 to rank 0, rank 0 answers with its time t1, rank r reads t2 on
    arrival: offset = t1 - (t0 + t2) / 2, error <= (t2 - t0) / 2. The round with the smallest
    round trip wins (the least queueing, so the tightest bound). On a device channel every
    host time is read after a synchronise, so t0 < t1 < t2 holds and the bound stays valid.
    """
    ch = channel or control_channel(group)
    group = ch.group
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    buf = ch.tensor(0)
    if world == 1:
        return ClockEstimate(0, 0, 0, 0)
    if rank == 0:
        for peer in range(1, world):
            peer_global = dist.get_global_rank(group, peer) if group is not None else peer
            for _ in range(rounds):
                dist.recv(buf, src=peer_global, group=group)
                ch.settle()
                buf.fill_(time.perf_counter_ns())
                dist.send(buf, dst=peer_global, group=group)
        ch.settle()
        return ClockEstimate(0, 0, 0, rounds)
    root = dist.get_global_rank(group, 0) if group is not None else 0
    best: tuple[int, int] | None = None  # (rtt, offset)
    for _ in range(rounds):
        ch.settle()
        t0 = time.perf_counter_ns()
        buf.fill_(t0)
        dist.send(buf, dst=root, group=group)
        dist.recv(buf, src=root, group=group)
        t1 = ch.read(buf)  # synchronises on a device channel
        t2 = time.perf_counter_ns()
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


def common_origin_ns(offset_ns: int, group=None, channel: ControlChannel | None = None) -> int:
    """Rank 0's current time, broadcast: the zero of every rank's trace timestamps."""
    ch = channel or control_channel(group)
    t = ch.tensor(time.perf_counter_ns() + offset_ns)
    root = dist.get_global_rank(ch.group, 0) if ch.group is not None else 0
    dist.broadcast(t, src=root, group=ch.group)
    return ch.read(t)


def gather_objects(obj, channel: ControlChannel) -> list:
    """Every rank's `obj`, in group rank order (dist.all_gather_object by point-to-point).

    Recorder.close() ends with this gather, often the script's last collective. A gloo
    collective runs on the process group's worker thread, which drops its reference to the
    tensors after the caller's wait() has returned, and dropping it needs the GIL (torch then
    releases the tensor's Python object): when the script has reached interpreter shutdown by
    then, that thread is killed mid-C++ frame and the finished process aborts (SIGABRT,
    "terminate called without an active exception"). Sends and receives run on the calling
    thread: rank 0 receives every rank's bytes and sends the whole list back.
    """
    group = channel.group
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return [obj]

    def peer(r: int) -> int:
        return dist.get_global_rank(group, r) if group is not None else r

    if rank == 0:
        parts = [pickle.dumps(obj)] + [_recv_bytes(channel, peer(r)) for r in range(1, world)]
        blob = pickle.dumps(parts)
        for r in range(1, world):
            _send_bytes(channel, blob, peer(r))
    else:
        _send_bytes(channel, pickle.dumps(obj), peer(0))
        parts = pickle.loads(_recv_bytes(channel, peer(0)))
    return [pickle.loads(p) for p in parts]


def _send_bytes(channel: ControlChannel, data: bytes, dst: int) -> None:
    """Send a length, then the bytes."""
    dist.send(channel.tensor(len(data)), dst=dst, group=channel.group)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(channel.device)
    dist.send(payload, dst=dst, group=channel.group)
    channel.settle()


def _recv_bytes(channel: ControlChannel, src: int) -> bytes:
    """Receive what _send_bytes sent."""
    size = channel.tensor(0)
    dist.recv(size, src=src, group=channel.group)
    payload = torch.empty(channel.read(size), dtype=torch.uint8, device=channel.device)
    dist.recv(payload, src=src, group=channel.group)
    channel.settle()
    return payload.cpu().numpy().tobytes()
