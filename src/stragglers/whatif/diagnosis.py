"""Diagnosis (docs/whatif.md §7): every cause present, where it sits, what fixing only it buys, how sure.

The detectors in whatif/causes find candidates, each with the costs its fix would leave (its
own share only). Here each is replayed for its prediction with a bootstrap interval over steps,
kept when the gain is real (`confidence.gain_is_real`, the gate advise uses too, at
`min_gain`), and ranked by its gain; then all
kept fixes are replayed together for the combined prediction and the unexplained remainder.
The contract is in whatif/README.md; every threshold is a field of DiagnosisConfig.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Callable

import numpy as np

from stragglers.trace.model import OPTYPES, Trace
from stragglers.whatif.causes import DETECTORS, Candidate, Context
from stragglers.whatif.causes.base import Rows, fmt_steps
from stragglers.whatif.config import DEFAULT, STRAGGLING_SLOWDOWN, DiagnosisConfig
from stragglers.whatif.confidence import gain_is_real, ratio_interval
from stragglers.whatif.metrics import WhatIf
from stragglers.whatif.noise import noise_floor, within_floor
from stragglers.whatif._replay import CHUNK_BYTES, replay
from stragglers.whatif.result import DiagnosisSummary, Finding, Interval, Where

log = logging.getLogger(__name__)

STRAGGLING = STRAGGLING_SLOWDOWN  # older name, kept for importers
FIXES = {
    "worker_fault": "replace or restart the slow worker (stragglers.adapt KILL_RESTART), or route "
                    "around it (StragglAR, gradient coding)",
    "slow_group": "re-split each step's work in proportion to the workers' measured speed "
                  "(stragglers.adapt's DD policy; `stragglers advise` prices it), or move the "
                  "slow group onto the same hardware as the fast one",
    "host_stall": "find the host-side work on that worker before or between its ops (data "
                  "loading: more DataLoader workers, pinned memory, prefetch; logging, "
                  "checkpointing) and move it off the critical path",
    "stage_imbalance": "rebalance layers across stages (stragglers.mitigate.suggest_stage_split); "
                       "where the heavy stage's layers are no heavier than the others', its "
                       "devices are slow (a trace shows both alike): replace them or move the "
                       "stage onto others",
    "sequence_imbalance": "balance Σs² across DP ranks and microbatches "
                          "(stragglers.mitigate.balance_sequences)",
    "expert_imbalance": "balance the routing: an auxiliary load-balancing loss or a higher "
                        "weight on it, a capacity factor (tokens beyond it dropped or sent to "
                        "a second choice), or move hot experts onto ranks of their own",
    "gc": "plan GC: automatic GC off, gc.collect() on all ranks at the same step "
          "(stragglers.mitigate.PlannedGC)",
    "communication": "check the slow link or collective on the named workers (NIC, switch port, "
                     "NCCL settings); where the hosts are busy, check too that the waiting "
                     "processes get a CPU promptly (more processes or threads than cores "
                     "delays every receive)",
    "cpu_contention": "give every rank's busy threads a core: fewer ranks, intra-op threads "
                      "(OMP_NUM_THREADS, torch.set_num_threads) or DataLoader workers per host, "
                      "other work off those hosts, ranks pinned to distinct cores",
}

# Causes found by comparing workers with each other: from a trace of some ranks of a job they
# say nothing of the ranks not traced (docs/whatif.md §7, partial traces).
CROSS_RANK = ("worker_fault", "slow_group", "host_stall", "stage_imbalance", "sequence_imbalance",
              "expert_imbalance", "communication", "cpu_contention")


def diagnose(w: WhatIf, trace: Trace, config: DiagnosisConfig | None = None,
             scores: dict[tuple[int, int], float] | None = None,
             partial: "Coverage | None" = None
             ) -> tuple[list[Finding], DiagnosisSummary]:
    """(findings, summary): findings most valuable first, [`none`] or [`unexplained`] if no cause.

    `scores` maps (dp rank, stage) → S_w where the attribution was computed (for evidence).
    `partial`: the trace holds only some ranks of its job. With one worker traced no cross-rank
    cause is looked for; with several, those found are labelled as among the traced ranks; and
    without findings the verdict is `partial`, never a job-wide `none` or `unexplained`.
    """
    cfg = config or DEFAULT
    ctx = Context.build(w, trace, cfg)
    found = []
    for name, detect in DETECTORS.items():
        if partial is not None and partial.workers < 2 and name in CROSS_RANK:
            continue
        # each candidate keeps only the rows its fix changes: no copy of the job's grid each
        got = detect(ctx, scores) if name == "worker_fault" else detect(ctx)
        found += [_compact(c, w) for c in got]
        del got
    del ctx   # its cached arrays (balanced costs, pause-free durations) are the detectors'
    found = [c for c in found
             if not (partial is not None and partial.workers < 2 and c.cause in CROSS_RANK)]
    if partial is not None:
        for c in found:
            if c.cause in CROSS_RANK:
                c.evidence = f"among the {partial.traced_text} only: " + c.evidence
                c.where.scope = "traced ranks"
    # a host stall's delays are host-side work, not waits: they stay in every duration fix's
    # basis until that stall is fixed too (`_kept_delays`)
    # (those whose gain alone is real: a stall the gate drops names no host-side work)
    stalls = [c for c in found if c.delay is not None
              and _clears(c, *_alone_gain(_before_after(w, c, []), c, cfg), cfg)]
    alone = [_before_after(w, cand, stalls) for cand in found]

    def judged(i: int, others: list[Candidate]) -> tuple[Finding, bool]:
        """Candidate i's finding, and whether it is reported, with `others` fixed first."""
        cand = found[i]
        t_now, t_fix, excess = alone[i]
        entry = _finding(cand, t_now, t_fix, excess, cfg)
        # A cause can hide behind another (a heavy stage behind a slow worker that every DP
        # rank waits for): it also counts when fixing it buys enough once the others are fixed.
        if not _clears(cand, entry.speedup_if_fixed, entry.low, cfg) and others:
            t_rest, t_both = _after_others(w, cand, others, stalls)
            after = float(t_rest.mean() / t_both.mean())
            lo, hi = ratio_interval(t_rest, t_both, cfg, cand.strata)
            entry.speedup_after_others = after
            if _clears(cand, after, lo, cfg):
                entry.speedup_if_fixed, entry.basis = after, "after_others"
                if entry.interval is not None:
                    entry.interval = Interval(min(lo, after), max(hi, after))
                entry.evidence += (f"; it pays once the other causes are fixed (×{after:.2f}; "
                                   f"alone ×{entry.speedup_alone:.2f})")
        return entry, _clears(cand, entry.speedup_if_fixed, entry.low, cfg)

    first = [judged(i, found[:i] + found[i + 1:]) for i in range(len(found))]
    reported = [c for c, (_, ok) in zip(found, first) if ok]
    kept: list[tuple[Candidate, Finding]] = []
    for i, cand in enumerate(found):
        entry, ok = first[i]
        if ok and entry.basis == "after_others" and len(reported) < len(found):
            # once more behind the others that are reported only: a candidate reported
            # neither alone nor behind the others (its own fix slows the job) made a healthy
            # worker critical, and a fix that undid that harm looked like a gain
            entry, ok = judged(i, [c for c in reported if c is not cand])
        if ok:
            kept.append((cand, entry))
        else:
            log.debug("dropped %s: interval %s below min_gain", cand.cause, entry.interval)
    kept.sort(key=lambda ce: -(ce[1].speedup_if_fixed or 1.0))
    kept = _without_explained(w, kept, cfg, stalls)
    # The floor decides only the verdict without findings; it costs replays on big jobs.
    floor: float | None = None if kept else noise_floor(w, cfg)
    summary = DiagnosisSummary(noise_floor=floor)
    if kept:
        fixes = [c for c, _ in kept]
        # Duration fixes and launch-delay fixes are replayed on their own bases (below), so
        # the combined step time is the product of the two ratios, per step.
        t_cost = _by_steps(w, lambda sl: (_fixed_costs(w, fixes, sl), None))
        t_delay = _by_steps(w, lambda sl: (w.cost[:, :, sl], _fixed_delays(w, fixes, sl)))
        # One basis with the findings' own (_before_after): duration fixes alone are replayed
        # without launch delays, launch-delay fixes alone with them, so one cause's share and
        # "explained" are the same number; mixed, the measured step time is the basis.
        kinds = {c.delay is None for c, _ in kept}
        if kinds == {True}:
            t_now, t_all = w.t_nodelay, t_cost
        elif kinds == {False}:
            t_now, t_all = w.t_replay, t_delay
        else:
            t_now, t_all = w.t_base, w.t_base * (t_cost / w.t_nodelay) * (t_delay / w.t_replay)
        spread = Interval(*ratio_interval(t_now, t_all, cfg)) if len(t_now) > 1 else None
        excess = float(t_now.mean() - w.t_ideal.mean())
        explained = float(t_now.mean() - t_all.mean()) / excess if excess > 0 else None
        summary = DiagnosisSummary(
            all_fixed=float(t_now.mean() / t_all.mean()),
            all_fixed_interval=spread,
            explained=explained, unexplained=None if explained is None else max(0.0, 1.0 - explained))
        return [e for _, e in kept], summary
    if partial is not None:
        return [_partial_verdict(w, partial)], summary
    return [_verdict(w, cfg, noise_floor(w, cfg) if floor is None else floor)], summary


