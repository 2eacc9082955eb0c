"""Remedies that tolerate a straggler instead of fixing it: StragglAR and gradient coding."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from stragglers.advice.context import COMPUTE, DP_COLLECTIVE, AdviceContext
from stragglers.advice.plan import RemedyAdvice
from stragglers.advice.remedies.base import RemedyBase
from stragglers.advice.remedies.details import CodeDetails, StragglarBucket, StragglarDetails
from stragglers.collectives.cost_model import (LinkModel, reduce_scatter_time, ring_time,
                                               stragglar_phase2_time)
from stragglers.collectives.detection import StragglerDetector
from stragglers.collectives.schedule import phase2_rounds
from stragglers.protocols import REMEDIES
from stragglers.whatif.grid import GC

STRAGGLAR_SWITCH = (
    "ddp.register_comm_hook(StragglarHookState(process_group=dist.new_group(), "
    "mode='persistent'), stragglar_hook)  # from stragglers.collectives import "
    "StragglarHookState, stragglar_hook; in a running job: stragglers.advice.act "
    "(AdvisePolicy + SwitchableCommHook)")


def persistent_straggler(ctx: AdviceContext, node: int) -> tuple[int | None, float]:
    """The DP rank (index) last at this all-reduce in ≥ threshold of steps, and its share.

    Decided as the DDP hook decides it (StragglerDetector over the time each rank spent inside
    the collective: the last to arrive spends the least), over every analysed step.
    """
    dur = ctx.w.grid.duration[node]                       # [D, T]
    steps = dur.shape[1]
    det = StragglerDetector(ctx.dp, window=steps, threshold=ctx.config.threshold)
    for t in range(steps):
        det.observe([float(x) for x in dur[:, t]])
    last = [a.last for a in det.history]
    s = det.persistent_straggler()
    share = max(last.count(r) for r in set(last)) / steps
    return s, share


def message_bytes(ctx: AdviceContext, node: int) -> float | None:
    """The median message size of a collective's rows, or None where the trace has none."""
    if "bytes" not in ctx.trace.ops:
        return None
    rows = ctx.w.grid.row[node]
    b = ctx.trace.ops["bytes"][rows[rows >= 0]]
    b = b[b > 0]
    return float(np.median(b)) if len(b) else None


def stragglar_shares(ctx: AdviceContext, node: int) -> tuple[float, float, float, str]:
    """(T_RS / T_ring, T_phase2 / T_ring, message bytes or nan, where the α–β split came from)."""
    n = ctx.dp
    sizes = message_bytes(ctx, node)
    link = ctx.config.link
    if link is not None and sizes is not None:
        how = f"calibrated α = {link.alpha * 1e6:.1f} µs, 1/β = {1 / max(link.beta, 1e-30) / 2**20:.0f} MiB/s"
    else:
        link, how = LinkModel(0.0, 1.0), "bandwidth-bound shares (α = 0" + \
            ("; no message size in the trace" if sizes is None else "; no calibration given") + ")"
        sizes = sizes or 1.0
    ring = ring_time(n, sizes, link)
    rs = reduce_scatter_time(n - 1, sizes, link)
    rounds, note = phase2_rounds(n)
    p2 = stragglar_phase2_time(n, sizes, link, rounds)
    return rs / ring, p2 / ring, sizes, how + (f"; {note}" if note else "")


