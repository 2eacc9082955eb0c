"""Agreeing on who is late: a tiny per-step exchange of time-in-collective, or arrival order
through the c10d store (eager mode)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from stragglers.collectives.devices import control_device


class TimeExchange:
    """Shares each rank's time inside the last collective with a tiny asynchronous all_reduce.

    Posted right after the collective (all ranks are in step then, so it costs one small
    message round) and collected at the next call, so nobody waits on it. The vector lives on
    the backend's device (CUDA for NCCL), so it is legal on every backend.
    """

    def __init__(self, group=None, device: torch.device | None = None):
        self.group = group
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.device = device if device is not None else control_device(group)
        self._pending: tuple[dist.Work, torch.Tensor, int] | None = None

    def post(self, seconds_inside: float, tag: int = 0) -> None:
        """Start sharing this rank's time inside the collective that just finished; `tag` (the
        hook's bucket index) comes back with the times from `collect_tagged`."""
        vec = torch.zeros(self.n, dtype=torch.float64, device=self.device)
        vec[self.rank] = seconds_inside  # the other slots are 0, so the sum is exact
        self._pending = (dist.all_reduce(vec, group=self.group, async_op=True), vec, tag)

    def collect(self) -> list[float] | None:
        """The per-rank times from the last post (identical on every rank), or None."""
        got = self.collect_tagged()
        return None if got is None else got[0]

    def collect_tagged(self) -> tuple[list[float], int] | None:
        """(per-rank times, the tag given to `post`) of the last post, or None."""
        if self._pending is None:
            return None
        work, vec, tag = self._pending
        work.wait()
        self._pending = None
        return vec.tolist(), tag  # .tolist() waits for the GPU: only the tiny all_reduce


class StoreArrivalOrder:
    """Eager mode: ranks count their arrival in the c10d store; the rank missing from the first
    n-1 arrivals is this call's straggler. The ready ranks learn it as soon as n-1 have arrived,
    which is exactly when phase 1 can start anyway. Store traffic is TCP, not a collective, so
    it is the same on every backend."""

    _instances = 0  # every rank creates its instances in the same order, so this names them alike

    def __init__(self, store=None, group=None, prefix: str = "stragglers/arrival"):
        if store is None:
            store = dist.distributed_c10d._get_default_store()
        self.store = store
        self.n = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        StoreArrivalOrder._instances += 1
        self.prefix = f"{prefix}/{StoreArrivalOrder._instances}"
        self._call = 0

    def last_arrival(self) -> int:
        """Register this rank's arrival and return the rank that arrives last in this call."""
        call, self._call = self._call, self._call + 1
        key = f"{self.prefix}/{call}"
        order = self.store.add(f"{key}/count", 1)
        self.store.set(f"{key}/{order}", str(self.rank))
        if order == self.n:
            last = self.rank
        else:
            keys = [f"{key}/{i}" for i in range(1, self.n)]
            self.store.wait(keys)
            arrived = {int(v) for v in self.store.multi_get(keys)}
            last = next(r for r in range(self.n) if r not in arrived)
        if self.rank == 0 and call >= 2:
            # every rank has read call-2's keys: it has since entered call-1's collective
            old = f"{self.prefix}/{call - 2}"
            for i in range(1, self.n + 1):
                self.store.delete_key(f"{old}/{i}")
            self.store.delete_key(f"{old}/count")
        return last