class Coverage:
    """Which part of a job a trace holds: ranks read of the world size, workers of the grid."""

    def __init__(self, ranks_read: int, world_size: int, workers: int,
                 left_out: int = 0) -> None:
        self.ranks_read, self.world_size, self.workers = ranks_read, world_size, workers
        self.left_out = left_out   # ranks traced but left out (their ops differ: grid.py)

    @property
    def traced_text(self) -> str:
        """'2 traced ranks of 128' ('2 analysed ranks of 4' where some were left out)."""
        return (f"{self.ranks_read} {'analysed' if self.left_out else 'traced'} "
                f"rank{'s' if self.ranks_read != 1 else ''} of {self.world_size}")


def _partial_verdict(w: WhatIf, partial: Coverage) -> Finding:
    """The verdict of a partial trace without findings: what cannot be told, and how to tell."""
    s = w.slowdown
    what = ("whether the job straggles, and who does, cannot be told from one rank: a "
            "straggler shows against its peers" if partial.workers < 2 else
            "the traced ranks do not straggle against each other, but the ranks not traced "
            "may")
    if partial.left_out:
        return Finding("partial", evidence=f"only {partial.ranks_read} of {partial.world_size} "
                       f"ranks {'was' if partial.ranks_read == 1 else 'were'} analysed: "
                       f"{partial.left_out} were left out, their ops (or their DP replica's) "
                       f"differing from their stage peers' (the result's left_out): {what}. "
                       f"Their own steps give S = {s:.3f}. Have every rank record the same ops "
                       "to diagnose the job")
    return Finding("partial", evidence=f"only {partial.ranks_read} of {partial.world_size} "
                   f"ranks {'was' if partial.ranks_read == 1 else 'were'} traced: {what}. Their "
                   f"own steps give S = {s:.3f} (step-to-step variation of these ranks only). "
                   f"Trace all {partial.world_size} ranks over the same steps to diagnose the "
                   "job")


