"""Align rank clocks on the end times of matched collectives (ends are nearly simultaneous)."""

from __future__ import annotations

import numpy as np

from stragglers.trace.kineto.ops import RING_SYNC
from stragglers.trace.kineto.ringclock import Span, read_ring

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


def clock_offsets(sync: dict[int, dict[tuple, float]], hosts: dict[int, str | None] | None = None,
                  spans: dict[int, dict[tuple, Span]] | None = None,
                  peers: dict[int, dict[str, tuple[int, int]]] | None = None
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
        if spans is not None and peers and common and not _rank(common):
            placed = _place_by_ring(_firm_set(r, pending, sync, hosts), offsets, sync, hosts,
                                    spans, peers)
            if placed is not None:
                for c, (off, q) in placed[0].items():
                    if c in pending:
                        pending.remove(c)
                    offsets[c], quality[c] = off, q
                notes += placed[1]
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


def _firm_set(r: int, pending: list[int], sync: dict[int, dict[tuple, float]],
              hosts: dict[int, str | None]) -> list[int]:
    """`r` and the pending ranks linked to it, directly or not, by firm sync points or a host."""
    found, todo = {r}, [r]
    while todo:
        a = todo.pop()
        for b in pending:
            if b not in found and ((hosts.get(a) and hosts.get(a) == hosts.get(b))
                                   or _rank(sync[a].keys() & sync[b].keys())):
                found.add(b)
                todo.append(b)
    return sorted(found)


def _place_by_ring(ranks: list[int], offsets: dict[int, float],
                   sync: dict[int, dict[tuple, float]], hosts: dict[int, str | None],
                   spans: dict[int, dict[tuple, Span]], peers: dict[int, dict[str, tuple[int, int]]]
                   ) -> tuple[dict[int, tuple[float, dict]], list[str]] | None:
    """{rank: (offset, quality)} for `ranks` (aligned among themselves first) placed against the
    aligned ranks by their ring exchanges (ringclock), and notes; None where the exchanges
    say nothing (no neighbour across, or bounds that contradict each other)."""
    inner, inner_q, notes = clock_offsets({c: sync[c] for c in ranks}, hosts)
    got = read_ring(offsets, inner, spans, peers)
    lo, hi = got.low, got.high
    if not got.rounds or lo > hi + END_TOLERANCE_S or not (got.waits or np.isfinite(hi - lo)):
        return None
    agreeing = 0
    if got.waits:
        # the waits read the offset to within the transfer times' spread
        tol = min(END_TOLERANCE_S, max(4 * float(np.median(got.transfer_s)), 1e-4))
        d, agreeing = consensus_offset(np.array(got.waits), tol)
        d = float(np.clip(d, lo, hi)) if lo <= hi else (lo + hi) / 2
    else:
        d = (lo + hi) / 2
        if hi - lo > END_TOLERANCE_S:
            notes.append(f"rank(s) {', '.join(map(str, ranks))} meet the others only in ring "
                         "exchanges, in which no rank waited for the other side: their clock is "
                         f"known only to ±{(hi - lo) / 2 * 1e6:.0f} µs (the exchanges' causality)")
    ring = {"rounds": got.rounds, "waits_read": len(got.waits), "agreeing": agreeing,
            "bounds_s": [float(lo), float(hi)]}
    out = {}
    for c in ranks:
        q = {k: v for k, v in inner_q.get(c, {}).items() if k != "reference"}
        out[c] = (inner[c] + d, {**q, "ring": ring, "matched": q.get("matched", got.rounds),
                                  "agreeing": q.get("agreeing", agreeing)})
    return out, notes
