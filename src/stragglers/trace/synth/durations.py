"""Sampled op costs for a synthetic job: noise, launch delays and the injected causes.

Every array here is (nodes, columns): one row per schedule node, one column per
(step, dp rank) with column = step * dp + dp_rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, TypedDict

import numpy as np

from stragglers.trace.synth.injections import GC, SequenceImbalance, SlowCollective, SlowLink
from stragglers.trace.synth.schedule import BASE_COST, StepGraph
from stragglers.trace.synth.validate import Job

# docs/whatif.md §11: one transformer block, forward + backward over 16,384 packed tokens costs
# ≈ 19.4 ms + 0.76 ms per 10⁶ of Σ s_i² (the spec prints 10⁹, but its own data points,
# 16K → 224 ms and 2×8K → 120 ms, fit 10⁶). Only the ratio of the two terms shapes our costs.
ATTN_FIXED_S = 0.0194
ATTN_PER_SQ_S = 0.76e-3 / 1e6
ATTN_REF_TOKENS = 16384
FORWARD_BACKWARD = ("forward-compute", "backward-compute")


class PauseCells(NamedTuple):
    """Where GC pauses landed inside forward/backward compute."""

    ids: np.ndarray      # forward/backward node ids
    active: np.ndarray   # bool (ids, columns): a pause in that node's run
    stages: np.ndarray   # stage of each id


class SamplingNotes(TypedDict, total=False):
    """What the sampling measured, as the trace's metadata records it (those measured only)."""

    attn_cost_cv: float       # CV of the microbatches' Σ s_i²
    cost_cv: float            # CV of the forward/backward cost scale it gives
    pauses_in_compute: int


@dataclass
class Costs:
    """Per-node sampled durations (compute) or transfers (communication) and launch delays."""

    duration: np.ndarray          # (nodes, columns) seconds
    delay: np.ndarray             # (nodes, columns) launch delay, seconds
    step_gap: np.ndarray          # (pp, columns) gap before a worker's first op of the step
    gc_active: np.ndarray | None  # (gc nodes, columns) bool, rows follow gc_rows
    gc_rows: np.ndarray           # node ids of gc slots
    attn_cost: np.ndarray | None  # (microbatches, columns) Σ s_i² of each microbatch
    tokens: int = 0
    gc_slot_stage: np.ndarray | None = None  # stage of each gc slot (rows follow gc_rows)
    pause_cells: PauseCells | None = None
    # what the sampling measured, recorded in the trace's metadata
    attn_cost_cv: float | None = None    # CV of the microbatches' Σ s_i²
    cost_cv: float | None = None         # CV of the forward/backward cost scale it gives
    pauses_in_compute: int | None = None

    def notes(self) -> SamplingNotes:
        """What the sampling measured, as the trace's metadata records it (those measured)."""
        notes = SamplingNotes()
        if self.attn_cost_cv is not None:
            notes["attn_cost_cv"] = self.attn_cost_cv
        if self.cost_cv is not None:
            notes["cost_cv"] = self.cost_cv
        if self.pauses_in_compute is not None:
            notes["pauses_in_compute"] = self.pauses_in_compute
        return notes


def node_rows(sched: StepGraph, optypes: tuple[str, ...], stage: int | None = None) -> np.ndarray:
    """Ids of the nodes with one of the op types (on one stage if given)."""
    return np.array([n.id for n in sched.nodes if n.optype in optypes
                     and (stage is None or n.stage == stage)], dtype=np.int64)