def _alone_gain(times: tuple, cand: Candidate, cfg: DiagnosisConfig
                ) -> tuple[float | None, float | None]:
    """(gain, interval's lower end) of a candidate fixed alone ((before, after, _) times)."""
    t_now, t_fix, _ = times
    entry = _finding(cand, t_now, t_fix, 0.0, cfg)
    return entry.speedup_if_fixed, entry.low


def _clears(cand: Candidate, gain: float | None, lo: float | None, cfg: DiagnosisConfig) -> bool:
    """Whether a candidate is reported: the gate shared with advise (confidence.gain_is_real),
    with the candidate's detector saying whether it is established apart from noise."""
    return gain is not None and lo is not None and gain_is_real(gain, lo, cfg, cand.established)


def _without_explained(w: WhatIf, kept: list[tuple[Candidate, Finding]],
                       cfg: DiagnosisConfig, stalls: list[Candidate] | None = None
                       ) -> list[tuple[Candidate, Finding]]:
    """The kept findings, strongest first, less those the others already explain.

    A cause can look like another: a DP rank whose sequences were the longest in two steps
    computes longer in those steps, as a slow worker would. Fixing the real cause (Σs²
    balanced) then leaves nothing for the apparent one to buy. Each finding's gain is tried
    once every other remaining finding is fixed: with all of them fixed, none is left to
    mask it (a slow worker that every DP rank waits for hides how much balancing sequences
    would buy), so a gain that falls below the gate and to under half of its gain alone
    means the others' fixes already remove its slowness: the same slowness counted twice.
    It is dropped and named in the evidence of the finding whose fix removes most of it.
    Weakest first, so of two causes that explain each other the stronger stays.
    """
    stalls = stalls or []
    out = list(kept)
    for cand, entry in reversed(kept):
        others = [c for c, _ in out if c is not cand]
        if not others or entry.basis != "alone":
            continue
        # a duration's slowness is another duration fix's or none: a host stall fixed removes
        # no work, it moves the critical path, so what the others' fixes leave is held against
        # the gain with the stalls among them fixed, not alone (balancing sequences that a
        # stalled rank's late start made pay ×1.06 bought ×1.02 once the stall and a slow link
        # were fixed, and was dropped as explained: diagnosis_combinations seed 33 job 242)
        fixed_stalls = [c for c in others if c.delay is not None]
        gain = entry.speedup_if_fixed or 1.0
        if cand.delay is None and fixed_stalls:
            if len(fixed_stalls) == len(others):
                continue    # no duration fix among them: nothing removes its slowness
            s_rest, s_both = _after_others(w, cand, fixed_stalls, stalls)
            gain = float(s_rest.mean() / s_both.mean())
        t_rest, t_both = _after_others(w, cand, others, stalls)
        after = float(t_rest.mean() / t_both.mean())
        lo, _ = ratio_interval(t_rest, t_both, cfg, cand.strata)
        if _clears(cand, after, lo, cfg) or after - 1 >= 0.5 * (gain - 1):
            continue
        out = [(c, e) for c, e in out if c is not cand]
        by = _explainer(w, cand, out, stalls)
        by.evidence += (f"; fixing it also removes an apparent "
                        f"{cand.cause.replace('_', ' ')} ({_place(entry.where)}: "
                        f"×{entry.speedup_if_fixed:.2f} alone, ×{after:.2f} once the "
                        f"other causes are fixed)")
        log.debug("dropped %s: explained by the others", cand.cause)

    return out


