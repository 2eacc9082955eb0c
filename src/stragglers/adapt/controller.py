"""Controller: turns Monitor windows into ADJUST_BS / KILL_RESTART actions (AntDT-DD and -ND)."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from stragglers.adapt.monitor import DETERMINISTIC, NONE, TRANSIENT, SpeedMonitor, WorkerClass, \
    records_kept
from stragglers.adapt.policies import restart_gain, split_batch
from stragglers.config import Config, setting
from stragglers.errors import InputError
from stragglers.protocols import CONTROLLER_POLICIES

ActionKind = Literal["ADJUST_BS", "KILL_RESTART"]
ADJUST_BS: ActionKind = "ADJUST_BS"
KILL_RESTART: ActionKind = "KILL_RESTART"
MAX_WORLD = 1 << 16
MAX_BATCH = 1 << 24


@dataclass(frozen=True)
class ControlConfig(Config):
    """What the controller needs to know about the job; posted by rank 0 at start."""

    policy: str = setting("bsp", "controller policy (a name in CONTROLLER_POLICIES: bsp, dd, nd)")
    world_size: int = setting(1, "ranks in the job", minimum=1, maximum=MAX_WORLD)
    global_batch: int = setting(1, "samples per global step B (>= world_size)", minimum=1,
                                maximum=MAX_BATCH)
    memory_cap: int | None = setting(None, "samples per micro-batch M (null: no cap)")
    total_steps: int = setting(0, "steps the job will run (for the restart gain)", minimum=0,
                               maximum=1 << 40)
    restart_cost_s: float = setting(10.0, "predicted seconds one KILL_RESTART costs",
                                    minimum=0.0, maximum=1e7)
    max_restarts: int = setting(1, "KILL_RESTART actions allowed", minimum=0, maximum=1000)
    window: int = setting(5, "monitor window W in steps", minimum=1, maximum=10_000)
    theta: float = setting(1.3, "straggler threshold on r_i", minimum=1.0, maximum=100.0)
    persistent_windows: int = setting(3, "flagged windows in a row that make a straggler"
                                      " persistent", minimum=1, maximum=10_000)
    min_change: float = setting(0.05, "re-plan only when some b_i moves by more than this x B/n",
                                minimum=0.0, maximum=1.0)
    lag_s: float = setting(1.0, "how far ahead an action takes effect, so every agent has seen"
                           " it", minimum=0.0, maximum=3600.0)
    incarnation: int = setting(0, "torchrun restart count of the job", minimum=0,
                               maximum=1 << 31)
    start_step: int | None = setting(None, "the step the job starts or resumes at (its"
                                     " checkpoint's): its first records' steps are bounded from"
                                     " it (null: the step a previous incarnation reached, else"
                                     " 0; or total_steps)", minimum=0, maximum=1 << 40)

    def __post_init__(self) -> None:
        super().__post_init__()
        CONTROLLER_POLICIES.get(self.policy, field="policy")
        if self.memory_cap is not None and (isinstance(self.memory_cap, bool) or not isinstance(
                self.memory_cap, int) or not 1 <= self.memory_cap <= MAX_BATCH):
            raise InputError("ControlConfig", "memory_cap",
                             f"expected null or 1..{MAX_BATCH}, got {self.memory_cap!r:.40}")
        if self.global_batch < self.world_size:
            raise InputError("ControlConfig", "global_batch",
                             f"expected >= world_size ({self.world_size}), got {self.global_batch}")

    def validate(self) -> None:
        """Kept for callers of the old API: validation now happens at construction."""


# ADJUST_BS actions a controller keeps (the newest; every KILL_RESTART is kept)
MAX_KEPT_ADJUSTS = 16


class Action(msgspec.Struct, frozen=True):
    """One controller decision; every agent sees every action and applies it at `effective_step`."""

    seq: int
    kind: ActionKind
    effective_step: int
    batch_sizes: list[int] = []
    memory_cap: int | None = None
    target: int | None = None
    reason: str = ""


class Actions(msgspec.Struct, frozen=True):
    """The reply of a report or GET .../actions: the job's incarnation and actions >= since."""

    incarnation: int
    actions: list[Action]


