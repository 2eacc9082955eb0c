"""Align rank clocks on the end times of matched collectives (ends are nearly simultaneous)."""

from __future__ import annotations

import numpy as np


def clock_offsets(sync: dict[int, dict[tuple, float]]) -> tuple[dict[int, float], dict[int, dict],
                                                                 list[str]]:
    """Per-rank clock offsets (seconds, to subtract) so each rank's median end offset is 0.

    sync maps rank → {collective key → end time}. The lowest rank is the reference; a rank that
    shares no collective with it is aligned to the already aligned rank it shares most with.
    Returns (offsets, per-rank quality {matched, spread_s}, notes).
    """
    ranks = sorted(sync)
    if not ranks:
        return {}, {}, []
    offsets = {ranks[0]: 0.0}
    quality: dict[int, dict] = {ranks[0]: {"matched": None, "spread_s": 0.0}}
    notes: list[str] = []
    pending = ranks[1:]
    while pending:
        best = None
        for r in pending:
            for a in offsets:
                common = sync[r].keys() & sync[a].keys()
                if best is None or len(common) > len(best[2]):
                    best = (r, a, common)
        r, a, common = best
        pending.remove(r)
        if not common:
            offsets[r] = 0.0
            quality[r] = {"matched": 0, "spread_s": None}
            notes.append(f"rank {r} shares no collective with the other ranks; its clock is "
                         "not aligned")
            continue
        diffs = np.array([sync[r][k] - sync[a][k] for k in common])
        off = float(np.median(diffs)) + offsets[a]
        offsets[r] = off
        resid = diffs - np.median(diffs)
        quality[r] = {"matched": int(len(common)),
                      "spread_s": float(np.max(np.abs(resid))) if len(resid) else 0.0}
    return offsets, quality, notes