def _explainer(w: WhatIf, cand: Candidate, out: list[tuple[Candidate, Finding]],
               stalls: list[Candidate]) -> Finding:
    """The entry, of the findings left, whose fix alone leaves `cand` the least to buy."""
    if len(out) == 1:
        return out[0][1]
    gains = []
    for other, entry in out:
        t_rest, t_both = _after_others(w, cand, [other], stalls)
        gains.append(float(t_rest.mean() / t_both.mean()))
    return out[int(np.argmin(gains))][1]


def _place(where: Where) -> str:
    """A short 'where' for evidence: workers, else stages, else 'the job'."""
    if where.workers:
        names = [f"dp {x.dp} pp {x.pp}" for x in where.workers[:3]]
        more = f" +{len(where.workers) - 3} more" if len(where.workers) > 3 else ""
        text = ", ".join(names) + more
    elif where.pp:
        text = "stage(s) " + ", ".join(map(str, where.pp))
    else:
        text = "the job"
    if where.steps:
        text += " in steps " + fmt_steps(where.steps)
    return text


def _before_after(w: WhatIf, cand: Candidate, stalls: list[Candidate]):
    """(step times before, after the fix, straggler excess) on the fix's own basis.

    A duration fix is replayed without launch delays (the basis of S, docs/whatif.md §5): the measured
    delays also hold waits the dependency model does not explain, which would stay fixed while
    the work moves; but with the delays the host stalls among `stalls` name (host-side work
    that fixing only this leaves in place: `_kept_delays`). A launch-delay fix (host stall) is
    replayed with the delays, its basis.
    """
    cost, delay = _rows(cand.cost, w.cost), _rows(cand.delay, w.launch_delay)
    if delay is None and stalls:
        def before(sl: slice):
            """The measured costs of the steps sl, with the stalls' delays."""
            return w.cost[:, :, sl], _kept_delays(w, stalls, sl)

        def after_fix(sl: slice):
            """The fix's costs of the steps sl, with the stalls' delays."""
            return (w.cost[:, :, sl] if cost is None else cost.steps(w.cost, sl),
                    _kept_delays(w, stalls, sl))

        t_now = _by_steps(w, before)
        return t_now, _by_steps(w, after_fix), float(t_now.mean() - w.t_ideal.mean())

    def fixed(sl: slice):
        """The fix's costs (and delays) of the steps sl."""
        return (w.cost[:, :, sl] if cost is None else cost.steps(w.cost, sl),
                None if delay is None else delay.steps(w.launch_delay, sl))

    after = _by_steps(w, fixed)
    if delay is None:
        return w.t_nodelay, after, float(w.t_nodelay.mean() - w.t_ideal.mean())
    return w.t_replay, after, float(w.t_replay.mean() - w.t_ideal.mean())


