"""Remedies the diagnosis already prices (planned GC, sequence balancing, stage split), on the same footing.

The diagnosis predicts T_nodelay / T_fixed for its cause; the seconds per step that saves are
taken off the replay with launch delays, the baseline every other remedy is measured against.
"""

from __future__ import annotations

import numpy as np
from msgspec import UNSET
from msgspec.structs import replace

from stragglers.advice.context import AdviceContext
from stragglers.advice.plan import RemedyAdvice
from stragglers.advice.remedies.base import RemedyBase
from stragglers.advice.remedies.details import DiagnosedDetails
from stragglers.errors import InputError
from stragglers.protocols import REMEDIES
from stragglers.whatif.confidence import GAIN
from stragglers.whatif.grid import GC


class DiagnosedFix(RemedyBase):
    """A fix priced by the diagnosis's prediction for one cause."""

    cause = ""
    absent = ""
    cost = ""

    def switch_on(self, ctx: AdviceContext) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def settings(self, ctx: AdviceContext, details: DiagnosedDetails) -> DiagnosedDetails:
        """`details` with the remedy's parameters for this job set (default none)."""
        return details

    def predict(self, ctx: AdviceContext) -> RemedyAdvice:
        """The diagnosis's speedup_if_fixed for the cause, as seconds saved off the baseline."""
        f = ctx.finding(self.cause)
        if f is None or f.speedup_if_fixed is None:
            return self.refuse(self.absent)
        # This remedy alone: a diagnosis that predicts a cause on top of the others' fixes
        # keeps the alone figure too.
        alone = f.speedup_alone or f.speedup_if_fixed
        saved = ctx.saved_by_finding(float(alone))
        details = self.settings(ctx, DiagnosedDetails(
            where=f.where, diagnosis_speedup=f.speedup_if_fixed, diagnosis_speedup_alone=alone,
            diagnosis_interval=UNSET if f.interval is None else f.interval,
            diagnosis_upper_bound=f.upper_bound,
            diagnosis_basis=UNSET if f.basis is None else f.basis))
        method = (f"the diagnosis's prediction for {self.cause} alone (replay with that cause's "
                  f"share removed: {f.evidence}), its seconds saved per step taken off the "
                  "replay with launch delays")
        if f.upper_bound:
            method += "; an upper bound (a perfect fix)"
        interval = None
        if f.interval:  # the diagnosis's bootstrap interval, on this remedy's footing
            scale = float(alone) / float(f.speedup_if_fixed)
            interval = [ctx.baseline_step_s / (ctx.baseline_step_s - ctx.saved_by_finding(e * scale))
                        for e in (f.interval.low, f.interval.high)]
        return self.priced(ctx, ctx.baseline_step_s - saved, method, self.cost,
                           self.switch_on(ctx), details, interval=interval)