class ControllerView(msgspec.Struct, frozen=True):
    """What the controller knows (GET .../control/state, the job's final report)."""

    config: dict[str, Any]              # ControlConfig.to_dict()
    batch_sizes: list[int]
    classes: dict[str, WorkerClass]     # by rank (JSON object keys are strings)
    actions: list[Action]
    kills: int


@dataclass(frozen=True)
class AdjustBatches:
    """A policy's proposal: these per-rank batch sizes (summing to B)."""

    batch_sizes: list[int]
    reason: str


@dataclass(frozen=True)
class KillRestart:
    """A policy's proposal: restart the job without rank `target`'s slow node."""

    target: int
    reason: str


Proposal = AdjustBatches | KillRestart


@dataclass(frozen=True)
class ControllerState:
    """What a policy decides on: the job, the monitor, the window's classes, the split in force."""

    config: ControlConfig
    monitor: SpeedMonitor
    classes: dict[int, WorkerClass]
    batch_sizes: list[int]
    kills: int


class Controller:
    """Runs the configured policy (from CONTROLLER_POLICIES) on each closed Monitor window."""

    def __init__(self, config: ControlConfig, resumed_from: int = 0):
        """`resumed_from`: the step a previous incarnation of the job reached (its first
        records are bounded from it when the config gives no start_step)."""
        self.config = config
        self.policy = CONTROLLER_POLICIES.get(config.policy, field="policy")()
        start = config.start_step if config.start_step is not None else resumed_from
        self.monitor = SpeedMonitor(config.world_size, config.window, config.theta,
                                    config.persistent_windows, start_step=start,
                                    keep=records_kept(config.window))
        self.batch_sizes = split_batch(config.global_batch, [1.0] * config.world_size)
        # the most samples a step each rank has been handed (any split of this incarnation):
        # a record of more is refused (a rank claiming 10^6, or its whole global batch, made
        # its healthy peers stragglers, and ND killed one and gave it no samples)
        self.most = list(self.batch_sizes)
        # the actions kept (every KILL_RESTART, the last MAX_KEPT_ADJUSTS ADJUST_BS: each
        # carries the whole split, superseding those before it) and how many were decided
        self.actions: list[Action] = []
        self.decided = 0
        self.kills = 0
        self.last_classes: dict[int, WorkerClass] = {}

    def observe(self, rank: int, step: int, bpt: float, batch: int, device: str = "") -> list[Action]:
        """Feed one step record; returns the actions decided because a window closed."""
        self.monitor.record(rank, step, bpt, batch, device)
        if not self.monitor.window_ready():
            return []
        self.last_classes = self.monitor.evaluate()
        new = []
        for proposal in self.policy.decide(self._view()):
            action = self._action(proposal)
            if action is not None:
                new.append(action)
                self._keep(action)
        return new

    def _keep(self, action: Action) -> None:
        """Keep `action`, dropping the oldest ADJUST_BS past MAX_KEPT_ADJUSTS: kept all, a
        job reporting noisy times with min_change 0 grew its list (and every reply asking
        since 0) without bound, each action a list of world_size ints."""
        self.actions.append(action)
        self.decided += 1
        adjusts = [a for a in self.actions if a.kind == ADJUST_BS]
        if len(adjusts) > MAX_KEPT_ADJUSTS:
            self.actions.remove(adjusts[0])

    def _view(self) -> ControllerState:
        return ControllerState(self.config, self.monitor, self.last_classes,
                               list(self.batch_sizes), self.kills)

    def _lag_steps(self) -> int:
        step_times = [r.bpt for w in self.monitor.workers.values() for r in list(w.records)[-3:]]
        step_time = max(statistics.median(step_times), 1e-3) if step_times else 0.1
        return max(2, math.ceil(self.config.lag_s / step_time))

    def _action(self, proposal: Proposal) -> Action | None:
        """Number a policy's proposal and schedule it; a negligible batch change is dropped."""
        cfg = self.config
        effective = self.monitor.latest_step + self._lag_steps()
        if isinstance(proposal, KillRestart):
            self.kills += 1
            return Action(self.decided, KILL_RESTART, effective, [], None,
                          proposal.target, proposal.reason)
        sizes = proposal.batch_sizes
        moved = max(abs(a - b) for a, b in zip(sizes, self.batch_sizes))
        if moved <= cfg.min_change * cfg.global_batch / cfg.world_size:
            return None
        self.batch_sizes = list(sizes)
        self.most = [max(a, b) for a, b in zip(self.most, sizes)]
        return Action(self.decided, ADJUST_BS, effective, list(sizes), cfg.memory_cap, None,
                      proposal.reason)

    def state(self) -> ControllerView:
        """What the controller knows, for status pages and the job's final report."""
        return ControllerView(self.config.to_dict(), list(self.batch_sizes),
                              {str(k): v for k, v in self.last_classes.items()},
                              list(self.actions), self.kills)

    def actions_since(self, since: int) -> Actions:
        """Every kept action with seq >= since, under this controller's incarnation."""
        return Actions(self.config.incarnation, [a for a in self.actions if a.seq >= since])