def _kept_delays(w: WhatIf, stalls: list[Candidate], sl: slice) -> np.ndarray | None:
    """The launch delays of the steps sl that the host stalls `stalls` (not fixed) name as
    host-side work (what their fixes remove), zero elsewhere; None where there are none.

    The basis of a duration fix drops the measured delays, and with them a host stall that
    fixing only the duration leaves in place: a slow link hidden behind a rank's stall was
    priced ×1.13 (its true gain ×1.00), balancing sequences ×1.02 (true ×1.07, dropped;
    diagnosis_combinations seed 33 job 242).
    """
    if not stalls:
        return None
    return w.launch_delay[:, :, sl] - _fixed_delays(w, stalls, sl)


def _after_others(w: WhatIf, cand: Candidate, others: list[Candidate],
                  stalls: list[Candidate]):
    """Step times with the other candidates fixed, then with this one fixed too (its basis).

    The others are fixed as far as their slowness goes (`Candidate.cleared`): a slow group's
    re-split leaves its stage at the workers' summed speed, and a slow rank of the next
    stage, hidden behind that, bought ×1.004 after it and was not named (the rank ×1.24, the
    group ×2.04; diagnosis_slow_group_stages seed 2 job 38)."""
    held = [replace(c, cost=c.cleared) if c.cleared is not None else c for c in others]
    left = [s for s in stalls if not any(s is c for c in others)]   # stalls not fixed

    def fixed(cands: list[Candidate]) -> Callable[[slice], tuple]:
        """The costs of the steps sl with `cands` fixed (and their delays: a delay fix)."""
        # a launch-delay fix on its own basis (with delays), but over the others' fixed costs
        # too: a stall that other ranks' GC pauses cover in most steps shows once GC is fixed
        return lambda sl: (_fixed_costs(w, cands, sl),
                           _kept_delays(w, left, sl) if cand.delay is None
                           else _fixed_delays(w, cands, sl))

    return _by_steps(w, fixed(held)), _by_steps(w, fixed(held + [cand]))


def _finding(cand: Candidate, t_now: np.ndarray, t_fix: np.ndarray, excess: float,
             cfg: DiagnosisConfig) -> Finding:
    """The finding of a candidate, fixing only it (basis `alone`)."""
    speedup = float(t_now.mean() / t_fix.mean())
    lo, hi = ratio_interval(t_now, t_fix, cfg, cand.strata)
    share = (float(t_now.mean()) - float(t_fix.mean())) / excess if excess > 0 else None
    # one step: no spread over steps to give an interval from (reports say so)
    interval = Interval(min(lo, speedup), max(hi, speedup)) if len(t_now) > 1 else None
    return Finding(cand.cause, cand.where, cand.evidence, speedup_if_fixed=speedup,
                   fix=FIXES.get(cand.cause), interval=interval,
                   upper_bound=bool(cand.upper_bound), share=share,
                   speedup_after_others=speedup, capacity_factor=cand.capacity_factor,
                   speedup_alone=speedup, basis="alone")


