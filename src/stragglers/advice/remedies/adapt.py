"""AntDT remedies: DD (re-split batches by measured speed) and ND (kill and restart the straggler)."""

from __future__ import annotations

import numpy as np

from stragglers.adapt.controller import ControlConfig
from stragglers.adapt.policies import restart_gain, split_batch
from stragglers.advice.context import COMPUTE, AdviceContext
from stragglers.advice.plan import RemedyAdvice
from stragglers.advice.remedies.base import RemedyBase
from stragglers.advice.remedies.details import BatchSplit, Restart
from stragglers.errors import InputError
from stragglers.protocols import REMEDIES

WORKER_COMPUTE = 1.1   # a worker computing this much longer than its peers is a straggler (ND)


def dp_rank_times(ctx: AdviceContext) -> np.ndarray:
    """Per DP rank and step, the compute of its slowest stage (it paces that replica): [D, T]."""
    return ctx.worker_compute().max(axis=1)


def compute_curves(ctx: AdviceContext) -> list[tuple[float, float]] | None:
    """The measured per-DP-rank compute curves (fixed s, s per sample), checked, or None."""
    curves = ctx.calibrated("compute_curves")
    if curves is None:
        return None
    if not isinstance(curves, (list, tuple)) or len(curves) != ctx.dp:
        raise InputError("advise", "compute_curves", f"expected {ctx.dp} (fixed, per_sample) "
                         f"pairs, one per DP rank, got {curves!r:.80}")
    out = []
    for i, pair in enumerate(curves):
        try:
            a, c = (float(x) for x in pair)
        except (TypeError, ValueError):
            a = c = float("nan")
        if not (np.isfinite(a) and np.isfinite(c)) or c <= 0:
            raise InputError("advise", f"compute_curves[{i}]", f"expected (fixed seconds, "
                             f"seconds per sample > 0), got {pair!r:.60}")
        out.append((a, c))
    return out


def rebalanced_batches(ctx: AdviceContext) -> tuple[list[int], list[int], list[float], str]:
    """(current, re-split batches, split weights, where the batch came from).

    Without a measured compute curve the DD policy's split: v_i = b_i / t_i (compute ∝
    batch). With one (t_i(b) = a_i + c_i·b), the split that ends every rank's compute at
    the same time: b_i = (T − a_i) / c_i with Σ b_i = B, rounded by the same split_batch.
    """
    sizes, total, source = ctx.batch_sizes()
    curves = compute_curves(ctx)
    t = dp_rank_times(ctx).mean(axis=1)
    if curves is None:
        v = [b / x if x > 0 else 0.0 for b, x in zip(sizes, t)]
        return sizes, split_batch(total, v), v, source
    # The speeds are the job's own: each curve is scaled so that it gives the rank's measured
    # compute at its current batch, over all the analysed steps. The calibration, one short
    # measurement per batch size, sets only the shape (the fixed part against the per-sample
    # part); its level is noisier (on shared cores two equal ranks can calibrate 30% apart).
    # batch_scale is a ratio of one rank's curve, so the scaling leaves it as it was.
    curves = [(a * k, c * k) for (a, c), k in
              ((ac, x / (ac[0] + ac[1] * b) if x > 0 and ac[0] + ac[1] * b > 0 else 1.0)
               for ac, b, x in zip(curves, sizes, t))]
    inv = sum(1.0 / c for _, c in curves)
    finish = (total + sum(a / c for a, c in curves)) / inv
    w = [max(finish - a, 0.0) / c for a, c in curves]
    return sizes, split_batch(total, w), w, source


def batch_scale(ctx: AdviceContext, d: int, old: int, new: int) -> float:
    """How much DP rank d's forward/backward grows going from `old` to `new` samples."""
    curves = compute_curves(ctx)
    if curves is None:
        return new / old
    a, c = curves[d]
    return max(a + c * new, 0.0) / max(a + c * old, 1e-12)


@REMEDIES.register("antdt-dd")
class DynamicBatches(RemedyBase):
    """AntDT-DD: per-worker batches proportional to measured speed (same global batch)."""

    name = "antdt-dd"
    runtime_switchable = True

    def predict(self, ctx: AdviceContext) -> RemedyAdvice:
        """Replay with each DP rank's forward/backward scaled by its new batch over its old one."""
        if ctx.dp < 2:
            return self.refuse("one DP rank: there is no batch to move between workers")
        if not ctx.has_dp_collective():
            return self.refuse("no DP collective: the workers do not wait for each other")
        sizes, new, v, source = rebalanced_batches(ctx)
        comp = ctx.nodes_of(COMPUTE)
        cost = ctx.w.cost.copy()
        for d, (b, b2) in enumerate(zip(sizes, new)):
            cost[comp, d, :] *= batch_scale(ctx, d, b, b2)
        step = ctx.step_times(cost)
        why = None
        spread = max(v) / max(min(v), 1e-30)
        if "stage_imbalance" in ctx.causes():
            why = "the slow part is a whole stage, which every DP rank has alike: moving batch " \
                  "between DP ranks cannot help"
        elif spread < 1.05:
            why = f"the DP ranks compute at the same speed (fastest/slowest {spread:.3f})"
        if compute_curves(ctx) is None:
            method = (f"per-DP-rank speed v_i = b_i / mean forward+backward time (slowest "
                      f"stage), batches re-split by split_batch(B = {sum(sizes)}, v) — the DD "
                      f"policy's rounding — and each rank's forward/backward scaled by b_i'/b_i "
                      f"(compute ∝ batch assumed), replayed (batches {source})")
        else:
            method = (f"the measured compute curves t_i(b) = a_i + c_i·b (calibration step); "
                      f"batches b_i = (T − a_i)/c_i with Σ b_i = {sum(sizes)}, rounded by "
                      f"split_batch; each rank's forward/backward scaled by t_i(b_i')/t_i(b_i), "
                      f"replayed (batches {source})")
        return self.priced(
            ctx, step, method,
            "none at runtime: the same global batch, re-partitioned; each local mean loss is "
            "scaled by n·b_i/B so the update is the B-sample batch's",
            f"per-rank batches {new} (from {sizes}): stragglers.adapt.policies.split_batch(B, v) "
            "with loss_scale(n, b_i, B); AntDT-DD: examples/train_adaptive.py --policy dd; in a "
            "running job: stragglers.advice.act (AdvisePolicy)",
            BatchSplit(batch_sizes=sizes, new_batch_sizes=new, split_weights=v,
                       compute_curves=compute_curves(ctx)), why_small=why)


