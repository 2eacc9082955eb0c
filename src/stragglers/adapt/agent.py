"""Agent: one per worker; ships step records to the Monitor and fetches actions on a thread.

The training loop never waits for the controller: it hands records to `record()` and asks
`plan(step)` for the batch size in force, both non-blocking.
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass

from stragglers.adapt.client import ShardClient
from stragglers.adapt.controller import ADJUST_BS, KILL_RESTART, Action
from stragglers.adapt.policies import micro_batches, split_batch
from stragglers.errors import InputError

EXIT_RESTART = 75  # exit code of a worker stopped by KILL_RESTART (torchrun then re-forms the group)
MAX_PENDING_RECORDS = 1_000


@dataclass
class StepPlan:
    """What this rank does at one step."""

    batch_size: int
    micro_batches: list[int]
    kill_target: int | None  # rank that KILL_RESTART stops at this step, if any
    reason: str = ""


@dataclass(frozen=True)
class Applied:
    """An action this agent applied, and the step it was applied at."""

    action: Action
    step: int


class Agent:
    """Applies controller actions asynchronously for one rank."""

    def __init__(self, client: ShardClient, rank: int, world_size: int, global_batch: int,
                 memory_cap: int | None = None, incarnation: int = 0, device: str = "",
                 poll_s: float = 0.2):
        self.client, self.rank, self.incarnation, self.device = client, rank, incarnation, device
        self.batch_sizes = split_batch(global_batch, [1.0] * world_size)
        self.memory_cap = memory_cap
        self.poll_s = poll_s
        self.applied: list[Applied] = []
        self.late = 0  # actions that arrived after their effective step (applied at once)
        self._records: list[tuple[int, float, int]] = []
        self._pending: list[Action] = []
        self._seen = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"agent-{rank}", daemon=True)
        self._thread.start()

    def record(self, step: int, bpt: float, batch: int) -> None:
        """Queue one step's compute time (seconds, excluding the AllReduce wait) for the Monitor."""
        if not (math.isfinite(bpt) and bpt > 0):
            return  # nothing the Monitor could use (it ignores such steps too)
        with self._lock:
            self._records.append((step, bpt, batch))

    def plan(self, step: int) -> StepPlan:
        """The batch size in force at `step`, after applying every action due by then."""
        kill, reason = None, ""
        with self._lock:
            due = [a for a in self._pending if a.effective_step <= step]
            self._pending = [a for a in self._pending if a.effective_step > step]
        for a in due:
            if a.effective_step < step:
                self.late += 1
            if a.kind == ADJUST_BS:
                self.batch_sizes = list(a.batch_sizes)
                self.memory_cap = a.memory_cap
            elif a.kind == KILL_RESTART:
                kill = a.target
            reason = a.reason
            self.applied.append(Applied(a, step))
        b = self.batch_sizes[self.rank]
        return StepPlan(b, micro_batches(b, self.memory_cap), kill, reason)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._exchange()
        self._exchange()

    def _exchange(self) -> None:
        with self._lock:
            records, self._records = self._records, []
        try:
            # One round trip per poll: the report's reply carries the new actions.
            reply = self.client.report_steps(self.rank, records, self.device, self.incarnation,
                                             since=self._seen)
        except InputError as exc:
            warnings.warn(f"agent {self.rank}: the control plane refused {len(records)} step"
                          f" records ({exc}); dropped", stacklevel=1)
            return
        except Exception as exc:  # noqa: BLE001 - the agent must never kill training
            warnings.warn(f"agent {self.rank}: control plane unreachable ({exc}); keeping the"
                          " current plan", stacklevel=1)
            with self._lock:
                # Keep only recent records: the Monitor's windows need no more, and a report
                # stays within the service's bound on records per request.
                self._records = (records + self._records)[-MAX_PENDING_RECORDS:]
            return
        if reply.incarnation != self.incarnation:
            return
        new = [a for a in reply.actions if a.seq >= self._seen]
        if new:
            # (by seq, not by count: the controller keeps only its newest ADJUST_BS actions)
            self._seen = new[-1].seq + 1
        with self._lock:
            self._pending.extend(new)

    def close(self) -> None:
        """Flush the last records and stop the thread."""
        self._stop.set()
        self._thread.join(timeout=5)