@REMEDIES.register("planned-gc")
class PlannedGCRemedy(DiagnosedFix):
    """Automatic GC off, gc.collect() on every rank at the same step every N steps."""

    name = "planned-gc"
    cause = "gc"
    runtime_switchable = True
    exact = True
    absent = (f"the diagnosis found no uncoordinated GC pauses worth ×{GAIN.min_gain} "
              "(no gc ops, or too short)")
    cost = "one full collection every N steps, on every rank at once"

    def full_pauses(self, ctx: AdviceContext) -> tuple[float, float]:
        """(pause of a full collection, full collections per rank and step) from the gc rows.

        Young-generation pauses are short and frequent, full ones long and rare; planned GC
        turns the automatic ones off and runs a full collection, so it is the full ones that
        set its price. Full = at least half the longest pause.
        """
        g = ctx.w.grid
        nodes = g.node_optype == GC
        dur = g.duration[nodes]
        if not nodes.any() or dur.max() <= 0:
            return 0.0, 0.0
        full = dur[dur >= 0.5 * dur.max()]
        return float(np.median(full)), len(full) / (g.shape[1] * g.pp_size * g.shape[2])

    def full_share(self, ctx: AdviceContext) -> np.ndarray:
        """Each step's full collections over the mean per step [T] (all 1 where none)."""
        g = ctx.w.grid
        dur = g.duration[g.node_optype == GC]                         # [gc ops, D, T]
        if not dur.size or dur.max() <= 0:
            return np.ones(g.shape[2])
        per_step = (dur >= 0.5 * dur.max()).sum(axis=(0, 1)).astype(float)
        return per_step / per_step.mean() if per_step.sum() > 0 else np.ones(g.shape[2])

    def every(self, ctx: AdviceContext) -> int:
        """N: one planned collection per automatic full collection a rank now takes."""
        _, rate = self.full_pauses(ctx)
        return int(np.clip(round(1.0 / rate), 1, 10_000)) if rate > 0 else 5

    def settings(self, ctx: AdviceContext, details: DiagnosedDetails) -> DiagnosedDetails:
        """`details` with N and the full collections it is priced from."""
        pause, rate = self.full_pauses(ctx)
        return replace(details, every=self.every(ctx), full_pause_s=pause, full_per_rank_step=rate)

    def predict(self, ctx: AdviceContext) -> RemedyAdvice:
        """Every rank pays one full collection per N steps, at once; young pauses are gone.

        The diagnosis removes the pauses altogether (an upper bound); planned collections still
        cost a full collection every N steps, only no rank waits for another's. Where the
        pauses are hidden inside compute (no gc rows) the diagnosis's number is all there is.
        """
        g = ctx.w.grid
        nodes = np.flatnonzero(g.node_optype == GC)
        f = ctx.finding(self.cause)
        pause, rate = self.full_pauses(ctx)
        if f is None or pause <= 0:
            return super().predict(ctx)
        n = self.every(ctx)
        sync = ctx.calibrated("gc_sync_pause_s")
        if sync is not None and not (isinstance(sync, (int, float)) and np.isfinite(sync)
                                     and sync >= 0):
            raise InputError("advise", "gc_sync_pause_s", f"expected seconds >= 0, got {sync!r}")
        # A collection on every rank at once is not one alone: ranks sharing cores (or memory
        # bandwidth) slow each other; the calibration measured exactly that case.
        planned = pause if sync is None else float(sync)
        basis = (f"{1e3 * planned:.0f} ms, measured in this job with every rank collecting at "
                 "once (calibration step)" if sync is not None else
                 f"{1e3 * pause:.0f} ms, the median of the recorded full ones")
        cost = ctx.w.cost.copy()
        cost[nodes] = 0.0
        first = nodes[np.argmin(g.node_seq[nodes])]
        # The planned pause, amortised, on every rank alike: planned / N a step on average,
        # laid on the steps in proportion to the automatic full collections they held (one
        # planned collection per automatic one). The mean is the same; the interval resamples
        # steps, and a resample with fewer automatic collections then also plans fewer.
        cost[first] = (planned / n) * self.full_share(ctx)[None, :]
        return self.priced(
            ctx, ctx.step_times(cost),
            f"replay with the automatic pauses gone and every rank paying one full collection "
            f"({basis}) every N = {n} steps at the same point, amortised per step",
            self.cost, self.switch_on(ctx),
            self.settings(ctx, DiagnosedDetails(where=f.where, diagnosis_speedup=f.speedup_if_fixed,
                                                planned_pause_s=planned)))

    def switch_on(self, ctx: AdviceContext) -> str:
        n = self.every(ctx)
        return (f"stragglers.mitigate.PlannedGC(every={n}).start(), then planned_gc.step(step) "
                f"every step (examples/train_gpt.py --planned-gc {n}); in a running job: "
                "stragglers.advice.act")


@REMEDIES.register("sequence-balancing")
class SequenceBalancing(DiagnosedFix):
    """Redistribute packed sequences across DP ranks and microbatches to balance Σs²."""

    name = "sequence-balancing"
    cause = "sequence_imbalance"
    absent = "the diagnosis found no sequence-length imbalance"
    cost = "a greedy re-packing of each global batch (host CPU, every rank the same plan)"

    def switch_on(self, ctx: AdviceContext) -> str:
        return ("stragglers.mitigate.balance_sequences(seq_lens, dp_size, num_microbatches) on "
                "every rank each step (examples/train_gpt.py --balance-sequences)")


@REMEDIES.register("stage-split")
class StageSplitRemedy(DiagnosedFix):
    """Move layers between pipeline stages so each stage carries the same work."""

    name = "stage-split"
    cause = "stage_imbalance"
    exact = True
    absent = "the diagnosis found no stage imbalance"
    cost = "a restart with the new layer split (checkpoint re-sharded by layer)"

    def switch_on(self, ctx: AdviceContext) -> str:
        return ("stragglers.mitigate.suggest_stage_split(layer_costs, num_stages).layers_per_stage "
                "as the new split (examples/train_gpt.py --balance-stages or --stage-split A,B)")


@REMEDIES.register("expert-balancing")
class ExpertBalancing(DiagnosedFix):
    """Balance MoE routing so every expert-parallel rank receives its group's mean rows."""

    name = "expert-balancing"
    cause = "expert_imbalance"
    absent = "the diagnosis found no expert load imbalance (no all-to-all with rows received, " \
             "or routing even enough)"
    cost = ("a higher auxiliary load-balancing loss weight changes what the model learns; a "
            "capacity factor drops (or re-routes) the rows beyond it")

    def settings(self, ctx: AdviceContext, details: DiagnosedDetails) -> DiagnosedDetails:
        """What each capacity factor buys at the measured routing (the diagnosis's replays)."""
        f = ctx.finding(self.cause)
        return replace(details, capacity_factor=f.capacity_factor) if f is not None else details

    def switch_on(self, ctx: AdviceContext) -> str:
        return ("raise the router's auxiliary load-balancing loss weight, or cap each expert at "
                "a capacity factor (details.capacity_factor prices 1.0-2.0); "
                "examples/train_moe.py --balanced runs the same job with balanced routing")