@REMEDIES.register("antdt-nd")
class KillRestartRemedy(RemedyBase):
    """AntDT-ND KILL_RESTART: relaunch the persistently slow worker away from its host."""

    name = "antdt-nd"

    def predict(self, ctx: AdviceContext) -> RemedyAdvice:
        """The replay with the straggler computing like its peers, against the restart cost."""
        if ctx.dp < 2:
            return self.refuse("one DP rank: no peers to tell a slow worker from a slow job")
        comp = ctx.worker_compute()                                   # [D, P, T]
        peers = np.median(comp, axis=0, keepdims=True)
        ratio = comp / np.maximum(peers, 1e-12)
        mean = ratio.mean(axis=2)
        d, p = (int(i) for i in np.unravel_index(int(np.argmax(mean)), mean.shape))
        who = f"(dp {int(ctx.w.grid.dp_ranks[d])}, pp {int(p)})"
        if mean[d, p] < WORKER_COMPUTE:
            return self.refuse(f"no worker computes ≥ {WORKER_COMPUTE}× its peers (the slowest, "
                               f"{who}, {mean[d, p]:.2f}×): nothing a restart fixes")
        device = ctx.device_of(d)
        others = [ctx.device_of(i) for i in range(ctx.dp) if i != d]
        known = [x for x in others if x is not None]
        if device is not None and known and device != max(set(known), key=known.count):
            return self.refuse(f"deterministic straggler: {who} is a {device} among "
                               f"{max(set(known), key=known.count)} devices; a restart lands on "
                               "the same kind of device (re-split batches instead: antdt-dd)")
        cost = ctx.w.cost.copy()
        sel = np.flatnonzero(np.isin(ctx.w.grid.node_optype, COMPUTE) & (ctx.w.grid.node_stage == p))
        cost[sel, d, :] /= np.maximum(ratio[d, p], 1e-12)[None, :]
        fixed_steps = ctx.step_times(cost)
        fixed = float(fixed_steps.mean())
        now = ctx.baseline_step_s
        restart = ctx.config.restart_cost_s
        restart = ControlConfig.restart_cost_s if restart is None else restart
        remaining = ctx.config.remaining_steps
        if remaining is None:
            total = (ctx.trace.meta.extra or {}).get("total_steps")
            if isinstance(total, int):
                remaining = max(0, total - int(ctx.w.grid.steps.max()) - 1)
        details = Restart(worker=[int(ctx.w.grid.dp_ranks[d]), int(p)],
                          compute_ratio=float(mean[d, p]), fixed_step_s=fixed,
                          restart_cost_s=restart, remaining_steps=remaining)
        method = (f"replay with {who}'s forward/backward divided by its ratio to the stage's "
                  f"median peer, step by step ({mean[d, p]:.2f}× on average); the gain "
                  f"(T_now − T_fixed) × remaining steps is set against the restart cost, and the "
                  f"step time is amortised over the remaining steps")
        switch = (f"AntDT-ND KILL_RESTART of rank {int(ctx.w.grid.dp_ranks[d])}: "
                  f"examples/train_adaptive.py --policy nd --restart-cost {restart:g} under "
                  "torchrun --max-restarts 1 (needs a checkpoint and the shard service)")
        price = f"{restart:g} s per restart (reschedule + checkpoint load)"
        if remaining is None:
            return self.refuse("the remaining steps are unknown (pass remaining_steps / "
                               "--remaining-steps): the restart cannot be priced",
                               predicted_step_s=fixed, method=method, cost=price, switch_on=switch,
                               details=details)
        gain = (now - fixed) * remaining
        details.gain_s = gain
        details.spec_gain_s = restart_gain(float(comp[d, p].mean()), float(peers[0, p].mean()),
                                           remaining)
        amortised = (fixed * remaining + restart) / max(remaining, 1)
        if gain <= restart:
            return self.refuse(f"the restart costs {restart:g} s and gains only {gain:.1f} s over "
                               f"the {remaining} remaining steps", predicted_step_s=amortised,
                               predicted_speedup=now / amortised, method=method, cost=price,
                               switch_on=switch, details=details)
        # per step, as `amortised` is on average (the interval over the steps)
        return self.priced(ctx, fixed_steps + restart / max(remaining, 1), method, price, switch,
                           details)