def _fixed_costs(w: WhatIf, cands: list[Candidate], sl: slice) -> np.ndarray:
    """Costs of the steps sl with every fix applied: each fix scales cells, so the scalings
    multiply (a fix's own rows only: elsewhere its scale is exactly 1)."""
    cost = w.cost[:, :, sl].copy()
    for c in cands:
        fix = _rows(c.cost, w.cost)
        if fix is not None:
            measured = w.cost[fix.nodes, :, sl]
            scale = np.ones_like(measured)
            np.divide(fix.values[:, :, sl], measured, out=scale, where=measured > 0)
            cost[fix.nodes] *= scale
    return cost


def _fixed_delays(w: WhatIf, cands: list[Candidate], sl: slice) -> np.ndarray:
    """Launch delays of the steps sl with every delay fix applied (the least of them)."""
    delay = w.launch_delay[:, :, sl].copy()
    for c in cands:
        late = _rows(c.delay, w.launch_delay)
        if late is not None:
            delay[late.nodes] = np.minimum(delay[late.nodes], late.values[:, :, sl])
    return delay


def _compact(cand: Candidate, w: WhatIf) -> Candidate:
    """The candidate with its fix as the rows it changes (a new one: the detectors' context
    may hold the original)."""
    return replace(cand, cost=_rows(cand.cost, w.cost), delay=_rows(cand.delay, w.launch_delay),
                   cleared=_rows(cand.cleared, w.cost))


def _rows(fixed: np.ndarray | Rows | None, base: np.ndarray) -> Rows | None:
    """A fix's values as the rows it changes (None: no fix)."""
    if fixed is None or isinstance(fixed, Rows):
        return fixed
    return Rows.of(fixed, base)


def _by_steps(w: WhatIf, fixed: Callable[[slice], tuple[np.ndarray, np.ndarray | None]]
              ) -> np.ndarray:
    """Step times of a replay whose costs and delays `fixed(steps)` gives, a step slice at a
    time: each slice's copy, not the job's (steps replay independently: the same numbers)."""
    n, d, t = w.cost.shape
    span = max(1, CHUNK_BYTES // max(1, n * d * 8))
    out = []
    for lo in range(0, t, span):
        sl = slice(lo, min(lo + span, t))
        cost, delay = fixed(sl)
        out.append(replay(w.plan, cost, w.step_start[sl], delay))
    return np.concatenate(out)


def _verdict(w: WhatIf, cfg: DiagnosisConfig, floor: float) -> Finding:
    """`none` (not straggling, or S within the noise floor) or `unexplained`."""
    s = w.slowdown
    if s < cfg.straggling_slowdown:
        return Finding("none", evidence=f"S = {s:.3f} < {cfg.straggling_slowdown}: the job is "
                       f"not straggling (waste {100 * (1 - 1 / s):.1f}%) and no cause buys "
                       f"×{cfg.min_gain} or more")
    if within_floor(w, cfg):
        return Finding("none", evidence=f"S = {s:.3f} is what op-to-op jitter of the measured "
                       f"size alone gives on this job (noise floor S = {floor:.3f}, with "
                       f"{len(w.grid.dp_ranks)} DP ranks × {w.grid.pp_size} stages): no cause "
                       "stands out")
    return Finding("unexplained", evidence=f"S = {s:.3f} (noise floor {floor:.3f}) but no single "
                   "cause explains it; see the attribution by op type, stage and DP rank")


__all__ = ["diagnose", "STRAGGLING", "STRAGGLING_SLOWDOWN", "FIXES", "OPTYPES", "DiagnosisConfig"]