def sample_costs(sched: StepGraph, job: Job) -> Costs:
    """Sample every op's cost of `job` once, then apply the injections multiplicatively.

    Noise, sequence lengths and GC pauses draw from separate streams of the seed, so leaving
    one injection out (to measure its impact) leaves every other draw unchanged.
    """
    # spawn(k)[i] does not depend on k: adding streams keeps the old draws
    rng, seq_rng, gc_rng, pause_rng = (np.random.default_rng(s)
                                       for s in np.random.SeedSequence(job.seed).spawn(4))
    dp, noise, launch_delay, step_gap = job.dp, job.noise, job.launch_delay, job.step_gap
    n, cols = len(sched.nodes), dp * job.steps
    base = np.array([BASE_COST[node.optype] for node in sched.nodes])
    fb = node_rows(sched, FORWARD_BACKWARD)
    base[fb] /= sched.vpp  # a model chunk holds 1/vpp of the stage's layers
    duration = rng.standard_normal((n, cols))
    duration *= noise
    np.exp(duration, out=duration)
    duration *= base[:, None]
    delay = rng.exponential(launch_delay, (n, cols)) if launch_delay > 0 else np.zeros((n, cols))
    gaps = rng.exponential(step_gap, (sched.pp, cols)) if step_gap > 0 else \
        np.zeros((sched.pp, cols))
    col_dp = np.tile(np.arange(dp), job.steps)
    costs = Costs(duration, delay, gaps, None, node_rows(sched, ("gc",)), None)

    if job.seq_imbalance is not None:
        _apply_sequence_imbalance(sched, costs, fb, seq_rng, job.seq_imbalance, cols)
    if job.heavy_last_stage is not None:
        duration[node_rows(sched, FORWARD_BACKWARD, sched.pp - 1)] *= job.heavy_last_stage.factor
    if job.stage_scale is not None:  # per-stage work (a layer split), e.g. a rebalanced pipeline
        for stage, factor in enumerate(job.stage_scale):
            duration[node_rows(sched, FORWARD_BACKWARD, stage)] *= factor
    slow = job.slow_worker
    if slow is not None:
        rows = node_rows(sched, FORWARD_BACKWARD + ("optimizer",), slow.stage)
        duration[np.ix_(rows, np.flatnonzero(col_dp == slow.dp))] *= slow.factor
    link = job.slow_link
    if link is not None:
        rows = slow_link_rows(sched, link)
        hit = np.ones(cols, dtype=bool)
        if isinstance(link, SlowLink):
            hit &= col_dp == link.dp
        if link.steps is not None:  # an intermittent slowdown
            hit &= np.isin(np.arange(cols) // dp, link.steps)
        duration[np.ix_(rows, np.flatnonzero(hit))] *= link.factor
    stall = job.host_stall
    if stall is not None:  # host-side work before the worker's first op of the step
        hit = col_dp == stall.dp
        if stall.steps is not None:
            hit &= np.isin(np.arange(cols) // dp, stall.steps)
        gaps[stall.stage, hit] += stall.seconds
    if job.gc_in_compute is not None:
        _apply_pauses_in_compute(sched, costs, fb, pause_rng, job.gc_in_compute, noise)
    if len(costs.gc_rows):
        # gc=None with gc slots in the schedule: the same job without its pauses
        rate, length = (job.gc.rate, job.gc.seconds) if job.gc is not None else (0.0, 0.0)
        forwards = sched.microbatches * sched.vpp
        prob = min(1.0, rate / forwards)
        active = gc_rng.random((len(costs.gc_rows), cols)) < prob
        pause = length * np.exp(noise * gc_rng.standard_normal(active.shape))
        duration[costs.gc_rows] = np.where(active, pause, 0.0)
        delay[costs.gc_rows] *= active  # an absent pause takes no time at all
        costs.gc_slot_stage = np.array([sched.nodes[i].stage for i in costs.gc_rows])
        costs.gc_active = active
    return costs


def _apply_pauses_in_compute(sched: StepGraph, costs: Costs, fb: np.ndarray,
                             rng: np.random.Generator, gc: GC, noise: float) -> None:
    """GC pauses that land inside forward/backward compute (no gc rows, as NDTimeline shows them)."""
    rate, length = gc.rate, gc.seconds
    prob = min(1.0, rate / len(node_rows(sched, FORWARD_BACKWARD, 0)))
    active = rng.random((len(fb), costs.duration.shape[1])) < prob
    pause = length * np.exp(noise * rng.standard_normal(active.shape))
    costs.duration[fb] += np.where(active, pause, 0.0)
    costs.pauses_in_compute = int(active.sum())
    costs.pause_cells = PauseCells(fb, active, np.array([sched.nodes[i].stage for i in fb]))


def slow_link_rows(sched: StepGraph, link: SlowLink | SlowCollective) -> np.ndarray:
    """Nodes whose transfer a slow link multiplies (both members of each affected p2p pair)."""
    if isinstance(link, SlowLink):
        pair = {link.stage_from, link.stage_to}
        rows = []
        for g in sched.groups:
            if g.kind == "p2p" and {sched.nodes[m].stage for m in g.members} == pair:
                rows.extend(g.members)
        return np.array(sorted(rows), dtype=np.int64)
    return node_rows(sched, (link.optype,), link.stage)


def _apply_sequence_imbalance(sched: StepGraph, costs: Costs, fb: np.ndarray,
                              rng: np.random.Generator, cfg: SequenceImbalance,
                              cols: int) -> None:
    """Scale forward/backward by a + b·Σs_i², normalised so the mean cost is unchanged."""
    tokens = int(cfg.tokens_per_mb)
    sq = packed_square_sums(rng, sched.microbatches * cols, tokens, cfg)
    sq = sq.reshape(sched.microbatches, cols)
    fixed = ATTN_FIXED_S * tokens / ATTN_REF_TOKENS
    cost = fixed + ATTN_PER_SQ_S * sq
    scale = cost / cost.mean()
    mbs = np.array([sched.nodes[i].mb for i in fb])
    costs.duration[fb] *= scale[mbs]
    costs.attn_cost = sq
    costs.tokens = tokens
    costs.attn_cost_cv = float(sq.std() / sq.mean())
    costs.cost_cv = float(scale.std())


def packed_square_sums(rng: np.random.Generator, count: int, tokens: int,
                       cfg: SequenceImbalance) -> np.ndarray:
    """Σ s_i² of `count` microbatches, each packed with sequences up to `tokens` tokens.

    Sequences are drawn from the length distribution, clipped to [min_len, max_len]; the last
    sequence of a microbatch is cut to fill the token budget exactly.
    """
    max_len, min_len = int(cfg.max_len), int(cfg.min_len)
    remaining = np.full(count, tokens, dtype=np.int64)
    sq = np.zeros(count)
    active = np.arange(count)
    while len(active):
        if cfg.dist == "lognormal":
            drawn = rng.lognormal(np.log(cfg.median_len), cfg.sigma, len(active))
        else:
            drawn = rng.uniform(min_len, max_len, len(active))
        lengths = np.clip(np.rint(drawn), min_len, max_len).astype(np.int64)
        lengths = np.minimum(lengths, remaining[active])
        sq[active] += lengths.astype(np.float64) ** 2
        remaining[active] -= lengths
        active = active[remaining[active] > 0]
    return sq
