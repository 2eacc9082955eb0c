"""What every remedy's prediction reads: the trace, its analysis, the what-if model and the config.

Every prediction is a replay (docs/whatif.md §5) of modified op costs with the *measured*
launch delays kept, so a prediction is compared with the replay of the measured costs (which
reproduces the measured step time to within `sim_error`). Nothing here needs torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from stragglers.advice.config import AdviseConfig
from stragglers.collectives.cost_model import LinkModel
from stragglers.errors import InputError
from stragglers.smallfiles import load_json_file
from stragglers.trace.model import OPTYPE_CODES as C, Trace
from stragglers.whatif.grid import BWD, FWD
from stragglers.whatif.metrics import WhatIf
from stragglers.whatif._replay import replay
from stragglers.whatif.result import AnalysisResult, Finding

ALLREDUCE = (C["grads-all-reduce"], C["separate-grads-all-reduce"])
DP_COLLECTIVE = ALLREDUCE + (C["params-all-gather"], C["grads-reduce-scatter"])
COMPUTE = (FWD, BWD)


def load_calibration(path: Path | str) -> LinkModel:
    """A calibration file: JSON {"alpha": s, "beta": s/byte} (or "bytes_per_second" for beta)."""
    path = Path(path)
    # a regular file only, read without blocking and bounded (a FIFO hung advise for good)
    raw = load_json_file(path, "JSON with alpha and beta", missing="no such calibration file")
    if not isinstance(raw, dict):
        raise InputError(path, None, "expected a JSON object with alpha and beta")
    alpha, beta, bps = (raw.get(k) for k in ("alpha", "beta", "bytes_per_second"))
    if beta is None and bps:
        beta = 1.0 / bps if isinstance(bps, (int, float)) and bps > 0 else None
    return LinkModel(_seconds(path, "alpha", alpha), _seconds(path, "beta", beta))


def _seconds(path: Path, name: str, value: object) -> float:
    """A calibration's alpha (s) or beta (s/byte) as a float; InputError unless finite, >= 0."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or value < 0:
        raise InputError(path, name, f"expected seconds{' per byte' if name == 'beta' else ''} "
                         f">= 0, got {value!r}")
    return float(value)