@CONTROLLER_POLICIES.register("bsp")
class StaticPolicy:
    """The baseline (BSP with equal batches): observes, never acts."""

    name = "bsp"

    def decide(self, state: ControllerState) -> list[Proposal]:
        """No actions."""
        return []


@CONTROLLER_POLICIES.register("dd")
class DedicatedPolicy:
    """AntDT-DD: per-worker batches b_i = v_i (T* - c_i) from fitted throughput and overhead."""

    name = "dd"

    def decide(self, state: ControllerState) -> list[Proposal]:
        """One ADJUST_BS to the split of measured speeds (the controller drops a negligible one)."""
        cfg, monitor = state.config, state.monitor
        fits = [monitor.throughput_and_overhead(r) for r in range(cfg.world_size)]
        v, c = [f[0] for f in fits], [f[1] for f in fits]
        if any(not math.isfinite(x) for x in v):
            return []
        return [AdjustBatches(split_batch(cfg.global_batch, v, c),
                              f"DD: throughputs {[round(x, 1) for x in v]} samples/s")]


@CONTROLLER_POLICIES.register("nd")
class NonDedicatedPolicy:
    """AntDT-ND: ADJUST_BS away from a flagged straggler; KILL_RESTART a persistent one if it pays.

    A deterministic straggler (slow because its device type is slower, see Monitor) is never
    restarted: a relaunch lands on the same kind of device, so that case gets DD's split.
    """

    name = "nd"

    def decide(self, state: ControllerState) -> list[Proposal]:
        """At most one action per window."""
        cfg, classes = state.config, state.classes
        flagged = [r for r, info in classes.items() if info.category != NONE]
        times = [info.per_sample_time for info in classes.values()]
        known = [t for t in times if t is not None]
        if not known:
            return []
        median_t = statistics.median(known)
        equal_b = cfg.global_batch / cfg.world_size
        remaining = max(0, cfg.total_steps - state.monitor.latest_step)
        for r in flagged:
            info = classes[r]
            if info.category in (TRANSIENT, DETERMINISTIC) or state.kills >= cfg.max_restarts \
                    or info.per_sample_time is None:
                continue
            gain = restart_gain(info.per_sample_time * equal_b, median_t * equal_b, remaining)
            if gain > cfg.restart_cost_s:
                return [KillRestart(r, f"ND: rank {r} {info.category} (r={info.ratio:.2f} for"
                                       f" {info.windows} windows); gain {gain:.1f}s >"
                                       f" restart cost {cfg.restart_cost_s:.1f}s")]
        if any(classes[r].category == DETERMINISTIC for r in flagged):
            return DedicatedPolicy().decide(state)
        if flagged:
            v = [1.0 / t if t is not None and t > 0 else 0.0 for t in times]
            return [AdjustBatches(split_batch(cfg.global_batch, v),
                                  f"ND: stragglers {flagged}, b_i proportional to 1/BPT_i")]
        return [AdjustBatches(split_batch(cfg.global_batch, [1.0] * cfg.world_size),
                              "ND: no straggler, equal batches")]