@REMEDIES.register("stragglar")
class StragglAR(RemedyBase):
    """StragglAR all-reduce: phase 1 among the ready ranks hides in the straggler's delay."""

    name = "stragglar"
    runtime_switchable = True
    exact = True

    def predict(self, ctx: AdviceContext) -> RemedyAdvice:
        """Each DP all-reduce ends at max(D_others + T_RS, D_S) + T_phase2 instead of D_S + T_ring."""
        if ctx.dp < 2:
            return self.refuse("one DP rank: there is no DP collective to hide a delay in")
        if ctx.dp == 2:
            return self.refuse("two DP ranks: phase 1 would run on the one ready rank alone, so "
                               "there is nothing to hide; StragglAR is then a plain exchange")
        nodes = ctx.dp_allreduce_nodes()
        if not nodes:
            if ctx.has_dp_collective():
                return self.refuse("the job syncs gradients with reduce-scatter/all-gather, not an "
                                   "all-reduce: StragglAR replaces an all-reduce only")
            return self.refuse("no DP all-reduce in the trace: no DP collective to hide a delay in")
        chosen = {n: persistent_straggler(ctx, n) for n in nodes}
        stage_why = ("the delay sits on a whole stage: every DP rank of it is late alike, so no "
                     "DP collective has one late rank to hide (a stage imbalance no collective "
                     "can hide)") if "stage_imbalance" in ctx.causes() else None
        if all(s is None for s, _ in chosen.values()):
            best = max(share for _, share in chosen.values())
            if stage_why:
                why = stage_why
            else:
                why = (f"no DP rank is last at the all-reduce in ≥ {100 * ctx.config.threshold:.0f}% "
                       f"of steps (at most {100 * best:.0f}%): no persistent straggler, so the hook "
                       "would keep the library all-reduce")
            return self.refuse(why)
        cost = ctx.w.cost.copy()
        per_node = {}
        for node, (s, share) in chosen.items():
            if s is None:
                continue
            rs, p2, size, how = stragglar_shares(ctx, node)
            t_lib = float(np.median(ctx.w.cost[node]))
            per_node[node] = (s, t_lib * rs, t_lib * p2)
        # Twice: the first pass's arrivals shift later buckets' arrivals a little.
        for _ in range(2):
            start, _ = ctx.timeline(cost)
            for node, (s, t_rs, t_p2) in per_node.items():
                a = start[node]                                   # [D, T] arrivals
                others = np.delete(a, s, axis=0).max(axis=0)
                end = np.maximum(others + t_rs, a[s]) + t_p2
                cost[node] = (end - a.max(axis=0))[None, :]
        step = ctx.step_times(cost)
        start, _ = ctx.timeline()
        buckets: list[StragglarBucket] = []
        for node, (s, t_rs, t_p2) in per_node.items():
            a = start[node]
            lead = a[s] - np.delete(a, s, axis=0).max(axis=0)
            buckets.append(StragglarBucket(
                int(ctx.w.grid.dp_ranks[s]), chosen[node][1], float(np.median(lead)),
                float(np.median(ctx.w.cost[node])), t_rs, t_p2))
        rs, p2, size, how = stragglar_shares(ctx, next(iter(per_node)))
        method = (f"replay with each DP all-reduce ending at max(arrival of the others + T_RS, "
                  f"arrival of the straggler) + T_phase2; T_RS and T_phase2 are the α–β model's "
                  f"shares ({how}) of the measured library transfer; arrivals from the replay")
        zero_delay = rs + p2
        return self.priced(
            ctx, step, method,
            f"same bytes as Ring (2(n−1)s); with no late rank it is ×{zero_delay:.2f} the library "
            "all-reduce (phase 1 not hidden); one comm thread and process group for the hook",
            STRAGGLAR_SWITCH, StragglarDetails(buckets=buckets),
            why_small=stage_why or f"the straggler's lead (median "
                      f"{1e3 * max(b.median_lead_s for b in buckets):.1f} ms) hides at most phase 1 "
                      f"of a {1e3 * max(b.library_transfer_s for b in buckets):.1f} ms all-reduce")


