"""Controller: turns Monitor windows into ADJUST_BS / KILL_RESTART actions (AntDT-DD and -ND)."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

from stragglers.adapt.monitor import NONE, Monitor
from stragglers.adapt.policies import restart_gain, split_batch
from stragglers.errors import InputError

ADJUST_BS, KILL_RESTART = "ADJUST_BS", "KILL_RESTART"
POLICIES = ("bsp", "dd", "nd")


@dataclass
class ControlConfig:
    """What the controller needs to know about the job; posted by rank 0 at start."""

    policy: str
    world_size: int
    global_batch: int
    memory_cap: int | None = None
    total_steps: int = 0
    restart_cost_s: float = 10.0
    max_restarts: int = 1
    window: int = 5
    theta: float = 1.3
    persistent_windows: int = 3
    min_change: float = 0.05  # re-plan only when some b_i moves by more than this x B/n
    lag_s: float = 1.0  # how far ahead an action takes effect, so every agent has seen it
    incarnation: int = 0

    def validate(self) -> None:
        """Raise InputError for a config the controller cannot act on."""
        if self.policy not in POLICIES:
            raise InputError("control config", "policy", f"expected one of {POLICIES}, got {self.policy!r}")
        if self.world_size < 1:
            raise InputError("control config", "world_size", f"expected >= 1, got {self.world_size}")
        if self.global_batch < self.world_size:
            raise InputError("control config", "global_batch",
                             f"expected >= world_size ({self.world_size}), got {self.global_batch}")
        if self.window < 1 or self.persistent_windows < 1:
            raise InputError("control config", "window", "expected window and persistent_windows >= 1")


@dataclass
class Action:
    """One controller decision; every agent sees every action and applies it at `effective_step`."""

    seq: int
    kind: str
    effective_step: int
    batch_sizes: list[int] = field(default_factory=list)
    memory_cap: int | None = None
    target: int | None = None
    reason: str = ""


class Controller:
    """Runs the chosen policy on each closed Monitor window."""

    def __init__(self, config: ControlConfig):
        config.validate()
        self.config = config
        self.monitor = Monitor(config.world_size, config.window, config.theta,
                               config.persistent_windows)
        n = config.world_size
        self.batch_sizes = split_batch(config.global_batch, [1.0] * n)
        self.actions: list[Action] = []
        self.kills = 0
        self.last_classes: dict[int, dict] = {}

    def observe(self, rank: int, step: int, bpt: float, batch: int, device: str = "") -> list[Action]:
        """Feed one step record; returns the actions decided because a window closed."""
        self.monitor.record(rank, step, bpt, batch, device)
        if not self.monitor.window_ready():
            return []
        self.last_classes = self.monitor.evaluate()
        if self.config.policy == "bsp":
            return []  # the baseline only observes
        new = self._decide_dd() if self.config.policy == "dd" else self._decide_nd()
        self.actions.extend(new)
        return new

    def _lag_steps(self) -> int:
        step_times = [r.bpt for w in self.monitor.workers.values() for r in list(w.records)[-3:]]
        step_time = max(statistics.median(step_times), 1e-3) if step_times else 0.1
        return max(2, math.ceil(self.config.lag_s / step_time))

    def _adjust(self, sizes: list[int], reason: str) -> list[Action]:
        n, cfg = self.config.world_size, self.config
        moved = max(abs(a - b) for a, b in zip(sizes, self.batch_sizes))
        if moved <= cfg.min_change * cfg.global_batch / n:
            return []
        self.batch_sizes = sizes
        return [Action(len(self.actions), ADJUST_BS, self.monitor.latest_step + self._lag_steps(),
                       list(sizes), cfg.memory_cap, None, reason)]

    def _speeds(self) -> tuple[list[float], list[float]]:
        fits = [self.monitor.throughput_and_overhead(r) for r in range(self.config.world_size)]
        return [v for v, _ in fits], [c for _, c in fits]

    def _decide_dd(self) -> list[Action]:
        v, c = self._speeds()
        if any(x != x for x in v):
            return []
        sizes = split_batch(self.config.global_batch, v, c)
        return self._adjust(sizes, f"DD: throughputs {[round(x, 1) for x in v]} samples/s")

    def _decide_nd(self) -> list[Action]:
        cfg, classes = self.config, self.last_classes
        flagged = [r for r, info in classes.items() if info["class"] != NONE]
        times = [info["per_sample_time"] for info in classes.values()]
        known = [t for t in times if t == t]
        if not known:
            return []
        median_t = statistics.median(known)
        equal_b = cfg.global_batch / cfg.world_size
        remaining = max(0, cfg.total_steps - self.monitor.latest_step)
        for r in flagged:
            info = classes[r]
            if info["class"] == "transient" or self.kills >= cfg.max_restarts:
                continue
            gain = restart_gain(info["per_sample_time"] * equal_b, median_t * equal_b, remaining)
            if gain > cfg.restart_cost_s:
                self.kills += 1
                act = Action(len(self.actions), KILL_RESTART,
                             self.monitor.latest_step + self._lag_steps(), [], None, r,
                             f"ND: rank {r} {info['class']} (r={info['ratio']:.2f} for"
                             f" {info['windows']} windows); gain {gain:.1f}s >"
                             f" restart cost {cfg.restart_cost_s:.1f}s")
                return [act]
        if flagged:
            v = [1.0 / t if t == t and t > 0 else 0.0 for t in times]
            return self._adjust(split_batch(cfg.global_batch, v),
                                f"ND: stragglers {flagged}, b_i proportional to 1/BPT_i")
        return self._adjust(split_batch(cfg.global_batch, [1.0] * cfg.world_size),
                            "ND: no straggler, equal batches")

    def state(self) -> dict:
        """What the controller knows, for status pages and the job's final report."""
        return {"config": asdict(self.config), "batch_sizes": self.batch_sizes,
                "classes": {str(k): {f: (None if x != x else x) for f, x in v.items()}
                            for k, v in self.last_classes.items()},
                "actions": [asdict(a) for a in self.actions], "kills": self.kills}
