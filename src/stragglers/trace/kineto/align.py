"""Align rank clocks on the end times of matched collectives (ends are nearly simultaneous)."""

from __future__ import annotations

import numpy as np

from stragglers.trace.kineto.ops import RING_SYNC

# Ends of one collective on different ranks agree to well under this; pairs further apart than
# this from the consensus are mismatched (sampled or filtered traces drop some collectives).
END_TOLERANCE_S = 1e-3


def consensus_offset(diffs: np.ndarray, tolerance: float = END_TOLERANCE_S) -> tuple[float, int]:
    """(median of the largest group of differences within `tolerance`, size of that group)."""
    d = np.sort(diffs)
    # For every i, how many differences lie in [d[i], d[i] + tolerance].
    counts = np.searchsorted(d, d + tolerance, side="right") - np.arange(len(d))
    best = counts.max()
    # Among equally dense windows take the one nearest the overall median.
    candidates = np.flatnonzero(counts == best)
    i = candidates[np.argmin(np.abs(d[candidates] - np.median(d)))]
    return float(np.median(d[i:i + best])), int(best)


def clock_offsets(sync: dict[int, dict[tuple, float]], hosts: dict[int, str | None] | None = None
                  ) -> tuple[dict[int, float], dict[int, dict], list[str]]:
    """Per-rank clock offsets (seconds, to subtract) so each rank's median end offset is 0.

    sync maps rank → {collective key → end time}. The lowest rank is the reference; a rank that
    shares no collective with it is aligned to the already aligned rank it shares most with.
    The median is taken over the pairs that agree with each other (mismatched pairs from
    sampled traces would otherwise pull it). Ranks whose trace names the same host share one
    clock and are not shifted against each other: there, end times differ only by scheduling
    jitter (milliseconds for gloo on a busy CPU), which would be worse than no correction.
    Returns (offsets, per-rank quality, notes).
    """
    hosts = hosts or {}
    ranks = sorted(sync)
    if not ranks:
        return {}, {}, []
    offsets = {ranks[0]: 0.0}
    quality: dict[int, dict] = {ranks[0]: {"reference": True}}
    notes: list[str] = []
    pending = ranks[1:]
    weak = []
    while pending:
        best: tuple[int, int, set[tuple]] | None = None
        for r in pending:
            for a in offsets:
                common = _firm(sync[r].keys() & sync[a].keys())
                if best is None or (_rank(common), len(common)) > (_rank(best[2]),
                                                                    len(best[2])):
                    best = (r, a, common)
        assert best is not None     # pending and offsets are both non-empty here
        r, a, common = best
        pending.remove(r)
        same = next((b for b in offsets if hosts.get(r) and hosts.get(b) == hosts.get(r)), None)
        if same is not None:
            offsets[r] = offsets[same]
            quality[r] = {"same_host_as": same, "host": hosts[r]}
            continue
        if not common:
            offsets[r] = 0.0
            quality[r] = {"matched": 0, "agreeing": 0}
            notes.append(f"rank {r} shares no collective with the other ranks; its clock is "
                         "not aligned")
            continue
        diffs = np.array([sync[r][k] - sync[a][k] for k in common])
        off, agreeing = consensus_offset(diffs)
        offsets[r] = off + offsets[a]
        resid = np.abs(diffs - off)
        quality[r] = {"reference_rank": a, "matched": int(len(common)), "agreeing": agreeing,
                      "median_residual_s": float(np.median(resid[resid <= END_TOLERANCE_S]))}
        if agreeing < max(2, len(common) // 2 + 1):
            weak.append(r)
    if weak:
        notes.append(f"clock alignment of {len(weak)} rank(s) (e.g. rank {weak[0]}) rests on few "
                     "agreeing collectives: matched collectives disagree, as in sampled traces")
    return offsets, quality, notes


def _firm(keys: set[tuple]) -> set[tuple]:
    """The keys whose ends all members share; a ring exchange's (ops.RING_SYNC: each rank's
    round ends with its own neighbours') only where there are no others."""
    firm = {k for k in keys if not k or k[0] != RING_SYNC}
    return firm or keys


def _rank(keys: set[tuple]) -> int:
    """1 where `keys` are firm sync points, 0 where ring exchanges only (or none)."""
    return int(any(not k or k[0] != RING_SYNC for k in keys))