@REMEDIES.register("gradient-coding")
class GradientCoding(RemedyBase):
    """An exact gradient code tolerating s stragglers: every worker computes s + 1 parts."""

    name = "gradient-coding"
    exact = True

    def __init__(self, s: int = 1):
        self.s = int(s)
        self.name = f"gradient-coding-s{self.s}"

    @classmethod
    def variants(cls, ctx: AdviceContext) -> Sequence[GradientCoding]:
        top = max(1, min(ctx.config.max_s, ctx.dp - 1))
        return [cls(s) for s in range(1, top + 1)]

    def predict(self, ctx: AdviceContext) -> RemedyAdvice:
        """Replay with compute × (s+1) and, per step, the s last arrivals at the sync dropped."""
        n, s = ctx.dp, self.s
        if n < 2:
            return self.refuse("one DP rank: nothing to code across")
        if ctx.pp > 1:
            return self.refuse("coded training (stragglers.coding) covers pure data parallelism; "
                               "this job is pipelined")
        if s >= n:
            return self.refuse(f"s = {s} needs more than {n} workers")
        sync = [int(x) for x in ctx.nodes_of(DP_COLLECTIVE)]
        if not sync:
            return self.refuse("no DP gradient sync in the trace: nothing waits for the workers")
        first = min(sync, key=lambda m: float(np.nanmedian(ctx.w.grid.start[m])))
        comp = ctx.nodes_of(COMPUTE)
        cost = ctx.w.cost.copy()
        cost[comp] *= s + 1
        # The gradient goes to the aggregator instead of an all-reduce: per step it sends the
        # parameters to, and receives a coded gradient from, each of the n − s workers it waits
        # for, 2(n − s) messages of the model's size through its one link, where a ring moves
        # 2(n − 1)/n of it per rank. Priced from the calibrated α–β where given, else as that
        # multiple of the measured all-reduce (bandwidth-bound).
        exchange, how = coded_exchange_s(ctx, sync, n, s)
        cost[sync] = 0.0
        cost[first] = exchange
        delay = ctx.w.launch_delay.copy()
        start, _ = ctx.timeline(cost)
        a = start[first]                                              # [D, T]
        threshold = np.sort(a, axis=0)[n - s - 1]                     # the (n−s)-th arrival
        excess = np.maximum(a - threshold[None, :], 0.0)
        # The dropped workers arrive with the (n−s)-th: the aggregator has what it needs then and
        # ignores their late messages, whatever made them late (compute, GC, host-side gaps), so
        # their work and gaps before the sync shrink by the excess.
        before = np.flatnonzero(np.nanmedian(ctx.w.grid.start, axis=(1, 2))
                                <= np.nanmedian(ctx.w.grid.start[first]))
        before = np.union1d(before, ctx.nodes_of(COMPUTE + (GC,)))
        total = cost[before].sum(axis=0) + delay[before].sum(axis=0)
        factor = np.where(total > 0, np.maximum(total - excess, 0.0) / np.maximum(total, 1e-30), 1.0)
        cost[before] *= factor[None]
        delay[before] *= factor[None]
        step = ctx.step_times(cost, delay)
        # exact codes only: FRC where (s+1) | n, else the real cyclic MDS code (n − s odd) or
        # the complex one (docs/gradient-coding.md §2), named explicitly so the code does not
        # fall back silently
        scheme = "frc" if n % (s + 1) == 0 else \
            ("cyclic-mds-real" if (n - s) % 2 else "cyclic-mds-complex")
        return self.priced(
            ctx, step,
            f"replay with every worker's forward/backward × {s + 1} (s + 1 data parts) and, per "
            f"step, the {s} last arrival(s) at the gradient sync dropped (their work and gaps "
            f"before it shrink so the sync starts at the {n - s}-th arrival); the all-reduce "
            f"replaced by the aggregator's exchange of 2(n − s) = {2 * (n - s)} model-sized "
            f"messages, {1e3 * exchange:.1f} ms per step ({how})",
            f"{s + 1}× compute per worker; one aggregator process more (n + 1 ranks); the gradient "
            "goes to the aggregator instead of an all-reduce; restart into coded training",
            f"stragglers.coding.train_coded(model, optimizer, loss_fn, data, "
            f"make_code('{scheme}', n={n}, s={s}), ...) under torchrun with {n + 1} processes "
            f"(examples/train_coded.py --scheme {scheme} --stragglers {s})",
            CodeDetails(s=s, scheme=scheme, exchange_s=exchange),
            why_small=f"{s + 1}× compute on every worker and the aggregator's exchange "
                      f"({1e3 * exchange:.1f} ms a step) cost more than waiting for the {s} slowest")


def coded_exchange_s(ctx: AdviceContext, sync: list[int], n: int, s: int) -> tuple[float, str]:
    """Seconds per step the aggregator spends exchanging parameters and coded gradients."""
    measured = float(sum(np.nanmedian(ctx.w.cost[m]) for m in sync))  # the all-reduce(s) now
    link = ctx.config.link
    sizes = [message_bytes(ctx, m) for m in sync] if link is not None else []
    known = [b for b in sizes if b is not None]
    size = sum(known) if known and len(known) == len(sizes) else None
    if link is not None and size is not None:
        return 2 * (n - s) * (link.alpha + size * link.beta), \
            f"calibrated α–β, {size / 2**20:.1f} MiB of gradients"
    return measured * (n - s) * n / (n - 1), \
        f"{(n - s) * n / (n - 1):.2f}× the measured all-reduce of {1e3 * measured:.1f} ms"