@dataclass
class AdviceContext:
    """The analysed job as the remedies see it."""

    trace: Trace
    result: AnalysisResult
    w: WhatIf
    config: AdviseConfig = field(default_factory=AdviseConfig)
    _timeline: tuple | None = field(default=None, repr=False)

    # --- replays ---------------------------------------------------------------------
    @property
    def baseline_step_s(self) -> float:
        """Mean step time of the replay of measured costs with measured launch delays."""
        return float(self.w.t_replay.mean())

    @property
    def baseline_step_times(self) -> np.ndarray:
        """Each step's time [T] in that replay (what remedies' per-step replays are paired with)."""
        return np.asarray(self.w.t_replay, dtype=float)

    def step_time(self, cost: np.ndarray, delay: np.ndarray | None = None) -> float:
        """Mean step time of a replay of `cost` [N, D, T] with the measured launch delays (or `delay`)."""
        return float(self.step_times(cost, delay).mean())

    def step_times(self, cost: np.ndarray, delay: np.ndarray | None = None) -> np.ndarray:
        """Each step's time [T] in a replay of `cost` with the measured launch delays (or `delay`)."""
        delay = self.w.launch_delay if delay is None else delay
        return np.asarray(replay(self.w.plan, cost, self.w.step_start, delay), dtype=float)

    def timeline(self, cost: np.ndarray | None = None, delay: np.ndarray | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
        """(start, end) [N, D, T] of every op in the replay of `cost` (default: measured)."""
        if cost is None and delay is None and self._timeline is not None:
            return self._timeline
        _, start, end = replay(self.w.plan, self.w.cost if cost is None else cost,
                               self.w.step_start, self.w.launch_delay if delay is None else delay,
                               keep_timeline=True)
        start = np.broadcast_to(start, self.w.cost.shape)
        end = np.broadcast_to(end, self.w.cost.shape)
        if cost is None and delay is None:
            self._timeline = (start, end)
        return start, end

    # --- the job's shape -------------------------------------------------------------
    @property
    def dp(self) -> int:
        return len(self.w.grid.dp_ranks)

    @property
    def pp(self) -> int:
        return int(self.w.grid.pp_size)

    def nodes_of(self, codes: tuple[int, ...], stage: int | None = None) -> np.ndarray:
        """Template ops (indices) of the given op types, on one stage or all."""
        g = self.w.grid
        sel = np.isin(g.node_optype, codes)
        if stage is not None:
            sel &= g.node_stage == stage
        return np.flatnonzero(sel)

    def dp_allreduce_nodes(self) -> list[int]:
        """DP gradient all-reduce template ops that synchronise every DP rank (one per bucket)."""
        m = self.w.model
        out = []
        for members, sync in zip(m.groups, m.group_dp_sync):
            if sync:
                out += [int(x) for x in members if self.w.grid.node_optype[x] in ALLREDUCE]
        return sorted(out, key=lambda n: (int(self.w.grid.node_stage[n]),
                                          float(np.nanmedian(self.w.grid.start[n]))))

    def has_dp_collective(self) -> bool:
        """Whether the job synchronises DP ranks with any DP collective."""
        return self.dp > 1 and len(self.nodes_of(DP_COLLECTIVE)) > 0

    def worker_compute(self) -> np.ndarray:
        """Forward+backward seconds per (DP rank, stage, step): [D, P, T]."""
        g = self.w.grid
        out = np.zeros((self.dp, self.pp, len(g.steps)))
        for p in range(self.pp):
            sel = np.isin(g.node_optype, COMPUTE) & (g.node_stage == p)
            out[:, p, :] = g.duration[sel].sum(axis=0)
        return out

    def batch_sizes(self) -> tuple[list[int], int, str]:
        """(per-DP-rank batch, global batch, where they came from)."""
        k, n = self.config, self.dp
        extra = self.trace.meta.extra or {}
        if k.batch_sizes is not None:
            sizes = [int(b) for b in k.batch_sizes]
            if len(sizes) != n:
                raise InputError("advise", "batch_sizes", f"expected {n} values (one per DP rank), "
                                 f"got {len(sizes)}")
            return sizes, sum(sizes), "given"
        total = k.global_batch or extra.get("global_batch")
        if isinstance(total, (int, float)) and total >= n:
            total = int(total)
            return [total // n + (1 if i < total % n else 0) for i in range(n)], total, \
                "global batch " + ("given" if k.global_batch else "from the trace metadata") + \
                ", split equally"
        # Unknown: equal batches of 100 units (1% resolution for the integer split).
        return [100] * n, 100 * n, "assumed equal (the trace does not say; 100 units per rank)"

    def device_of(self, dp_index: int) -> str | None:
        """Device type of a DP rank, from the config or the trace's layout metadata."""
        k = self.config
        rank_id = int(self.w.grid.dp_ranks[dp_index])
        if k.devices and rank_id in k.devices:
            return str(k.devices[rank_id])
        for entry in (self.trace.meta.extra or {}).get("layout") or []:
            if isinstance(entry, dict) and entry.get("dp_rank") == rank_id and entry.get("device"):
                return str(entry["device"])
        return None

    def calibrated(self, key: str):
        """A value measured by the job's calibration step: the setting when given, else the
        trace metadata's `extra.calibration` (what examples/train_advised.py --calibrate writes)."""
        value = getattr(self.config, key)
        if value is None:
            value = ((self.trace.meta.extra or {}).get("calibration") or {}).get(key)
        return value

    def finding(self, cause: str) -> Finding | None:
        """The diagnosis finding for `cause`, or None."""
        return next((f for f in self.result.diagnosis if f.cause == cause), None)

    def causes(self) -> list[str]:
        """The diagnosed causes, most important first."""
        return [f.cause for f in self.result.diagnosis]

    def saved_by_finding(self, speedup: float) -> float:
        """Seconds per step a diagnosis fix saves: it predicts T_nodelay / speedup."""
        t_nd = float(self.w.t_nodelay.mean())
        return t_nd - t_nd / speedup
